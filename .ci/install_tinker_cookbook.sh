#!/usr/bin/env bash
# Create (or reuse) the virtual environment that runs tinker-cookbook loops against rljax's Tinker API.
#
# tinker-cookbook pins transformers<=5.5.4 (and brings torch; 0.6.x needs tml-renderers>=0.4.1,
# which the package index here lacks, hence 0.5.8), so it lives in its OWN venv, never in
# rljax's; it talks to the server (rljax serve) over HTTP only. The math-rl extra
# (sympy, pylatexenc, math-verify) is what recipes/rl_loop.py's gsm8k grader imports. Tests
# (tests/train/test_tinker_cookbook.py) find its python via $RLJAX_TINKER_COOKBOOK_PYTHON or
# <repo>/.tinker-cookbook-venv/bin/python.
#
# Idempotent and quick on re-run: a venv stamped with the current specs is kept at once; an unstamped
# one whose minimal loops (recipes.sl_loop, recipes.rl_loop) import is stamped and kept; anything else
# is rebuilt (~3 min).
# Usage: .ci/install_tinker_cookbook.sh [VENV_DIR]   (default: $RLJAX_TINKER_COOKBOOK_VENV or .tinker-cookbook-venv)
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
COOKBOOK_SPEC=${RLJAX_TINKER_COOKBOOK_SPEC:-tinker-cookbook[math-rl]==0.5.8}
TINKER_SPEC=${RLJAX_TINKER_SPEC:-tinker==0.38.0}
VENV=${1:-${RLJAX_TINKER_COOKBOOK_VENV:-.tinker-cookbook-venv}}
PY=${RLJAX_TINKER_COOKBOOK_BASE_PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
start=$(date +%s)

check() {
  "$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md
import tinker_cookbook.recipes.rl_loop  # noqa: F401  (imports the math-rl grader)
import tinker_cookbook.recipes.sl_loop  # noqa: F401
print("tinker-cookbook", md.version("tinker-cookbook"), "tinker", md.version("tinker"),
      "transformers", md.version("transformers"))
PYEOF
}

. .ci/venv_stamp.sh
WANT="$COOKBOOK_SPEC $TINKER_SPEC torch==2.13.0"
if ! reuse_venv install_tinker_cookbook "$VENV" "$WANT"; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "torch==2.13.0"
  "$VENV/bin/pip" install -q "$COOKBOOK_SPEC" "$TINKER_SPEC"
  check
  stamp_venv "$VENV" "$WANT"
fi
echo "install_tinker_cookbook: venv $VENV ready in $(( $(date +%s) - start )) s"
echo "install_tinker_cookbook: export RLJAX_TINKER_COOKBOOK_PYTHON=$(cd "$VENV" && pwd)/bin/python"
