"""A few seconds of the real Locust load test against a served small gallery, so it cannot rot."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def test_locust_headless_run_and_report(served: str, tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    locust = subprocess.run(
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
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert locust.returncode == 0, locust.stderr[-3000:]
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
