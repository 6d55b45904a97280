"""Memory figures of the train step, for the per-step metrics and the memory benchmark.

Two sources, both reported when available:

* **XLA's static estimate** of a compiled step (:func:`compiled_memory`): arguments + outputs -
  donated aliases + temporaries of the executable, in bytes. It is exact for what XLA allocates for
  the step on one device (activations, gradients, optimizer update), deterministic, and available on
  every backend (CPU included). Metric ``memory/step_bytes`` (and ``memory/step_temp_bytes``).
* **The device allocator's peak** (:func:`device_peak_bytes`): ``peak_bytes_in_use`` of the local
  devices' ``memory_stats()`` (GPU/TPU; the CPU backend reports none). Metric ``memory/peak_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

__all__ = ["compiled_memory", "device_peak_bytes", "step_memory_metrics"]


def compiled_memory(jitted: Any, *args: Any) -> dict[str, float]:
    """``{"step_bytes", "step_temp_bytes"}`` of ``jitted(*args)`` from XLA's memory analysis.

    ``jitted`` is a ``jax.jit`` function; the executable comes from JAX's compilation cache when
    ``jitted`` already ran on arguments of these shapes (then this costs about a millisecond).
    Returns ``{}`` when the backend gives no analysis.

    >>> import jax.numpy as jnp
    >>> f = jax.jit(lambda x: (x @ x.T).sum())
    >>> compiled_memory(f, jnp.ones((64, 32)))["step_bytes"] >= 64 * 32 * 4
    True
    """
    analysis = jitted.lower(*args).compile().memory_analysis()
    if analysis is None:
        return {}
    temp = float(analysis.temp_size_in_bytes)
    total = (
        float(analysis.argument_size_in_bytes)
        + float(analysis.output_size_in_bytes)
        - float(analysis.alias_size_in_bytes)
        + temp
    )
    return {"step_bytes": total, "step_temp_bytes": temp}


def device_peak_bytes() -> float | None:
    """The largest ``peak_bytes_in_use`` over this process's devices; None where none is reported."""
    peaks = []
    for device in jax.local_devices():
        try:
            stats = device.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(float(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def step_memory_metrics(jitted: Callable[..., Any], *args: Any) -> dict[str, float]:
    """The per-step memory metrics (``memory/step_bytes``, ``memory/step_temp_bytes`` and, on
    devices that report it, ``memory/peak_bytes``) of ``jitted(*args)``.

    >>> import jax.numpy as jnp
    >>> sorted(step_memory_metrics(jax.jit(lambda x: x + 1), jnp.ones(4)))[:2]
    ['memory/step_bytes', 'memory/step_temp_bytes']
    """
    out = {f"memory/{k}": v for k, v in compiled_memory(jitted, *args).items()}
    peak = device_peak_bytes()
    if peak is not None:
        out["memory/peak_bytes"] = peak
    return out
