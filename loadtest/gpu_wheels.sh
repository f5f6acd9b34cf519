#!/usr/bin/env bash
# Prepare, on this machine, what loadtest/gpu_check.sh needs on a bare GPU host, into .whl/ (gitignored):
#   .whl/*.whl      the packages that host lacks, for CPython 3.12 manylinux x86_64, at this venv's versions:
#                   faiss-cpu (~19 MB), pydantic, pydantic-core, pydantic-settings, python-dotenv,
#                   annotated-types, typing-inspection, fastapi, starlette, uvicorn, orjson, redis, hiredis
#                   (~4 MB together), model2vec and skeletoken (its distiller's tokenizer surgery) to distil
#                   the old model there, and typing-extensions / opentelemetry-api, which pydantic 2.14 and
#                   fastapi 0.165 need newer or at all (the host's typing-extensions may predate 4.16)
#   .whl/bundle/    the new model and the corpus (loadtest/gpu_bundle.py pack)
#
# The size plan.  Everything that travels (working tree + .whl) must stay under 64 MiB (67,108,864 bytes).
# The wheels take ~23 MB.  all-MiniLM-L6-v2 is 90.9 MB in float32: it cannot go as it is.  It goes in
# float16 (45.4 MB; on CUDA the service runs it in float16 anyway, cast with the same rounding), its
# bytes split into high/low planes and xz-compressed, losslessly: ~38.7 MB.  The old static model
# (15 MB) does not travel: gpu_check.sh distils it there from that float16 MiniLM with the carried
# model2vec wheel, and re-runs support build / encode / fit on the carried corpus, so the profile it
# serves is fitted for the two models that host actually runs.  Consequence: on the GPU host the old
# model is a sibling of ours (same recipe, a float16 teacher), not the same bytes, and its eval figures
# are its own; the timed path (two encoders, transform, search) is the same code on the same shapes.
#
#   loadtest/gpu_wheels.sh          # then: run(command="bash loadtest/gpu_check.sh", carry=[".whl"])
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
PIP=${PIP:-python3 -m pip}
DEST=.whl
LIMIT=67108864
PACKAGES=(faiss-cpu pydantic pydantic-core pydantic-settings python-dotenv annotated-types typing-inspection
  fastapi starlette uvicorn orjson redis hiredis model2vec skeletoken typing-extensions opentelemetry-api)
mkdir -p "$DEST"
pins=()
for name in "${PACKAGES[@]}"; do
  version=$("$BIN/python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  pins+=("$name==$version")
done
# One version of each: stale wheels of other versions would make the install refuse to pick.
find "$DEST" -maxdepth 1 -type f -name '*.whl' -delete
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DEST" "${pins[@]}"
[ -f "$DEST/bundle/manifest.json" ] || HF_HUB_OFFLINE=1 "$BIN/python" loadtest/gpu_bundle.py pack --out "$DEST/bundle"

wheels=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
bundle=$(du -cb "$DEST"/bundle/* | tail -1 | cut -f1)
tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 du -cb 2>/dev/null \
  | awk '$2 == "total" {s += $1} END {print s}')
total=$((wheels + bundle + tree))
echo "wheels $wheels + bundle $bundle + working tree $tree = $total bytes" \
  "($(awk -v t="$total" 'BEGIN {printf "%.1f", t / 1048576}') MiB of the 64 MiB that may travel)"
[ "$total" -lt "$LIMIT" ] || { echo "over the 64 MiB that may travel" >&2; exit 1; }
