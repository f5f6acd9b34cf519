"""One real uvicorn process started by `nobackfill serve`, as an operator would run it."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from conftest import World, serve_process


def test_served_process_answers_searches_and_metrics(served: str) -> None:
    body = {"queries": [{"text": "item-0000000042 caption-1"}], "k": 5}
    first = httpx.post(f"{served}/v1/search", json=body, timeout=10)
    assert first.status_code == 200, first.text
    assert first.headers["content-type"].startswith("application/json")
    assert len(first.json()["results"][0]["ids"]) == 5
    bad = httpx.post(f"{served}/v1/search", json={"queries": []}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_input"
    exposition = httpx.get(f"{served}/metrics", timeout=10).text
    assert 'nobackfill_requests_total{mode="slerp",route="/v1/search",status="200"}' in exposition
    assert httpx.get(f"{served}/openapi.json", timeout=10).json()["info"]["title"] == "nobackfill"


def test_two_workers_add_up_their_metrics(world: World, tmp_path: Path) -> None:
    # Each request lands on either worker; /metrics from either must count all of them.
    metrics_dir = tmp_path / "metrics"
    with serve_process(world, "--workers", "2", env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}) as base:
        body = {"queries": [{"text": "item-0000000042 caption-1"}], "k": 3}
        for _ in range(12):
            with httpx.Client() as fresh:  # a new connection each time, so both workers get traffic
                assert fresh.post(f"{base}/v1/search", json=body, timeout=10).status_code == 200
        writers = {re.sub(r"\D", "", path.stem.rsplit("_", 1)[-1]) for path in metrics_dir.glob("*.db")}
        assert len(writers) >= 2, sorted(p.name for p in metrics_dir.glob("*.db"))  # both workers record
        for _ in range(3):
            exposition = httpx.get(f"{base}/metrics", timeout=10).text
            served = re.search(r'requests_total\{mode="slerp",route="/v1/search",status="200"\} (\S+)', exposition)
            assert served is not None and float(served.group(1)) == 12.0
            assert "nobackfill_build_info{" in exposition  # info metrics come from the answering worker
