#!/usr/bin/env bash
# Served throughput of the real upgrade per new-model runtime (issue 50): for each runtime, paced Locust runs
# at rising offered loads, each on a fresh service and a flushed Redis, so the highest load still answered
# with p99 <= 100 ms and nothing failed can be read off per runtime, in one sweep on one box.
#
#   loadtest/served_runtimes.sh [--real artifacts/real] [--runtimes torch,onnx-int8,onnx-fp32,torch-bf16]
#                               [--rates 40,60,80,100] [--paced-users 64] [--duration 30s] [--out DIR]
#
# Runtimes: torch (float32), torch-bf16 (NOBACKFILL_NEW__CPU_BF16), onnx-fp32 and onnx-int8 (NOBACKFILL_NEW__RUNTIME=
# onnx over `nobackfill encoder export`'s folders, made under OUT first when missing).  Each run is loadtest/run.sh
# --real with PACED_USERS Poisson users (independent arrivals, as from many clients) sharing the offered rate,
# the corpus's 3,000 test + support queries in one shuffled order, no hot set, one query a request, mode slerp.
# The new model runs as 2 copies x 1 thread in child processes (NOBACKFILL_NEW__REPLICAS / __THREADS in the
# environment win).  The runtimes take turns at each rate, so a change of machine load meets all of them.
# Prints one line per run and a table: offered and answered requests/s, p50 / p99 ms, failures.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
REAL=artifacts/real RUNTIMES=torch,onnx-int8,onnx-fp32 RATES=40,60,80,100 PACED_USERS=64 DURATION=30s
OUT=loadtest/results/served-runtimes PORT=8032 DB=8
declare -A FLAGS=([--real]=REAL [--runtimes]=RUNTIMES [--rates]=RATES [--paced-users]=PACED_USERS
  [--duration]=DURATION [--out]=OUT [--port]=PORT)
source loadtest/flags.sh
parse_flags "$@"
export NOBACKFILL_NEW__REPLICAS=${NOBACKFILL_NEW__REPLICAS:-2} NOBACKFILL_NEW__THREADS=${NOBACKFILL_NEW__THREADS:-1}
export NOBACKFILL_OLD__THREADS=${NOBACKFILL_OLD__THREADS:-1} HF_HUB_OFFLINE=1
REDIS_URL=redis://127.0.0.1:6379/$DB
MODEL=$REAL/models/all-MiniLM-L6-v2
mkdir -p "$OUT"
for precision in fp32 int8; do
  case ",$RUNTIMES," in *,onnx-$precision,*)
    [ -f "$OUT/onnx-$precision/model.onnx" ] || "$BIN/nobackfill" encoder export "$MODEL" --out "$OUT/onnx-$precision" \
      $([ "$precision" = int8 ] && echo --int8) ;;
  esac
done

runtime_env() {  # the service's settings for one runtime, as VAR=value words
  case "$1" in
    torch) echo "NOBACKFILL_NEW__RUNTIME=torch" ;;
    torch-bf16) echo "NOBACKFILL_NEW__RUNTIME=torch NOBACKFILL_NEW__CPU_BF16=true" ;;
    onnx-fp32|onnx-int8) echo "NOBACKFILL_NEW__RUNTIME=onnx NOBACKFILL_NEW__ONNX_DIR=$OUT/$1" ;;
    *) echo "unknown runtime $1 (torch, torch-bf16, onnx-fp32, onnx-int8)" >&2; exit 2 ;;
  esac
}

for RATE in ${RATES//,/ }; do
  for RUNTIME in ${RUNTIMES//,/ }; do
    RUN="$OUT/$RUNTIME-$RATE"
    PER_USER=$("$BIN/python" -c "print($RATE / $PACED_USERS)")
    redis-cli -n "$DB" flushdb >/dev/null 2>&1 || true
    echo "$RUNTIME at $RATE requests/s ($PACED_USERS Poisson users x $PER_USER)"
    env $(runtime_env "$RUNTIME") loadtest/run.sh --real "$REAL" --users "$PACED_USERS" --spawn-rate "$PACED_USERS" \
      --duration "$DURATION" --port "$PORT" --redis-url "$REDIS_URL" --out "$RUN" -- \
      --mode-mix slerp:1 --batch-mix 1:1 --repeat-ratio 0 --user-rate "$PER_USER" >"$RUN.log" 2>&1 || true
    cp loadtest/report.md "$RUN/report.md" 2>/dev/null || true  # run.sh writes it in place: keep each run's
  done
done

"$BIN/python" - "$OUT" "$RUNTIMES" "$RATES" <<'EOF'
import csv, json, sys
from pathlib import Path
out, runtimes, rates = Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3].split(",")
print("| runtime | served as (/v1/info) | offered requests/s | answered requests/s | p50 ms | p99 ms | failed |")
print("|---|---|---:|---:|---:|---:|---:|")
for runtime in runtimes:
    best = None
    for rate in rates:
        stats = out / f"{runtime}-{rate}" / "locust_stats.csv"
        if not stats.is_file():
            print(f"| {runtime} | | {rate} | no result: see {out}/{runtime}-{rate}.log | | | |")
            continue
        new = json.loads((out / f"{runtime}-{rate}" / "info.json").read_text())["new_model"]
        served = f"{new['runtime']} {new.get('precision') or new.get('dtype')}, {new['replicas']} x {new['threads']} thread"
        with stats.open() as f:
            total = next(r for r in csv.DictReader(f) if r["Name"] == "Aggregated")
        failed, p99 = int(total["Failure Count"]), float(total["99%"])
        print(f"| {runtime} | {served} | {rate} | {float(total['Requests/s']):.1f} | {total['50%']} | {total['99%']} | {failed} |")
        if failed == 0 and p99 <= 100:
            best = max(best or 0.0, float(total["Requests/s"]))
    most = "none" if best is None else f"{best:.1f}"
    print(f"| {runtime}: most answered with p99 <= 100 ms and none failed | | | {most} | | | |")
EOF
