"""Serve the Tinker training API (the protocol of the ``tinker`` SDK 0.38.0) for a config's model.

    rljax serve --config=tinker --port=8000 --workdir=/tmp/rljax_tinker

then, in any process::

    import tinker
    service = tinker.ServiceClient(base_url="http://127.0.0.1:8000", api_key="any")
    training = service.create_lora_training_client(base_model="rljax/tiny", rank=8)

The model is the config's (``model.hf_path`` = an HF checkpoint directory, else a fresh model of
``model.init``; ``tokenizer.name``), listed by ``get_server_capabilities`` under ``--base_model``
(default: the checkpoint directory's name, or ``rljax/tiny``). Bound to 127.0.0.1 unless ``--host``
says otherwise; ``--api_key`` (repeatable) makes the server refuse other keys. Checkpoints
(``save_state``, ``save_weights_for_sampler``) go to ``<workdir>/tinker/<model_id>/`` and survive a
restart: ``load_state`` / ``create_sampling_client(model_path=...)`` read them back. Sampling
clients run on the embedded sampler, or, when the config names vLLM engines
(``configs/tinker_vllm.py``), on vLLM servers (base model and adapters without an unembedding
target; ``rljax.tinker.sampling``).
"""

from __future__ import annotations

import types

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from rljax.cli.common import recipe_path

_FLAGS = types.SimpleNamespace()  # the flag holders, once define_flags() ran


def define_flags() -> None:
    """The subcommand's absl flags, defined only when it runs: importing this module (the docs,
    tests) must not claim flag names that other subcommands define in the same process."""
    _FLAGS.config = config_flags.DEFINE_config_file(
        "config", str(recipe_path("tinker")), "The run config of the served model (a file or a recipe name)."
    )
    _FLAGS.port = flags.DEFINE_integer("port", 8000, "Port to listen on.")
    _FLAGS.host = flags.DEFINE_string(
        "host", "127.0.0.1", "Interface to bind (127.0.0.1: this machine only)."
    )
    _FLAGS.workdir = flags.DEFINE_string("workdir", "/tmp/rljax_tinker", "Where checkpoints are written.")
    _FLAGS.base_model = flags.DEFINE_string(
        "base_model", None, "Name clients use for the model (default: derived)."
    )
    _FLAGS.api_keys = flags.DEFINE_multi_string(
        "api_key", [], "Accepted API keys (none given: any key is accepted)."
    )
    _FLAGS.max_rank = flags.DEFINE_integer("max_lora_rank", 64, "Largest LoRA rank a client may ask for.")
    _FLAGS.lora_alpha = flags.DEFINE_float("lora_alpha", 32.0, "LoRA alpha (adapter scale alpha / rank).")
    _FLAGS.timeout = flags.DEFINE_float(
        "session_timeout_s", 120.0, "Expire sessions silent (no heartbeat) this long."
    )
    _FLAGS.min_rows = flags.DEFINE_integer(
        "min_rows", 8, "Fewest packed rows of a training step (a power of two >= it: fewer compiled shapes)."
    )
    _FLAGS.min_seq_len = flags.DEFINE_integer("min_seq_len", 32, "Shortest packed row of a training step.")
    _FLAGS.fuse = flags.DEFINE_bool(
        "fuse_clients", True, "Run queued requests of several LoRA clients (one adapter shape) as one step."
    )


def main(argv: list[str]) -> None:
    """Runs ``rljax serve`` with the parsed flags until the server is stopped (``argv`` is unused)."""
    del argv
    from rljax.extras import require

    require("tinker", "rljax serve")  # before any import of the extra's modules
    from rljax.run.preflight import plan_run

    try:
        config = plan_run(_FLAGS.config.value, rollouts=False).config  # checked whole before serving
    except (FileNotFoundError, ValueError) as e:
        raise app.UsageError(str(e)) from None
    import uvicorn

    from rljax.gateway.limits import uvicorn_options
    from rljax.tinker import build_service
    from rljax.tinker.server import DEFAULT_LIMITS, make_app

    options = dict(
        max_lora_rank=_FLAGS.max_rank.value,
        lora_alpha=_FLAGS.lora_alpha.value,
        api_keys=tuple(_FLAGS.api_keys.value),
        session_timeout_s=_FLAGS.timeout.value,
        min_rows=_FLAGS.min_rows.value,
        min_seq_len=_FLAGS.min_seq_len.value,
        fuse_clients=_FLAGS.fuse.value,
    )
    if _FLAGS.base_model.value:
        options["base_model"] = _FLAGS.base_model.value
    service = build_service(config, _FLAGS.workdir.value, **options)
    absl_logging.info(
        "serving %s on http://%s:%d", service.options.base_model, _FLAGS.host.value, _FLAGS.port.value
    )
    print(
        f"rljax Tinker API: {service.options.base_model} on http://{_FLAGS.host.value}:{_FLAGS.port.value}",
        flush=True,
    )
    try:
        uvicorn.run(
            make_app(service, limits=DEFAULT_LIMITS),
            host=_FLAGS.host.value,
            port=_FLAGS.port.value,
            log_level="warning",
            **uvicorn_options(DEFAULT_LIMITS),  # uvicorn's own header and connection bounds
        )
    finally:
        service.close()
