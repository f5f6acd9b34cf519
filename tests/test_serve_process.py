"""One real uvicorn process started by `nobackfill serve`, as an operator would run it."""

from __future__ import annotations

import httpx


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
