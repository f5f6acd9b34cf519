"""One real uvicorn process started by `nobackfill serve`, as an operator would run it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import World, free_port


@pytest.fixture
def served(world: World) -> Iterator[str]:
    """Start `nobackfill serve` on a free port; yield its base URL; stop it with SIGTERM."""
    port = free_port()
    env = {
        **os.environ,
        "NOBACKFILL_INDEX__GALLERY_DIR": str(world.gallery_dir),
        "NOBACKFILL_COMPAT__PROFILE_DIR": str(world.profile_dir),
        "NOBACKFILL_API__PORT": str(port),
    }
    env.pop("NOBACKFILL_CACHE__REDIS_URL", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(
                f"serve exited {process.returncode}: {process.stdout.read().decode() if process.stdout else ''}"
            )
        try:
            if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    else:
        process.kill()
        pytest.fail("the service did not become ready in 60 s")
    yield base
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=30)
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit status still tells why.
    assert process.returncode in (0, -signal.SIGTERM)
    assert b"Application shutdown complete" in output


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
