#!/usr/bin/env bash
# `make test` on a busy box: a fresh clone of HEAD, RUNS runs in a row with HOGS pure-Python busy loops
# (`python -c "while True: pass"`) beside it, the way a shared CI machine or a laptop under load runs it.
# A test that only passes on an idle box waits on a clock instead of a condition; this finds it.
#
#   loadtest/busy_box.sh [--runs 3] [--hogs 2] [--dir /tmp/nobackfill-busy] [--log artifacts/bench/busy_box]
#
# The clone installs its own .venv first (not timed, no hog); then each run's wall time, exit status and
# pytest's summary line are appended to LOG/summary.txt, each run's whole output to LOG/run-N.log.
# Exit 0 only when every run passed.  It uses the machine's Redis (DB 15, as make test does): run no
# other `make test` on this box meanwhile.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=3 HOGS=2 DIR=/tmp/nobackfill-busy LOG=artifacts/bench/busy_box
declare -A FLAGS=([--runs]=RUNS [--hogs]=HOGS [--dir]=DIR [--log]=LOG)
source loadtest/flags.sh
parse_flags "$@"
LOG=$(realpath -m "$LOG")
mkdir -p "$LOG"
rm -rf "$DIR"
git clone -q "$(pwd)" "$DIR"
commit=$(git -C "$DIR" rev-parse --short HEAD)
make -C "$DIR" install > "$LOG/install.log" 2>&1

hogs=()
stop_hogs() { [ ${#hogs[@]} -eq 0 ] || kill "${hogs[@]}" 2>/dev/null || true; }
trap stop_hogs EXIT
for _ in $(seq "$HOGS"); do python3 -c "while True: pass" & hogs+=($!); done

echo "commit $commit, $(nproc) cores, $HOGS hogs, $(date -u +%FT%TZ)" | tee -a "$LOG/summary.txt"
failed=0
for run in $(seq "$RUNS"); do
  start=$(date +%s)
  if make -C "$DIR" test > "$LOG/run-$run.log" 2>&1; then rc=0; else rc=$?; failed=1; fi
  wall=$(( $(date +%s) - start ))
  line=$(grep -E "(passed|failed|error)" "$LOG/run-$run.log" | tail -1)
  printf 'run %s: rc=%s wall=%dm%02ds %s\n' "$run" "$rc" $((wall / 60)) $((wall % 60)) "$line" | tee -a "$LOG/summary.txt"
done
exit $failed
