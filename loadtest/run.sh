#!/usr/bin/env bash
# Bounded end-to-end load test: start what is missing (Redis, the service on GALLERY/PROFILE),
# run Locust headless, scrape /metrics meanwhile, then write loadtest/report.md and PNG plots.
#
#   loadtest/run.sh [--gallery DIR] [--profile DIR] [--users 32] [--spawn-rate 8] [--duration 60s]
#                   [--port 8000] [--out loadtest/results] [--redis-url URL] [--real DIR] [-- extra locust args]
#
# --real DIR serves the real upgrade of `nobackfill demo --real` (DIR: artifacts/real): its two
# sentence-transformers models, gallery and profile at the demo's nprobe, and sends the corpus's test
# and support queries as the query texts.  Other NOBACKFILL_* variables in the environment reach the
# service as they are (e.g. NOBACKFILL_NEW__THREADS=2 NOBACKFILL_OLD__THREADS=1).
# CPU: the box's /proc/stat and the service's CPU time are read when Locust starts and ends, and
# Locust's own CPU time is taken by /usr/bin/time (report.py turns them into cores used).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
GALLERY=artifacts/demo/gallery PROFILE=artifacts/demo/profile USERS=32 SPAWN=8 DURATION=60s PORT=8000
OUT=loadtest/results REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0} EXTRA=() REAL=
declare -A FLAGS=([--gallery]=GALLERY [--profile]=PROFILE [--users]=USERS [--spawn-rate]=SPAWN [--duration]=DURATION
  [--port]=PORT [--out]=OUT [--redis-url]=REDIS_URL [--real]=REAL [--]=EXTRA)
source loadtest/flags.sh
parse_flags "$@"
mkdir -p "$OUT"
HOST="http://127.0.0.1:$PORT"
PIDS=()
QUERIES=()
if [ -n "$REAL" ]; then
  GALLERY=$REAL/gallery PROFILE=$REAL/profile
  export NOBACKFILL_OLD__BACKEND=sentence-transformers NOBACKFILL_OLD__PATH=$REAL/models/minilm-static-256
  export NOBACKFILL_NEW__BACKEND=sentence-transformers NOBACKFILL_NEW__PATH=$REAL/models/all-MiniLM-L6-v2
  export NOBACKFILL_INDEX__NPROBE=${NOBACKFILL_INDEX__NPROBE:-32} HF_HUB_OFFLINE=1
  QUERIES=(--queries-file "$REAL/corpus/test.jsonl,$REAL/corpus/support.jsonl")
fi
SERVICE_PID=
cleanup() { for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

redis_host=$(echo "$REDIS_URL" | sed -E 's#redis://([^:/]+):?([0-9]*).*#\1#')
redis_port=$(echo "$REDIS_URL" | sed -E 's#redis://([^:/]+):?([0-9]*).*#\2#'); redis_port=${redis_port:-6379}
if ! redis-cli -h "$redis_host" -p "$redis_port" ping >/dev/null 2>&1; then
  echo "starting redis-server on $redis_host:$redis_port"
  redis-server --port "$redis_port" --bind "$redis_host" --save "" --appendonly no >"$OUT/redis.log" 2>&1 &
  PIDS+=($!)
fi

if ! curl -sf "$HOST/readyz" >/dev/null 2>&1; then
  [ -f "$GALLERY/gallery.json" ] || { echo "no gallery at $GALLERY (make demo builds one)" >&2; exit 2; }
  echo "starting the service on $HOST ($GALLERY, $PROFILE)"
  NOBACKFILL_INDEX__GALLERY_DIR=$GALLERY NOBACKFILL_COMPAT__PROFILE_DIR=$PROFILE \
    NOBACKFILL_CACHE__REDIS_URL=$REDIS_URL NOBACKFILL_API__PORT=$PORT \
    "$BIN/nobackfill" serve >"$OUT/service.log" 2>&1 &
  SERVICE_PID=$!
  PIDS+=("$SERVICE_PID")
  for _ in $(seq 1 300); do curl -sf "$HOST/readyz" >/dev/null 2>&1 && break; sleep 1; done
  curl -sf "$HOST/readyz" >/dev/null || { echo "service not ready; see $OUT/service.log" >&2; exit 1; }
fi

# What was served (encoders with their runtime, gallery, profile), kept beside the results.
curl -sf "$HOST/v1/info" >"$OUT/info.json" 2>/dev/null || true

# Scrape /metrics every 5 s for the cache-hit-ratio plot; the last scrape holds the stage breakdown.
( while true; do
    printf '### %s\n' "$(date +%s)"; curl -sf "$HOST/metrics" || true; sleep 5
  done ) >"$OUT/metrics.txt" 2>/dev/null &
PIDS+=($!)

# CPU snapshot: the box's cpu line of /proc/stat, the service's utime + stime (clock ticks) and its
# encoder processes', their major page faults, the box's IO stall time, the time.
cpu_snapshot() {
  { head -1 /proc/stat; echo "ticks_per_s $(getconf CLK_TCK)"; echo "cores $(nproc)"
    [ -n "$SERVICE_PID" ] && awk '{print "service", $14, $15}' "/proc/$SERVICE_PID/stat"
    # One pass over the service and its encoder child processes (isolation: process): the children's
    # utime + stime, and the major page faults (pages read back from disk: evicted code or weights) of all.
    [ -n "$SERVICE_PID" ] && for pid in "$SERVICE_PID" $(pgrep -P "$SERVICE_PID"); do
        awk -v service="$SERVICE_PID" '{print ($1 == service), $14 + $15, $12}' "/proc/$pid/stat"; done \
      | awk '{if (!$1) ticks += $2; faults += $3} END {print "encoder_processes", ticks + 0; print "major_faults", faults + 0}'
    # Microseconds since boot during which some task waited on IO (a VM short of page cache shows here).
    sed -n 's/^some .*total=\([0-9]*\)$/io_stall_us \1/p' /proc/pressure/io
    echo "time $(date +%s.%N)"; } >"$1" 2>/dev/null || true
}
TIMED=()
[ -x /usr/bin/time ] && TIMED=(/usr/bin/time -f 'locust_wall %e\nlocust_user %U\nlocust_sys %S' -o "$OUT/locust-time.txt")

status=0
cpu_snapshot "$OUT/cpu-start.txt"
"${TIMED[@]}" "$BIN/locust" -f loadtest/locustfile.py --headless --host "$HOST" --users "$USERS" --spawn-rate "$SPAWN" \
  --run-time "$DURATION" --stop-timeout 10 --csv "$OUT/locust" --csv-full-history --only-summary \
  --hit-report "$OUT/hit_at_10.json" "${QUERIES[@]}" "${EXTRA[@]}" || status=$?
cpu_snapshot "$OUT/cpu-end.txt"
curl -sf "$HOST/metrics" >"$OUT/metrics-final.txt"
"$BIN/python" loadtest/report.py --results "$OUT" --out loadtest/report.md
exit "$status"  # Locust exits non-zero when any request failed
