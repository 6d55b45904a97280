#!/usr/bin/env bash
# Create (or reuse) the virtual environment of the Google Tunix benchmark peer (benchmarks/tunix_peer.py).
#
# Optional: only `python benchmarks/generation_bench.py --tunix` and `python benchmarks/train_step_bench.py
# --tunix` use it (rljax vs Tunix on the same model, weights and workload); `./run test` does NOT call
# this script. Tunix brings its own dependency set (datasets, grain, tensorflow_datasets, transformers,
# qwix, ...), so it lives in its OWN venv, never in rljax's; the benchmarks talk to it through a
# subprocess. jax / jaxlib / flax / optax are pinned to the versions rljax runs (read from rljax's
# venv when it exists), so both sides compile with the same XLA. The benchmarks find its python via
# $RLJAX_TUNIX_PYTHON or <repo>/.tunix-venv/bin/python.
#
# Idempotent and quick on re-run: a venv stamped with the current specs is kept at once; an unstamped
# one whose Tunix modules import at the wanted versions is stamped and kept; anything else is rebuilt
# (~3-5 min).
# Usage: .ci/install_tunix.sh [VENV_DIR]   (default: $RLJAX_TUNIX_VENV or .tunix-venv)
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
TUNIX_SPEC=${RLJAX_TUNIX_SPEC:-google-tunix==0.1.7}
VENV=${1:-${RLJAX_TUNIX_VENV:-.tunix-venv}}
PY=${RLJAX_TUNIX_BASE_PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
RLJAX_PY=${RLJAX_VENV:-.venv}/bin/python
start=$(date +%s)

# The jax stack rljax runs (so both benchmarks use one XLA); fixed fallbacks without rljax's venv.
pins() {
  if [ -x "$RLJAX_PY" ]; then
    "$RLJAX_PY" - <<'PYEOF'
import importlib.metadata as md
print(" ".join(f"{p}=={md.version(p)}" for p in ("jax", "jaxlib", "flax", "optax")))
PYEOF
  else
    echo "jax==0.10.2 jaxlib==0.10.2 flax==0.12.8 optax==0.2.8"
  fi
}
PINS=$(pins)

check() {
  "$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md
import tunix.generate.sampler  # noqa: F401  (what the peer imports)
import tunix.models.qwen3.params  # noqa: F401
import tunix.rl.grpo.grpo_learner  # noqa: F401
import tunix.rl.trainer  # noqa: F401
print(" ".join(f"{p}=={md.version(p)}" for p in ("google-tunix", "jax", "jaxlib", "flax", "optax")))
PYEOF
}

. .ci/venv_stamp.sh
WANT="$TUNIX_SPEC $PINS"
if ! reuse_venv install_tunix "$VENV" "$WANT" exact; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  # shellcheck disable=SC2086  # PINS is a list of requirement specs
  "$VENV/bin/pip" install -q "$TUNIX_SPEC" $PINS
  check
  stamp_venv "$VENV" "$WANT"
fi
echo "install_tunix: venv $VENV ready in $(( $(date +%s) - start )) s"
echo "install_tunix: export RLJAX_TUNIX_PYTHON=$(cd "$VENV" && pwd)/bin/python"
