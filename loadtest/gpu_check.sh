#!/usr/bin/env bash
# GPU check for a lent accelerator host (issue 10): the in-process benchmark of the query path with the
# two REAL encoders on CUDA (loadtest/bench_real.py) at 10^5 gallery items, bounded to under 5 minutes.
# One GPU: both encoders on cuda:0, each behind its own batcher thread and CUDA stream; two: cuda:0 / cuda:1.
#
# The host is bare: python3 (3.12) with torch, transformers and sentence-transformers, but no faiss,
# pydantic, fastapi, redis or model2vec, and no package registry.  Prepare on this machine first:
#     loadtest/gpu_wheels.sh      # .whl/: the missing wheels + the float16 MiniLM and the corpus (gpu_bundle.py)
# then run there with the device tool: command "bash loadtest/gpu_check.sh", carry [".whl"], timeout_s 420.
# Steps: (1) install .whl/*.whl into /tmp/site (no index, no deps) and put it and the repository on
# PYTHONPATH; (2) unpack MiniLM (float16) and the corpus into artifacts/real-gpu and distil the old static
# model from that MiniLM (model2vec, 256-d, as `realworld models` does); (3) bench_real.py, which builds
# the rest as `demo --real` does (support build, encode, gallery, fit, eval, all on the GPU) and the 10^5
# galleries, then times every variant and prints the tables to record in docs/benchmarks.md, first with the
# encoders in child processes (isolation: process, the service's default for these models), then, if
# the budget allows, on threads of one process.
# The old model is thus distilled there from the float16 teacher: a sibling of ours, with its own profile.
#
#   bash loadtest/gpu_check.sh [--queries 300] [more bench_real.py arguments]
#   GPU_CHECK_DEVICE=cpu NO_INSTALL=1 PY=.venv/bin/python BUDGET_S=1800 bash loadtest/gpu_check.sh
#       a dry run of every step but the wheel install on CPU (this venv has the packages; MiniLM on CPU
#       needs far more than 5 minutes for the support set and the gallery texts)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
SITE=${SITE:-/tmp/site}
REAL=${REAL:-artifacts/real-gpu}
WORK=${WORK:-artifacts/bench-real-gpu}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
started=$(date +%s)
step() { echo "== $(( $(date +%s) - started )) s: $*"; }

ls .whl/*.whl >/dev/null 2>&1 || { echo "no wheels in .whl/: run loadtest/gpu_wheels.sh first and carry .whl" >&2; exit 2; }
if [ "${NO_INSTALL:-0}" != 1 ]; then
  step "installing $(ls .whl/*.whl | wc -l) wheels into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" - <<'EOF'
import sys

import faiss, model2vec, pydantic, pydantic_settings, sentence_transformers, torch, transformers

print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}, sentence-transformers {sentence_transformers.__version__}, "
      f"faiss {faiss.__version__}, pydantic {pydantic.__version__}, model2vec {model2vec.__version__}")
EOF

if [ "${GPU_CHECK_DEVICE:-cuda}" = cpu ]; then
  OLD_DEVICE=cpu NEW_DEVICE=cpu
  echo "dry run on CPU"
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  [ "$GPUS" -ge 1 ] || { echo "torch sees no GPU" >&2; exit 1; }
  OLD_DEVICE=cuda:0 NEW_DEVICE=cuda:0
  [ "$GPUS" -ge 2 ] && NEW_DEVICE=cuda:1
  echo "torch sees $GPUS GPU(s): old encoder on $OLD_DEVICE, new on $NEW_DEVICE"
fi

if [ ! -f "$REAL/models/all-MiniLM-L6-v2/model.safetensors" ]; then
  step "unpacking the float16 MiniLM and the corpus into $REAL"
  "$PY" loadtest/gpu_bundle.py unpack --bundle .whl/bundle --out "$REAL"
fi
step "distilling the old static model from it (cached)"
"$PY" - "$REAL/models" <<'EOF'
import sys
from pathlib import Path

from service.realdata.models import MINILM_NAME, distill_static, static_name

models = Path(sys.argv[1])
distill_static(models / MINILM_NAME, models / static_name(256), pca_dims=256)
EOF

# Bounded: what is left of BUDGET_S (290 s), so the whole check ends inside 5 minutes.
bench() {
  left=$(( ${BUDGET_S:-290} - ($(date +%s) - started) ))
  [ "$left" -gt "$2" ] || { echo "skipped: $left s left"; return 0; }
  timeout "$left" "$PY" loadtest/bench_real.py --real-dir "$REAL" --work "$WORK" --sizes 100000 --queries 300 \
    --threads default --old-device "$OLD_DEVICE" --new-device "$NEW_DEVICE" --isolation "$1" "${@:3}" \
    || echo "bench_real.py --isolation $1 exited $?"
}
step "bench_real.py, encoders in child processes (prepares the rest of the real upgrade, the 10^5 galleries, then times)"
bench process 0 "$@"
# The same with the encoders on threads of one process, if time is left: does isolation pay on CUDA too?
step "bench_real.py, encoders on threads of one process"
bench thread 45 "$@"
step "done"
