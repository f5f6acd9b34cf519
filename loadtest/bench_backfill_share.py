"""The served latency with a throttled `backfill run` on the same box, against none, phases alternating.

    .venv/bin/python loadtest/bench_backfill_share.py --items 100000 --rate 1000 --threads 1 --nice 10 --phase-s 20

Uses the synthetic world bench_hybrid.py builds (its gallery, item store and profile; built here
when missing).  Starts `nobackfill serve` on it (no segment: the backfill shares the CPU, not the
index), sends a paced stream of one-query searches, and alternates phases of `--phase-s` seconds:
no backfill, then `backfill run --rate R` into a scratch segment, twice each.  Prints p50 / p99 of
each kind of phase and the ratio with / without; docs/backfill.md records a run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest.bench_hybrid import WORK, build  # noqa: E402
from loadtest.benchlib import free_port, percentiles, size_folder, wait_ready  # noqa: E402

NOBACKFILL = [sys.executable, "-m", "service.cli"]


async def _paced(url: str, qps: float, seconds: float, items: int) -> list[float]:
    """Latencies (s) of one-query searches sent every 1 / qps seconds for `seconds` (never more than 64 in flight)."""
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:

        async def one(i: int) -> None:
            body = {"queries": [{"text": f"item-{(i * 7919) % items:010d} caption-1"}], "k": 10, "mode": "slerp"}
            start = time.perf_counter()
            response = await client.post("/v1/search", json=body)
            response.raise_for_status()
            latencies.append(time.perf_counter() - start)

        tasks, start = [], time.perf_counter()
        for i in range(int(qps * seconds)):
            await asyncio.sleep(max(0.0, start + i / qps - time.perf_counter()))
            tasks.append(asyncio.ensure_future(one(i)))
            if len([t for t in tasks if not t.done()]) > 64:
                raise RuntimeError("the service fell behind the pace: lower --qps")
        await asyncio.gather(*tasks)
    return latencies


def main() -> None:
    """Parse flags, start the service, run the phases, print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=2000.0, help="backfill --rate (items/s)")
    parser.add_argument("--threads", type=int, default=1, help="backfill --threads (torch CPU threads)")
    parser.add_argument("--nice", type=int, default=0, help="backfill --nice (its CPU priority below the service's)")
    parser.add_argument("--qps", type=float, default=40.0)
    parser.add_argument("--phase-s", type=float, default=20.0)
    parser.add_argument("--work", type=Path, default=WORK)
    args = parser.parse_args()
    work = size_folder(args.work, args.items)
    build(work, args.items, [])
    port = free_port()
    env = {
        **os.environ,
        "NOBACKFILL_INDEX__GALLERY_DIR": str(work / "gallery"),
        "NOBACKFILL_COMPAT__PROFILE_DIR": str(work / "profile"),
        "NOBACKFILL_API__PORT": str(port),
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    server = subprocess.Popen([*NOBACKFILL, "serve"], cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    samples: dict[str, list[float]] = {"no backfill": [], "backfill --rate": []}
    try:
        if not wait_ready(f"{url}/readyz", 60.0, poll_s=0.5):
            raise RuntimeError("the service did not become ready in 60 s")
        asyncio.run(_paced(url, args.qps, 3.0, args.items))  # warm-up, not counted
        with tempfile.TemporaryDirectory() as scratch:
            for phase in ("no backfill", "backfill --rate") * 2:
                backfill = None
                if phase == "backfill --rate":
                    segment = Path(scratch) / "segment"
                    shutil.rmtree(segment, ignore_errors=True)
                    command = [
                        *NOBACKFILL, "backfill", "run", "--nice", str(args.nice), "--segment", str(segment),
                        "--input", str(work / "items"), "--gallery", str(work / "gallery"), "--backend",
                        "synthetic-new", "--new-model-id", "synthetic-new", "--order", "random",
                        "--rate", str(args.rate), "--threads", str(args.threads), "--json",
                    ]  # fmt: skip
                    backfill = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    time.sleep(3.0)  # past its imports and model load: the phase times the moving itself
                samples[phase] += asyncio.run(_paced(url, args.qps, args.phase_s, args.items))
                if backfill is not None:
                    if backfill.poll() is not None:
                        raise RuntimeError("the backfill ended before the phase did: lower --rate or --phase-s")
                    backfill.kill()
                    backfill.wait()
    finally:
        server.terminate()
        server.wait(timeout=30)
    base = percentiles(samples["no backfill"])
    print("| phase | requests | p50 ms | p99 ms | p50 ratio | p99 ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for phase, times in samples.items():
        stats = percentiles(times)
        print(
            f"| {phase} | {len(times)} | {stats['p50_ms']:.2f} | {stats['p99_ms']:.2f} | "
            f"{stats['p50_ms'] / base['p50_ms']:.3f} | {stats['p99_ms'] / base['p99_ms']:.3f} |"
        )


if __name__ == "__main__":
    main()
