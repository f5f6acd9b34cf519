#!/usr/bin/env bash
# GPU check for a lent accelerator host: the in-process pipeline benchmark with both encoders on GPU
# (one GPU: both on cuda:0, each batcher on its own thread and CUDA stream; two: cuda:0 and cuda:1).
# Prints the same tables as on CPU; record them in docs/benchmarks.md. Bounded: small gallery, few queries.
#   bash loadtest/gpu_check.sh [--sizes 100000] [--queries 300]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0   # the CUDA build where the host's index serves one
  "$VENV/bin/pip" install -q -e . || exit 1
  "$VENV/bin/pip" install -q 'faiss-gpu-cu12>=1.8' || echo "faiss-gpu unavailable: search stays on CPU"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
GPUS=$("$VENV/bin/python" -c "import torch; print(torch.cuda.device_count())")
[ "$GPUS" -ge 1 ] || { echo "torch sees no GPU" >&2; exit 1; }
NEW_DEVICE=cuda:0; [ "$GPUS" -ge 2 ] && NEW_DEVICE=cuda:1
echo "torch sees $GPUS GPU(s): old on cuda:0, new on $NEW_DEVICE"
timeout 540 "$VENV/bin/python" loadtest/bench_pipeline.py --old-device cuda:0 --new-device "$NEW_DEVICE" \
  --encoder-ms 0 --encoder-item-ms 0 --sizes 100000 --queries 300 "$@"
