"""XLA:CPU compile time under the test suite's flags (the suite's time is mostly compiling).

Each flag set runs in its own process (``XLA_FLAGS`` is read once, at start-up), the sets taking turns
(A, B, C, A, B, C, ...), and with no persistent compilation cache. Each process measures:

* ``train step``: ``lower(...).compile()`` of a jitted value-and-grad of a tiny Qwen3 and a tiny
  Qwen3-MoE (``rljax.models.tiny``) on a [4, 64] batch, the kind of program the tests compile most;
* ``eager``: 60 loops of six small jnp ops on a new shape each (every op compiles once per shape, as
  eager test code does).

It prints the best of ``--repeats`` per flag set and the ratio of each set to the suite's current
flags (``tests/xla_flags.py``).

    python benchmarks/compile_bench.py             # XLA defaults, LLVM -O0, the suite's flags
    python benchmarks/compile_bench.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from xla_flags import FAST_COMPILE  # noqa: E402

FLAG_SETS = {
    "XLA defaults": "",
    "LLVM -O0 only": "--xla_backend_optimization_level=0",
    "the suite's (tests/xla_flags.py)": FAST_COMPILE,
}

_CHILD = r"""
import json, time
import jax, jax.numpy as jnp
from flax import nnx
from rljax.models.tiny import tiny_model

out = {}
for model_type in ("qwen3", "qwen3_moe"):
    graphdef, state = nnx.split(tiny_model(model_type))
    tokens = jnp.zeros((4, 64), jnp.int32)

    def loss(state, tokens):
        return jnp.mean(nnx.merge(graphdef, state)(tokens))

    lowered = jax.jit(jax.value_and_grad(loss)).lower(state, tokens)
    start = time.perf_counter()
    lowered.compile()
    out[f"train step {model_type}"] = time.perf_counter() - start
start = time.perf_counter()
for n in range(1, 61):
    x = jnp.ones((n, 7))
    jnp.sort(jnp.cumsum(x * 2 + 1, axis=0), axis=0).sum().block_until_ready()
out["eager (60 shapes x 6 ops)"] = time.perf_counter() - start
print(json.dumps(out))
"""


def measure(flags: str) -> dict[str, float]:
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": ""}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="processes per flag set (best reported)")
    args = parser.parse_args()
    best: dict[str, dict[str, float]] = {name: {} for name in FLAG_SETS}
    for _ in range(args.repeats):
        for name, flags in FLAG_SETS.items():
            for key, seconds in measure(flags).items():
                best[name][key] = min(best[name].get(key, float("inf")), seconds)
    ours = best["the suite's (tests/xla_flags.py)"]
    load = os.getloadavg()[0]
    print(f"compile seconds, best of {args.repeats} processes per flag set (load average {load:.1f})")
    for name, flags in FLAG_SETS.items():
        cells = ", ".join(f"{k} {v:.2f} s ({v / ours[k]:.1f}x the suite's)" for k, v in best[name].items())
        print(f"  {name} [{flags or 'none'}]: {cells}")


if __name__ == "__main__":
    main()
