"""Shared fixtures: a small synthetic world (gallery + profile) built once per session through the CLI."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

NOBACKFILL = [sys.executable, "-m", "service.cli"]
REDIS_SERVER = shutil.which("redis-server")
# Load shedding reacts to event-loop lag, and in-process tests share their loop with blocking test
# code on a busy 2-core box: off here (and in the processes tests start), on where a test asks for it.
os.environ.setdefault("NOBACKFILL_API__SHED_LAG_MS", "0")
WORLD_GALLERY_SIZE = 20_000
WORLD_SUPPORT_SIZE = 4_000


@dataclass(frozen=True)
class Done:
    """Exit code and output of one in-process `nobackfill` run."""

    returncode: int
    stdout: str
    stderr: str


def cli(*args: str | int | Path) -> Done:
    """Run `nobackfill ARGS` in this process through service.cli.main (exit code 2 on our errors)."""
    from service.cli import main as cli_main

    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    argv = sys.argv
    sys.argv = ["nobackfill", *map(str, args)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli_main()
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv = argv
    return Done(code if isinstance(code, int) else 1, out.getvalue(), err.getvalue())


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


REAL_VOCAB_LIMIT = 3000  # ~2,000 frequent words and the single characters: distils in a few seconds


@pytest.fixture(scope="session")
def real_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """`nobackfill realworld models` with a restricted vocabulary: (the models folder, what it printed).

    The new model is the packaged all-MiniLM-L6-v2 (real weights); the old one is distilled from it
    over its first REAL_VOCAB_LIMIT word pieces, so a test run pays seconds, not the full distillation.
    """
    out = tmp_path_factory.mktemp("real-models")
    done = run_cli("realworld", "models", "--out", out, "--vocab-limit", REAL_VOCAB_LIMIT)
    return out, done.stdout


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A started throwaway redis-server on a free port, killed afterwards."""
    if REDIS_SERVER is None:
        pytest.fail("redis-server is not installed; `make test` installs it (apt-get install redis-server)")
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


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
        **(env or {}),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", *args],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
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
        pytest.fail("the service did not become ready in 90 s")
    yield base
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=60)
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit status still tells why.
    assert process.returncode in (0, -signal.SIGTERM), output.decode()
    assert b"Application shutdown complete" in output


@pytest.fixture
def served(world: World) -> Iterator[str]:
    """`nobackfill serve` with one worker, as an operator would start it."""
    with serve_process(world) as base:
        yield base


@pytest.fixture
def torch_one_thread() -> Iterator[None]:
    """Small nets and batches: a second torch thread only spin-waits on a shared box (up to 10x slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass
class Running:
    """A started app (lifespan run) and an httpx client bound to it over the ASGI transport."""

    app: Any
    client: httpx.AsyncClient

    @property
    def pipeline(self) -> Any:
        """The live pipeline."""
        return self.app.state.pipeline

    async def search(self, **body: Any) -> httpx.Response:
        """POST /v1/search."""
        return await self.client.post("/v1/search", json=body)


async def start_app(settings: Any) -> AsyncIterator[Running]:
    """Run the app's lifespan and yield a client over the ASGI transport (the real HTTP stack)."""
    from service.api.app import create_app

    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield Running(app, client)
