"""One real uvicorn process started by `nobackfill serve`, as an operator would run it, and what only a socket shows."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import httpx

from tests.support.servers import metric_writer_pids, serve_process
from tests.support.world import World

API_KEY = "search-key"
SEARCH = {"Authorization": f"Bearer {API_KEY}"}


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

        # Which worker accepts a new connection is the kernel's choice (on a busy box one may take them all
        # for a while): send until both have answered, at least 12.
        sent = 0
        while sent < 12 or (len(metric_writer_pids(metrics_dir)) < 2 and sent < 400):
            with httpx.Client() as fresh:  # a new connection each time, so both workers get traffic
                assert fresh.post(f"{base}/v1/search", json=body, timeout=10).status_code == 200
            sent += 1
        assert len(metric_writer_pids(metrics_dir)) >= 2, sorted(
            p.name for p in metrics_dir.glob("*.db")
        )  # both workers record
        for _ in range(3):
            exposition = httpx.get(f"{base}/metrics", timeout=10).text
            served = re.search(r'requests_total\{mode="slerp",route="/v1/search",status="200"\} (\S+)', exposition)
            assert served is not None and float(served.group(1)) == sent
            assert "nobackfill_build_info{" in exposition  # info metrics come from the answering worker


def raw_http(port: int, head: bytes, *body_chunks: bytes) -> bytes:
    """Send a request head and some body chunks, never finishing the body; return what the server answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as conn:
        conn.sendall(head)
        for chunk in body_chunks:
            conn.sendall(chunk)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = conn.recv(65536)
            if not data:
                break
            answer += data
        return answer


def test_served_process_refuses_large_bodies_before_reading_them(world: World) -> None:
    env = {"NOBACKFILL_API__MAX_BODY_BYTES": "65536", "NOBACKFILL_API__API_KEY": API_KEY}
    env["NOBACKFILL_API__SHED_LAG_MS"] = "0"  # the last search must not meet load shedding on a busy box
    with serve_process(world, env=env) as base:
        port = int(base.rsplit(":", 1)[1])
        head = b"POST /v1/search HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        # A declared gigabyte, none of it sent: refused from the header alone.
        declared = raw_http(port, head + b"Content-Length: 1000000000\r\n\r\n")
        assert declared.startswith(b"HTTP/1.1 413") and b'"body_too_large"' in declared, declared[:300]
        # Chunked, no length: refused once 64 kB have arrived, although the body never ends.
        chunk = b"4000\r\n" + b" " * 0x4000 + b"\r\n"
        streamed = raw_http(port, head + b"Transfer-Encoding: chunked\r\n\r\n", *[chunk] * 6)
        assert streamed.startswith(b"HTTP/1.1 413") and b'"body_too_large"' in streamed, streamed[:300]
        assert b"x-request-id: " in streamed.lower()
        ok = httpx.post(f"{base}/v1/search", json={"queries": [{"text": "x"}]}, headers=SEARCH, timeout=10)
        assert ok.status_code == 200, ok.text
