"""Fixtures every kind of test shares; the helpers they use live in tests/support.

tests/unit         pure numpy / torch, fake or synthetic encoders in this process: no subprocess, no Redis,
                   no server, no FAISS file (`make test-unit`, well under a minute)
tests/integration  real Redis, FAISS files on disk, the app in process over httpx's ASGI transport, the CLI
tests/system       real `nobackfill serve` processes, the deployment files, chaos, fuzz, load-test smoke,
                   real models

The session fixtures are built once per test process; the synthetic world and the real models once per run,
shared by the xdist workers of `make test` (tests/support/once.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from service.compat.io import Split, load_split
from service.encoders.synthetic import SyntheticNewEncoder, SyntheticOldEncoder
from tests.support.app import Running, serving
from tests.support.cli import NOBACKFILL, Done, cli, run_cli
from tests.support.once import built_once
from tests.support.servers import (
    REDIS_SERVER,
    PrivateRedis,
    ServerProcess,
    free_cluster_port,
    free_port,
    serve_process,
)
from tests.support.upgrade_standin import make_world, write_split
from tests.support.world import (
    REAL_VOCAB_LIMIT,
    WORLD_GALLERY_SIZE,
    WORLD_SUPPORT_SIZE,
    World,
    build_world,
)

PRINTED = "printed.txt"  # what `realworld models` printed, kept beside its folder for every worker

# Load shedding reacts to event-loop lag, and in-process tests share their loop with blocking test
# code on a busy 2-core box: off here (and in the processes tests start), on where a test asks for it.
os.environ.setdefault("NOBACKFILL_API__SHED_LAG_MS", "0")

# `from conftest import cli, World, ...` still works (tests/integration/test_hybrid_serving.py does it);
# new tests import from tests.support.
__all__ = [
    "NOBACKFILL",
    "REAL_VOCAB_LIMIT",
    "REDIS_SERVER",
    "WORLD_GALLERY_SIZE",
    "WORLD_SUPPORT_SIZE",
    "Done",
    "PrivateRedis",
    "Running",
    "ServerProcess",
    "World",
    "cli",
    "free_cluster_port",
    "free_port",
    "run_cli",
    "serve_process",
    "serving",
]


# -- the synthetic world, served ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    """Build a 20k-item gallery and a profile fitted on a disjoint 4k support set, once.

    NOBACKFILL_TEST_WORLD=DIR reuses a world built earlier into DIR (a developer's shortcut).
    """
    prebuilt = os.environ.get("NOBACKFILL_TEST_WORLD")
    if prebuilt:
        return build_world(Path(prebuilt))
    return build_world(built_once(tmp_path_factory, "world", build_world))  # built already: only named here


@pytest.fixture
def served(world: World) -> Iterator[str]:
    """`nobackfill serve` with one worker, as an operator would start it."""
    with serve_process(world) as base:
        yield base


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A started throwaway redis-server on a free port, killed afterwards."""
    if REDIS_SERVER is None:
        pytest.fail("redis-server is not installed; `make test` installs it (apt-get install redis-server)")
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


# -- the stand-in upgrade (tests/support/upgrade_standin.py): splits several files read ------------------


@pytest.fixture(scope="session")
def standin_test_split(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 600-pair test folder of the 48 -> 32 stand-in upgrade (seed 2); read it, never write to it."""
    return write_split(tmp_path_factory.mktemp("standin") / "test", 600, make_world(32, 48, 24), seed=2)


@pytest.fixture(scope="session")
def standin_fit_supports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two support folders of the 48 -> 32 stand-in (ids overlap, as text and image views would), and a root."""
    root = tmp_path_factory.mktemp("fitting")
    world = make_world(32, 48, 24)
    return {
        "root": root,
        "text": write_split(root / "text", 400, world, seed=1),
        "image": write_split(root / "image", 300, world, seed=5),
    }


@pytest.fixture(scope="session")
def crossfit_split(tmp_path_factory: pytest.TempPathFactory) -> Split:
    """200 queries of 100 items (two per item) and 200 targets: the 100 items' and 100 distractors (12 -> 8)."""
    folder = write_split(tmp_path_factory.mktemp("crossfit") / "s", 200, make_world(8, 12, 6), seed=4)
    rng = np.random.default_rng(0)
    np.save(folder / "query_ids.npy", np.arange(200) // 2)
    np.save(folder / "target_ids.npy", np.concatenate([np.arange(100), 1000 + rng.permutation(100)]))
    return load_split(folder)


@pytest.fixture(scope="session")
def two_modality_splits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Split]:
    """A text split (300 rows) and an image split (200) of one 12 -> 8 stand-in; ids 0..199 are in both."""
    root, world = tmp_path_factory.mktemp("modalities"), make_world(8, 12, 6)
    return {
        "text": load_split(write_split(root / "text", 300, world, seed=1)),
        "image": load_split(write_split(root / "image", 200, world, seed=2)),
    }


# -- models ------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def old() -> SyntheticOldEncoder:
    """The simulated old model (tests/unit/test_synthetic.py, tests/integration/test_synth_cli.py)."""
    return SyntheticOldEncoder()


@pytest.fixture(scope="session")
def new() -> SyntheticNewEncoder:
    """The simulated new model."""
    return SyntheticNewEncoder()


@pytest.fixture(scope="session")
def real_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """`nobackfill realworld models` with a restricted vocabulary: (the models folder, what it printed on
    stdout and stderr).

    The new model is the packaged all-MiniLM-L6-v2 (real weights); the old one is distilled from it
    over its first REAL_VOCAB_LIMIT word pieces, so a test run pays seconds, not the full distillation.
    """

    def distil(root: Path) -> None:
        done = run_cli("realworld", "models", "--out", root / "models", "--vocab-limit", REAL_VOCAB_LIMIT)
        (root / PRINTED).write_text(done.stdout + done.stderr)

    root = built_once(tmp_path_factory, "real-models", distil)
    return root / "models", (root / PRINTED).read_text()


@pytest.fixture
def torch_one_thread() -> Iterator[None]:
    """Small nets and batches: a second torch thread only spin-waits on a shared box (up to 10x slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
