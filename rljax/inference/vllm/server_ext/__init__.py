"""Code that runs INSIDE vLLM server processes (their own virtual environment: no rljax, no jax).

The launcher puts this directory on the server's ``PYTHONPATH`` and passes
``--worker-extension-cls rljax_vllm_ext.RljaxWorkerExtension`` (see
:mod:`rljax.inference.vllm.server_ext.rljax_vllm_ext`); nothing here is imported by rljax itself at
run time.
"""
