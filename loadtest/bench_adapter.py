"""Benchmarks of the adapter / PSP heads: MKP training time, per-query apply latency, the digits table.

    .venv/bin/python loadtest/bench_adapter.py train   [--n 100000 --epochs 10 --threads 0]
    .venv/bin/python loadtest/bench_adapter.py latency [--runs 3000]
    .venv/bin/python loadtest/bench_adapter.py digits  [--pairs 5]

`train` generates (once, under /tmp, fixed seed) paired embeddings old = normalise(tanh(1.5 z A) + noise)
[512-d] and new = normalise(z B + noise) [768-d], z drawn tightly around 1,000 cluster centres so
neighbouring items are hard to tell apart (Procrustes reaches about 0.5 Recall@1), trains the adapter
with the default config and reports wall and process-CPU seconds (CPU seconds are the steadier figure
on a shared box), plus held-out Recall@1 of the adapter next to the Procrustes map on 10,000 extra
pairs.  `latency` times `apply` on one row (numpy path and torch path side by side, interleaved,
median of many runs).  `digits` prints the digits table of tests/system/test_digits_experiment.py for both
protocols (old-class and all-class gallery).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.compat.adapter import AdapterConfig, TrainedAdapter, train_adapter  # noqa: E402
from service.compat.metrics import default_ids, relevance, search_recall  # noqa: E402
from service.compat.procrustes import align, fit_rotation, normalize_rows  # noqa: E402

DATA = Path("/tmp/nobackfill_bench_adapter")
RESULTS = ROOT / "loadtest" / "results"
F32 = npt.NDArray[np.float32]


def machine() -> str:
    """One line naming the CPU, its core count, the load average and torch's thread count."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, load avg {load}, torch threads {torch.get_num_threads()}"


def paired_data(n: int, d_new: int = 768, d_old: int = 512, d_z: int = 64, seed: int = 0) -> tuple[F32, F32]:
    """Deterministic related pairs (not a rotation of each other), cached as .npy under /tmp."""
    DATA.mkdir(parents=True, exist_ok=True)
    tag = f"v2_{n}_{seed}"
    f_new, f_old = DATA / f"new_{tag}_{d_new}.npy", DATA / f"old_{tag}_{d_old}.npy"
    if f_new.exists() and f_old.exists():
        return np.load(f_new), np.load(f_old)
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((d_z, d_old), dtype=np.float32) / np.sqrt(d_z)
    b = rng.standard_normal((d_z, d_new), dtype=np.float32) / np.sqrt(d_z)
    centres = rng.standard_normal((1000, d_z), dtype=np.float32)
    z = centres[rng.integers(0, len(centres), n)] + 0.1 * rng.standard_normal((n, d_z), dtype=np.float32)
    old = normalize_rows(np.tanh(1.5 * z @ a) + 0.2 * rng.standard_normal((n, d_old), dtype=np.float32))
    new = normalize_rows(z @ b + 0.1 * rng.standard_normal((n, d_new), dtype=np.float32))
    np.save(f_new, new)
    np.save(f_old, old)
    return new, old


def bench_train(n: int, epochs: int, heldout: int) -> dict[str, object]:
    """Train on n pairs for `epochs`; report time and held-out Recall@1 next to Procrustes."""
    new, old = paired_data(n + heldout)
    cfg = AdapterConfig(epochs=epochs)
    wall, cpu = time.perf_counter(), time.process_time()
    adapter = train_adapter(new[:n], old[:n], cfg, progress=True)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    rel = relevance(default_ids(heldout), default_ids(heldout))
    q_new, g_old = new[n:], old[n:]
    r_adapter = search_recall(adapter.apply(q_new), g_old, rel)
    r = fit_rotation(new[:n], old[:n])
    r_procrustes = search_recall(align(q_new, r, old.shape[1])[:, : old.shape[1]], g_old, rel)
    return {
        "pairs": n,
        "dims": f"{new.shape[1]}->{old.shape[1]}",
        "epochs": epochs,
        "steps": adapter.report["steps"],
        "autocast": adapter.report["autocast"],
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "heldout_recall_adapter": r_adapter,
        "heldout_recall_procrustes": r_procrustes,
        "final_losses": adapter.report["history"][-1],
    }


def _time(fn: object, x: F32, runs: int) -> list[float]:
    """Per-call seconds of fn(x)."""
    assert callable(fn)
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        fn(x)
        out.append(time.perf_counter() - t)
    return out


def bench_latency(runs: int) -> dict[str, object]:
    """Median / p90 ms of apply on one 768-d row, numpy vs torch path, interleaved in rounds."""
    new, old = paired_data(2000, seed=1)
    adapter: TrainedAdapter = train_adapter(new, old, AdapterConfig(epochs=1), progress=False)
    x = new[:1]
    paths = {"apply (auto)": adapter.apply, "numpy path": adapter.apply_numpy, "torch path": adapter.apply_torch}
    for fn in paths.values():
        _time(fn, x, 50)  # warm caches and torch's dispatcher
    samples: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(10):  # interleave so a burst of load hits every path alike
        for name, fn in paths.items():
            samples[name] += _time(fn, x, runs // 10)
    out: dict[str, object] = {}
    for name, s in samples.items():
        out[name] = {
            "median_ms": round(1e3 * statistics.median(s), 4),
            "p90_ms": round(1e3 * float(np.percentile(s, 90)), 4),
        }
    batch = new[:1024]
    t = time.perf_counter()
    for _ in range(5):
        adapter.apply(batch)
    out["batch 1024 (torch path) ms per row"] = round(1e3 * (time.perf_counter() - t) / (5 * 1024), 5)
    out["numpy vs torch max abs diff"] = float(
        np.abs(adapter.apply_numpy(new[:256]) - adapter.apply_torch(new[:256])).max()
    )
    return out


def bench_digits(pairs: int) -> dict[str, str]:
    """The digits table for the old-class protocol (as in the test) and for an all-class gallery."""
    from tests.support.digits_models import format_table, run_experiment, summarise

    torch.set_num_threads(1)
    out = {}
    for name, old_only in (("old classes 0-4", True), ("all classes 0-9", False)):
        t = time.perf_counter()
        table = format_table(summarise([run_experiment(seed, old_only)[0] for seed in range(pairs)]))
        out[name] = table
        print(f"\n{name} ({pairs} pairs, {time.perf_counter() - t:.1f} s)\n{table}", flush=True)
    return out


def main() -> None:
    """Parse the sub-command, run it, print and save the results as JSON."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["train", "latency", "digits"])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--heldout", type=int, default=10_000)
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    ap.add_argument("--runs", type=int, default=3000)
    ap.add_argument("--pairs", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    print(f"{started}  {machine()}", flush=True)
    if args.what == "train":
        result: dict[str, object] = bench_train(args.n, args.epochs, args.heldout)
    elif args.what == "latency":
        result = bench_latency(args.runs)
    else:
        result = dict(bench_digits(args.pairs))
    result = {"started": started, "machine": machine(), "command": " ".join(sys.argv), **result}
    print(json.dumps(result, indent=2), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"adapter_{args.what}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
