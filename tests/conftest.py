"""Shared fixtures: a small synthetic world (gallery + profile) built once per session through the CLI."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

NOBACKFILL = [sys.executable, "-m", "service.cli"]
WORLD_GALLERY_SIZE = 20_000
WORLD_SUPPORT_SIZE = 4_000


def run_cli(*args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `nobackfill ARGS` as a user would; fail the test with its output if `check` and it fails."""
    done = subprocess.run([*NOBACKFILL, *map(str, args)], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        pytest.fail(f"nobackfill {' '.join(map(str, args))} exited {done.returncode}:\n{done.stderr}")
    return done


@dataclass(frozen=True)
class World:
    """Artifacts of a small synthetic upgrade: gallery, support set, profile."""

    gallery_dir: Path
    support_dir: Path
    profile_dir: Path


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    """Build a 20k-item gallery and a profile fitted on a disjoint 4k support set, once.

    NOBACKFILL_TEST_WORLD=DIR reuses a world built earlier into DIR (a developer's shortcut).
    """
    prebuilt = os.environ.get("NOBACKFILL_TEST_WORLD")
    root = Path(prebuilt) if prebuilt else tmp_path_factory.mktemp("world")
    world = World(root / "gallery", root / "support", root / "profile")
    if prebuilt and (world.profile_dir / "profile.json").exists():
        return world
    run_cli("gallery", "build", "--size", WORLD_GALLERY_SIZE, "--out", world.gallery_dir, "--nlist", 64)
    run_cli("synth", "support", "--n", WORLD_SUPPORT_SIZE, "--out", world.support_dir)
    run_cli("fit", world.support_dir, "--out", world.profile_dir, "--folds", 3)
    return world


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout_s: float = 30.0) -> None:
    """Block until something accepts connections on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


@dataclass
class PrivateRedis:
    """A redis-server of our own, so a test may stop it."""

    port: int
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        """Its URL."""
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        """Kill it (as an outage would)."""
        self.process.kill()
        self.process.wait(timeout=10)


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    """Start a throwaway redis-server on a free port."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed; `make test` needs it (apt-get install redis-server)")
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    server = PrivateRedis(port, process)
    wait_for_port(port)
    yield server
    if process.poll() is None:
        server.stop()


@pytest.fixture
def redis_url() -> str:
    """The shared test Redis that `make test` guarantees."""
    return os.environ.get("NOBACKFILL_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


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
