#!/usr/bin/env bash
# Served throughput of the real upgrade against the bare new encoder on the same cores (issue 10), in one run:
#   1. closed loop: USERS Locust users send single slerp queries of real texts for DURATION (run.sh --real);
#   2. the bare new encoder's batched throughput at the mean batch size its micro-batcher reached in 1
#      (bench_encoder.py, same torch threads as the service's new encoder);
#   3. paced load at 70 % of that throughput (or at each of --fractions in turn: a load sweep; the service
#      is started afresh and Redis flushed for each), the same service settings: PACED_USERS Locust users, each an
#      independent Poisson source (--user-rate), so arrivals are random as from many clients, not in step;
#   4. the bare encoder again, so a change of machine load between the runs shows.
# Query mix: the corpus's 3,000 test + support queries in one shuffled order, no hot set (--repeat-ratio 0),
# Redis flushed before each run: a query repeats (and hits the cache) only once all 3,000 were sent.
#
#   loadtest/served_real.sh [--real artifacts/real] [--users 16] [--paced-users 64] [--duration 60s]
#                           [--fractions 0.7] [--out loadtest/results/served-real]
# e.g. --fractions 0.4,0.5,0.6,0.7: p50 / p99 against the offered load, to see where p99 crosses a latency target.
#
# Threads: the new encoder on every core and the static old one on 1 (NOBACKFILL_NEW__THREADS /
# NOBACKFILL_OLD__THREADS / NOBACKFILL_NEW__REPLICAS in the environment win); the bare encoder, one
# SentenceTransformer, always gets every core (BARE_THREADS overrides): the strongest single encoder,
# in float32 unless BARE_ARGS=--bf16.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
REAL=artifacts/real USERS=16 PACED_USERS=64 DURATION=60s OUT=loadtest/results/served-real PORT=8031 DB=7
FRACTIONS=0.7
declare -A FLAGS=([--real]=REAL [--users]=USERS [--paced-users]=PACED_USERS [--duration]=DURATION
  [--fractions]=FRACTIONS [--out]=OUT [--port]=PORT)
source loadtest/flags.sh
parse_flags "$@"
export NOBACKFILL_NEW__THREADS=${NOBACKFILL_NEW__THREADS:-$(nproc)} NOBACKFILL_OLD__THREADS=${NOBACKFILL_OLD__THREADS:-1}
export HF_HUB_OFFLINE=1
BARE_THREADS=${BARE_THREADS:-$(nproc)}
BARE_ARGS=${BARE_ARGS:-}  # e.g. --bf16: a bfloat16 reference for a service run with NOBACKFILL_NEW__CPU_BF16=true
REDIS_URL=redis://127.0.0.1:6379/$DB
MIX=(--mode-mix slerp:1 --batch-mix 1:1 --repeat-ratio 0)
mkdir -p "$OUT"
flush() { redis-cli -n "$DB" flushdb >/dev/null 2>&1 || true; }
bare() {
  "$BIN/python" loadtest/bench_encoder.py --model "$REAL/models/all-MiniLM-L6-v2" \
    --queries "$REAL/corpus/test.jsonl,$REAL/corpus/support.jsonl" --metrics "$OUT/closed/metrics-final.txt" \
    --threads "$BARE_THREADS" $BARE_ARGS --json "$1"
}

flush
loadtest/run.sh --real "$REAL" --users "$USERS" --spawn-rate "$USERS" --duration "$DURATION" --port "$PORT" \
  --redis-url "$REDIS_URL" --out "$OUT/closed" -- "${MIX[@]}"
cp loadtest/report.md "$OUT/closed/report.md"
bare "$OUT/bare-1.json"
BARE=$("$BIN/python" -c "import json; print(json.load(open('$OUT/bare-1.json'))['texts_per_s_at_served_batch'])")
for FRACTION in ${FRACTIONS//,/ }; do
  RATE=$("$BIN/python" -c "print($FRACTION * $BARE)")
  PER_USER=$("$BIN/python" -c "print($RATE / $PACED_USERS)")
  echo "paced run: $FRACTION of the bare encoder = $RATE requests/s ($PACED_USERS Poisson users x $PER_USER)"
  flush
  loadtest/run.sh --real "$REAL" --users "$PACED_USERS" --spawn-rate "$PACED_USERS" --duration "$DURATION" --port "$PORT" \
    --redis-url "$REDIS_URL" --out "$OUT/paced-$FRACTION" -- "${MIX[@]}" --user-rate "$PER_USER"
  cp loadtest/report.md "$OUT/paced-$FRACTION/report.md"
done
bare "$OUT/bare-2.json"
"$BIN/python" - "$OUT" "$FRACTIONS" <<'EOF'
import csv, json, sys
from pathlib import Path
out, fractions = Path(sys.argv[1]), sys.argv[2].split(",")
def total(run):
    with (out / run / "locust_stats.csv").open() as f:
        return next(r for r in csv.DictReader(f) if r["Name"] == "Aggregated")
bare = [json.loads((out / f"bare-{i}.json").read_text())["texts_per_s_at_served_batch"] for i in (1, 2)]
closed = total("closed")
served = float(closed["Requests/s"])
print(f"bare encoder at the served batch size: {bare[0]:.1f} then {bare[1]:.1f} texts/s")
print(f"closed loop: {served:.1f} requests/s = {served / bare[0]:.3f} / {served / bare[1]:.3f} of the bare encoder "
      f"(target >= 0.9), p50 {closed['50%']} ms, p99 {closed['99%']} ms, {closed['Failure Count']} failed")
for fraction in fractions:
    paced = total(f"paced-{fraction}")
    print(f"paced at {float(fraction):.0%}: {float(paced['Requests/s']):.1f} requests/s of {float(fraction) * bare[0]:.1f} "
          f"offered, p50 {paced['50%']} ms, p99 {paced['99%']} ms (target <= 100 at 70 %), {paced['Failure Count']} failed")
EOF
