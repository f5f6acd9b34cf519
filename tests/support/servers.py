"""Processes a test starts and owns: a redis-server it may kill or freeze, a real `nobackfill serve`.

free_port and wait_ready are loadtest/benchlib.py's: the benchmarks start servers the same way.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import redis

from loadtest.benchlib import free_port, wait_ready
from tests.support.world import World

REDIS_SERVER = shutil.which("redis-server")


def free_cluster_port() -> int:
    """A free port whose Redis Cluster bus port (port + 10000) is a valid port and free too."""
    for _ in range(100):
        port = free_port()
        if port + 10000 > 65535:  # redis-server refuses to start: its bus port would not exist
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


class ServerProcess:
    """A test's own server process that it may kill, freeze and unfreeze, as outages do."""

    process: subprocess.Popen[bytes] | None = None

    def stop(self) -> None:
        """Kill it, as an outage would."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a paused server cannot die otherwise
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def pause(self) -> None:
        """Freeze it: connections still open, nothing answers (a hung server)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Unfreeze it."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)


class PrivateRedis(ServerProcess):
    """A redis-server on a fixed port that the test may stop, restart, pause and resume."""

    def __init__(self, workdir: Path, *extra: str) -> None:
        assert REDIS_SERVER is not None
        self.port = free_port()
        self.workdir = workdir
        self.extra = extra

    @property
    def url(self) -> str:
        """redis://127.0.0.1:PORT/0"""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start (again) on the same port, with nothing persisted, and wait until it answers."""
        assert REDIS_SERVER is not None
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(self.workdir), *self.extra]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with redis.Redis(port=self.port, socket_timeout=0.5) as client:
                    client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.02)
        raise TimeoutError(f"redis-server did not start on port {self.port}")


@contextmanager
def serve_process(world: World, *args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """Run `nobackfill serve ARGS` on a free port; yield its base URL; stop it with SIGTERM."""
    port = free_port()
    inherited = {k: v for k, v in os.environ.items() if k != "NOBACKFILL_CACHE__REDIS_URL"}  # only `env` sets it
    full_env = {
        **inherited,
        "NOBACKFILL_INDEX__GALLERY_DIR": str(world.gallery_dir),
        "NOBACKFILL_COMPAT__PROFILE_DIR": str(world.profile_dir),
        "NOBACKFILL_API__PORT": str(port),
        # Admission by expected queue time sheds a search with 503 when the box is busy (as it should);
        # no test through this helper is about that (test_admission and the chaos run are), so it is off
        # unless `env` sets it: a busy CI box once shed the operator page's search and failed two tests.
        "NOBACKFILL_API__MAX_QUEUE_MS": "0",
        **(env or {}),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", *args],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    if not wait_ready(f"{base}/readyz", 90, process):
        if process.poll() is not None:
            pytest.fail(
                f"serve exited {process.returncode}: {process.stdout.read().decode() if process.stdout else ''}"
            )
        process.kill()
        pytest.fail("the service did not become ready in 90 s")
    yield base
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=60)
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit status still tells why.
    assert process.returncode in (0, -signal.SIGTERM), output.decode()
    assert b"Application shutdown complete" in output


def encoder_children() -> set[int]:
    """Pids of this process's encoder children still running."""
    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if "service.encoders.process" in child.cmdline() and child.status() != psutil.STATUS_ZOMBIE:
                found.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def metric_writer_pids(metrics_dir: Path) -> set[str]:
    """The pids of the worker processes that keep metrics in a PROMETHEUS_MULTIPROC_DIR (one file set each)."""
    return {path.stem.rsplit("_", 1)[-1] for path in metrics_dir.glob("*.db")}
