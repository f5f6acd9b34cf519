"""Seconds of the real Locust load test against a served small gallery, and bench_real's parts, so they cannot rot."""

from __future__ import annotations

import asyncio
import csv
import json
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.support.cli import run_checked

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_locust_headless_run_and_report(served: str, tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    run_checked(
        [
            str(BIN / "locust"),
            "-f",
            str(ROOT / "loadtest/locustfile.py"),
            "--headless",
            "--host",
            served,
            "--users",
            "4",
            "--spawn-rate",
            "4",
            "--run-time",
            "4s",
            "--csv",
            str(results / "locust"),
            "--csv-full-history",
            "--only-summary",
            "--hit-report",
            str(results / "hit_at_10.json"),
        ],
        timeout=120,
        tail=3000,
    )
    with (results / "locust_stats.csv").open() as handle:
        total = next(row for row in csv.DictReader(handle) if row["Name"] == "Aggregated")
    assert int(total["Request Count"]) > 0 and int(total["Failure Count"]) == 0
    hits = json.loads((results / "hit_at_10.json").read_text())
    assert hits["slerp"]["queries"] > 0 and 0 < hits["slerp"]["hit@10"] <= 1
    (results / "metrics-final.txt").write_text(httpx.get(f"{served}/metrics", timeout=10).text)
    report = tmp_path / "report.md"
    subprocess.run(
        [sys.executable, str(ROOT / "loadtest/report.py"), "--results", str(results), "--out", str(report)],
        check=True,
        capture_output=True,
    )
    text = report.read_text()
    assert "| Aggregated |" in text and "Cache hit ratio" in text and "| slerp |" in text


def test_locust_real_texts_at_a_fixed_rate(served: str, tmp_path: Path) -> None:
    """--queries-file sends the file's texts (target_id scores hit@10) and --user-rate paces each user."""
    queries = tmp_path / "queries.jsonl"
    rows = [{"query": f"item-{item:010d} caption-1", "target_id": item} for item in range(0, 400, 7)]
    queries.write_text("".join(json.dumps(row) + "\n" for row in rows))
    results = tmp_path / "results"
    run_checked(
        [
            str(BIN / "locust"), "-f", str(ROOT / "loadtest/locustfile.py"), "--headless", "--host", served,
            "--users", "2", "--spawn-rate", "2", "--run-time", "3s", "--csv", str(results / "locust"),
            "--only-summary", "--hit-report", str(results / "hit_at_10.json"), "--queries-file", str(queries),
            "--repeat-ratio", "0", "--mode-mix", "slerp:1", "--batch-mix", "1:1", "--user-rate", "5",
        ],
        timeout=120,
        tail=3000,
    )  # fmt: skip
    with (results / "locust_stats.csv").open() as handle:
        total = next(row for row in csv.DictReader(handle) if row["Name"] == "Aggregated")
    # Two users at 5 requests/s for 3 s: about 30 requests, far below what a closed loop sends.
    assert 0 < int(total["Request Count"]) <= 60 and int(total["Failure Count"]) == 0
    hits = json.loads((results / "hit_at_10.json").read_text())
    assert hits["slerp"]["queries"] > 0 and hits["slerp"]["hit@10"] > 0  # every text carried its target id


def test_bench_real_building_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_real's gallery filler, re-indexed profile and interleaved timing, on tiny inputs (no model)."""
    monkeypatch.syspath_prepend(str(ROOT / "loadtest"))
    import bench_real
    import benchlib

    from service.bulk.encode import sidecar_identity
    from service.compat.profile import load_profile

    rng = np.random.default_rng(0)
    sources, outs = {}, {}
    for name, dim in (("old", 8), ("new", 12)):
        rows = rng.standard_normal((5, dim)).astype(np.float32)
        sources[name] = tmp_path / f"{name}-src.npy"
        np.save(sources[name], rows / np.linalg.norm(rows, axis=1, keepdims=True))
        identity = {"backend": "sentence-transformers", "model_id": f"{name}-model", "dim": dim, "count": 5}
        sources[name].with_suffix(".json").write_text(json.dumps(identity))
        outs[name] = tmp_path / f"{name}.npy"
    bench_real.expand(sources, outs, 23, sigma=0.3, seed=1)
    first = {name: np.load(path) for name, path in outs.items()}
    bench_real.expand(sources, outs, 23, sigma=0.3, seed=1)
    for name, path in outs.items():
        grown, base = np.load(path), np.load(sources[name])
        assert grown.shape == (23, base.shape[1]) and np.array_equal(grown, first[name])  # deterministic
        assert np.allclose(np.linalg.norm(grown, axis=1), 1, atol=1e-5)
        assert np.allclose(grown[:5], base, atol=1e-6)  # the real rows stay as they are
        cosines = grown @ base.T  # every filler row is a copy of item j mod 5
        assert (cosines.argmax(axis=1) == np.arange(23) % 5).all()
        identity = sidecar_identity(path, 23, base.shape[1])  # what `gallery build --from-npy` checks
        assert identity is not None and identity.model_id == f"{name}-model"

    benchlib.write_identity_profile(tmp_path / "reindexed", "new-model", 12)
    profile = load_profile(tmp_path / "reindexed")
    assert profile.old_model_id == profile.new_model_id == "new-model"
    assert np.array_equal(profile.tensors["R"], np.eye(12, dtype=np.float32))

    order: list[str] = []

    def variant(name: str) -> Callable[[int], Awaitable[None]]:
        async def call(i: int) -> None:  # noqa: ARG001 (the query index is the benchmark's, unused here)
            order.append(name)

        return call

    samples = asyncio.run(benchlib.interleave({name: variant(name) for name in ("service", "bare", "warm")}, 4))
    assert all(len(times) == 4 for times in samples.values())
    assert order[0::3] == ["service", "bare", "warm", "service"]  # who goes first rotates
    rows = benchlib.ratio_rows(samples, {"service": "re-indexed", "bare": "floor", "warm": "slerp"})
    assert rows[0]["p50_ratio"] == 1.0 and rows[1]["p50_ratio_vs_bare"] == 1.0


def test_report_reads_the_cpu_snapshots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run.sh's snapshots -> cores busy, iowait, steal, major faults and IO stall over the Locust run."""
    monkeypatch.syspath_prepend(str(ROOT / "loadtest"))
    import report

    head = "ticks_per_s 100\ncores 2\n"
    (tmp_path / "cpu-start.txt").write_text(
        f"cpu 1000 0 100 5000 10 0 0 20 0 0\n{head}service 50 10\nencoder_processes 300\n"
        "major_faults 7\nio_stall_us 1000000\ntime 100.0\n"
    )
    # 10 s later: 2000 ticks of box time, 60 % user + system, 25 % idle, 10 % iowait, 5 % steal (not idle: busy).
    (tmp_path / "cpu-end.txt").write_text(
        f"cpu 2100 0 200 5500 210 0 0 120 0 0\n{head}service 250 10\nencoder_processes 1300\n"
        "major_faults 57\nio_stall_us 3500000\ntime 110.0\n"
    )
    lines = report.cpu_lines(tmp_path)
    assert "- whole box: 1.30 cores busy (65 %); iowait 10.0 %, stolen by the hypervisor 5.0 %" in lines
    assert "- service process: 0.20 cores (2 CPU-s)" in lines
    assert "- its encoder processes (isolation: process): 1.00 cores (10 CPU-s)" in lines
    assert "- major page faults (pages read back from disk), service and encoder processes: 50" in lines
    assert "- some task waited on IO 25.0 % of the time (/proc/pressure/io)" in lines
    # Locust exits 1 when a request failed, and /usr/bin/time says so first: the report still reads its figures.
    (tmp_path / "locust-time.txt").write_text(
        "Command exited with non-zero status 1\nlocust_wall 12.0\nlocust_user 5.0\nlocust_sys 1.0\n"
    )
    assert "- Locust: 0.50 cores (6 CPU-s over its 12 s, start-up included)" in report.cpu_lines(tmp_path)
