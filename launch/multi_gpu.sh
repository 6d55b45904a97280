#!/bin/bash
# rljax on one machine with several GPUs: vLLM servers on the last VLLM_GPUS GPUs (one server per
# GPU, launched by the trainer on the initial weights), the trainer on the others as one FSDP mesh.
#
#   MODEL_PATH=/ckpts/Qwen3-0.6B bash launch/multi_gpu.sh --workdir=/runs/qwen3
#   MODEL_PATH=/ckpts/Qwen3-0.6B VLLM_GPUS=2 bash launch/multi_gpu.sh --config.trainer.num_steps=50
#
# Settings (environment variables, with defaults):
#   MODEL_PATH   HF checkpoint directory (config.json, safetensors, tokenizer files)
#   CONFIG       recipe name or config file (qwen3_gpu)
#   NUM_GPUS     the machine's GPUs (CUDA_VISIBLE_DEVICES's count, else `nvidia-smi -L`)
#   VLLM_GPUS    GPUs given to vLLM servers, one server each (4; a power-of-two count of training GPUs
#                shards evenly, a dimension that does not divide is replicated)
#   RLJAX        the rljax command (rljax)
#   RLJAX_DRY_RUN=1  print the command instead of running it
# One GPU for everything: the qwen3_1gpu recipe (docs/guides/one_gpu.md), no script needed.
set -euo pipefail

MODEL_PATH=${MODEL_PATH:?set MODEL_PATH to an HF checkpoint directory}
CONFIG=${CONFIG:-qwen3_gpu}
VLLM_GPUS=${VLLM_GPUS:-4}
RLJAX=${RLJAX:-rljax}
if [ -z "${NUM_GPUS:-}" ]; then
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    NUM_GPUS=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
  else
    NUM_GPUS=$(nvidia-smi -L | grep -c '^GPU')
  fi
fi
TRAIN_GPUS=$((NUM_GPUS - VLLM_GPUS))
if ((TRAIN_GPUS < 1 || VLLM_GPUS < 1)); then
  echo "multi_gpu.sh: NUM_GPUS=$NUM_GPUS must exceed VLLM_GPUS=$VLLM_GPUS >= 1" >&2
  exit 2
fi
SERVER_DEVICES="($(seq "$TRAIN_GPUS" $((NUM_GPUS - 1)) | sed "s/.*/'&',/" | tr -d '\n'))"

CMD=(
  "$RLJAX" train --config="$CONFIG"
  --config.model.hf_path="$MODEL_PATH" --config.tokenizer.name="$MODEL_PATH"
  --config.engine.kind=vllm --config.engine.urls="()"
  --config.engine.num_servers="$VLLM_GPUS" --config.engine.server_devices="$SERVER_DEVICES"
  --config.mesh.data=1 --config.mesh.fsdp="$TRAIN_GPUS"
  "$@"
)
if [ "${RLJAX_DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${CMD[@]}"
  echo
  exit 0
fi
exec "${CMD[@]}"
