"""BLAS on one thread while serving (service/blas_threads.py) against OpenBLAS's default pool.

    .venv/bin/python loadtest/bench_blas_threads.py --items 100000 --queries 400 --rounds 2

Over bench_hybrid.py's world (built there when missing: N synthetic items, a profile, a segment with
10 % moved): a compatible and a hybrid pipeline, the same one-query requests interleaved between the
two (benchlib.interleave), in a process of its own per setting: BLAS on one thread (what
Pipeline.build sets) or back to the pool the process started with (a thread per core).  The settings
alternate, process after process, for --rounds rounds.  Not interleaved within one process: a spinning
BLAS thread left by one request slows the next whatever that one's setting, so the two would measure
each other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest import bench_hybrid  # noqa: E402
from loadtest.benchlib import percentiles, table  # noqa: E402


async def measure(work: Path, segment: Path, queries: int, items: int, nprobe: int, default_pool: bool) -> Any:
    """p50 / p99 of compat and hybrid in this process, BLAS on one thread or (default_pool) on its own pool."""
    from threadpoolctl import ThreadpoolController, threadpool_info  # type: ignore[import-untyped]

    from service.pipeline import Pipeline

    started_with = max(pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas")
    pipelines = {
        "compat": await Pipeline.build(bench_hybrid.settings(work, None, nprobe)),
        "hybrid 10%": await Pipeline.build(bench_hybrid.settings(work, segment, nprobe)),
    }
    if default_pool:  # undo what Pipeline.build set, for this process
        ThreadpoolController().limit(limits=started_with, user_api="blas")
    try:
        samples = await bench_hybrid.timed(pipelines, queries, items)
    finally:
        for pipeline in pipelines.values():
            await pipeline.aclose()
    return {"threads": started_with if default_pool else 1, **{n: percentiles(t) for n, t in samples.items()}}


def main() -> None:
    """Parse flags, build what is missing, run the alternating processes, print the medians per setting."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=400)
    parser.add_argument("--nprobe", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one-process", choices=["one", "default"], help=argparse.SUPPRESS)  # a child's setting
    args = parser.parse_args()
    work = bench_hybrid.WORK / str(args.items)
    if args.one_process:
        segment = work / "segment-0.1"
        result = asyncio.run(
            measure(work, segment, args.queries, args.items, args.nprobe, args.one_process == "default")
        )
        print(json.dumps(result))
        return
    bench_hybrid.build(work, args.items, [0.1])
    runs: dict[str, list[Any]] = {"one": [], "default": []}
    for r in range(args.rounds):
        for setting in ("one", "default") if r % 2 == 0 else ("default", "one"):
            flags = ["--items", str(args.items), "--queries", str(args.queries), "--nprobe", str(args.nprobe)]
            done = subprocess.run(
                [sys.executable, __file__, *flags, "--one-process", setting],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            runs[setting].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}, BLAS {setting}: {runs[setting][-1]}", file=sys.stderr)
    rows = []
    for results in runs.values():
        for variant in ("compat", "hybrid 10%"):
            rows.append(
                {
                    "variant": variant,
                    "blas_threads": results[0]["threads"],
                    "p50_ms (median of rounds)": statistics.median(x[variant]["p50_ms"] for x in results),
                    "p99_ms (median of rounds)": statistics.median(x[variant]["p99_ms"] for x in results),
                }
            )
    print(table(rows))


if __name__ == "__main__":
    main()
