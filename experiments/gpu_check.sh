#!/usr/bin/env bash
# GPU check of SD3.5-Medium-sized GRPO iterations (see experiments/gpu_check.py for what it runs and prints).
#
#   bash experiments/gpu_check.sh [gpu_check.py args]      # e.g. --advantages uniform,gain --iters 2
#
# The CUDA image may have torch/transformers/peft but not diffusers (pure Python; needs huggingface_hub>=1.32,
# safetensors, regex, requests, Pillow). Supply it as wheels in .whl/ (ignored by git), fetched HERE once:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl diffusers==0.42.1 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3
#       # (peft too if the image lacks it)
#
# and carry them to the device machine (device tool: carry [".whl"]). This script installs them with --no-deps
# into /tmp/site and puts that on PYTHONPATH. Nothing here needs hydra or lightning.
# Results: printed, and written to $OUT/gpu_check.json when $OUT is set (or --json PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import diffusers, peft, omegaconf" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "gpu_check.sh: diffusers/peft/omegaconf not importable and no wheels in .whl/ (see the header of this script)" >&2
    exit 2
  fi
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec "$PY" experiments/gpu_check.py "$@"
