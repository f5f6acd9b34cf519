"""The migration in a Qdrant collection's own form: the new model's rows in a named vector (qdrant-client local mode).

`backfill run --segment qdrant:VECTOR` adds the vector (only with --add-vector) and fills it with
`update_vectors`, resumably; the service serves hybrid over the two vectors of one collection, leaving
the moved points out of the old search by a must_not has_vector filter; the old vector is never written.
The second-collection layout (qdrant-collection:NAME) is walked the same way, cut over by an alias.
Exactness: at 0 % moved hybrid is the compatible search, at 100 % it is the new model's exact search.

Local mode is the client's embedded engine (exact search, one process per folder), not the server:
the service and the CLI take turns on the folder here, as they cannot on a server's collection.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.settings import CompatSettings, EncoderSettings, IndexSettings, Settings
from tests.support import stores
from tests.support.app import serving
from tests.support.cli import cli
from tests.support.world import World

qdrant_client = pytest.importorskip("qdrant_client")
models = qdrant_client.models

N = 1_000  # the collection: the synthetic world's items 0..N-1 with their old-model rows
COLLECTION = "catalogue"
OLD = "old"
CAPTIONS = stores.Captions((3, 77, 512, 901, 999))
SHM = Path("/dev/shm")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A local-mode folder holding the user's collection: ids, the old model's rows (named vector), a title."""
    path = tmp_path_factory.mktemp("qdrant")
    if SHM.is_dir() and os.access(SHM, os.W_OK):
        # Local mode commits (fsyncs) every point it writes on its own: 10 ms each on this disk, 1,000
        # points a pass.  On tmpfs the same engine, the same files, without the wait.
        path = Path(tempfile.mkdtemp(prefix="nobackfill-qdrant-", dir=SHM))
    rows = stores.old_model_rows(N)
    client = qdrant_client.QdrantClient(path=str(path))
    try:
        params = models.VectorParams(size=rows.shape[1], distance=models.Distance.COSINE)
        client.create_collection(COLLECTION, vectors_config={OLD: params})
        client.upsert(
            COLLECTION,
            points=[
                models.PointStruct(id=i, vector={OLD: row.tolist()}, payload={"title": f"item {i}"})
                for i, row in enumerate(rows)
            ],
        )
    finally:
        client.close()
    yield path
    shutil.rmtree(path, ignore_errors=True)


items = stores.items_fixture(N)  # the collection's items: the world's first N


@pytest.fixture
def env(store: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The settings a user exports for both the service and `backfill run`."""
    stores.export_index(
        monkeypatch, backend="qdrant", qdrant_path=str(store), qdrant_collection=COLLECTION, qdrant_vector=OLD
    )
    return store


def index_settings(store: Path, **index: Any) -> IndexSettings:
    return IndexSettings(backend="qdrant", qdrant_path=store, qdrant_collection=COLLECTION, qdrant_vector=OLD, **index)


def settings(store: Path, world: World, **index: Any) -> Settings:
    return Settings(index=index_settings(store, **index), compat=CompatSettings(profile_dir=world.profile_dir))


class Opened:
    """A client on the folder for a moment (the service and the CLI need it between)."""

    def __init__(self, store: Path) -> None:
        self.client = qdrant_client.QdrantClient(path=str(store))

    def __enter__(self) -> Any:
        return self.client

    def __exit__(self, *exc: object) -> None:
        self.client.close()


def scrolled(store: Path, vector: str | None, collection: str = COLLECTION) -> dict[int, list[float]]:
    """Every point's row of `vector` (None: the default vector), by id."""
    out: dict[int, list[float]] = {}
    with Opened(store) as client:
        offset = None
        while True:
            points, offset = client.scroll(collection, limit=512, offset=offset, with_vectors=True)
            for p in points:
                row = p.vector.get(vector or "") if isinstance(p.vector, dict) else p.vector
                if row is not None:
                    out[int(p.id)] = row
            if offset is None:
                return out


def old_digest(store: Path) -> str:
    """sha256 over (id, old row, payload) by id: the user's data, which nothing may write."""
    rows = scrolled(store, OLD)
    with Opened(store) as client:
        payloads = {int(p.id): p.payload for p in client.scroll(COLLECTION, limit=N)[0]}
    return hashlib.sha256(repr(sorted((i, rows[i], payloads[i]) for i in rows)).encode()).hexdigest()


@dataclass(frozen=True)
class Layout:
    """Where the new rows go: a named vector of the user's collection, or a collection of nobackfill's own."""

    spec: str  # --segment
    setting: str  # the IndexSettings field that names it
    name: str
    flag: str  # backfill run's consent
    where: str  # how the CLI names it
    collection: str  # where the rows are
    vector: str | None  # their vector's name there

    def settings(self, store: Path, world: World, **index: Any) -> Settings:
        return settings(store, world, **{self.setting: self.name}, **index)


VECTOR = Layout(
    "qdrant:embedding_v2", "qdrant_new_vector", "embedding_v2", "--add-vector",
    f"Qdrant collection {COLLECTION}, vector embedding_v2", COLLECTION, "embedding_v2",
)  # fmt: skip
SECOND = Layout(
    "qdrant-collection:catalogue_v2", "qdrant_new_collection", "catalogue_v2", "--add-collection",
    f"Qdrant collection catalogue_v2 (beside {COLLECTION})", "catalogue_v2", OLD,
)  # fmt: skip


def backfill(world: World, items: Path, layout: Layout, *args: str | int) -> Any:
    return stores.backfill(world, items, layout.spec, *args)


@pytest.mark.parametrize("layout", [VECTOR, SECOND], ids=["named-vector", "second-collection"])
async def test_the_migration_fills_the_new_vector_and_hybrid_rises_from_compat_to_reindexed(
    world: World, items: Path, env: Path, layout: Layout
) -> None:
    from service.index.base import Exclusion, InTable
    from service.index.qdrant import QdrantGallery

    before = old_digest(env)
    stores.assert_refused_without_consent(world, items, layout.spec, layout.flag)
    await stores.assert_hybrid_is_compat_before_anything_moved(layout.settings(env, world), CAPTIONS)
    sizes = ("--batch-size", 100, "--shard-size", 150)
    stores.assert_half_moves_resumably(
        world, items, layout.spec, N, where=layout.where, unit="points", first=(layout.flag, *sizes)
    )
    await stores.assert_both_answer_at_half(
        layout.settings(env, world, segment_refresh_s=0.2), CAPTIONS, "qdrant-vector", 500
    )
    moved = (
        set(scrolled(env, layout.vector, layout.collection))
        if layout is VECTOR
        else set(scrolled(env, OLD, layout.collection))
    )
    assert len(moved) == 500
    gallery = QdrantGallery.open(index_settings(env))
    exclusion = (
        Exclusion(np.zeros(0, np.int64), in_table=InTable("vector", layout.name))
        if layout is VECTOR
        else Exclusion(np.array(sorted(moved), dtype=np.int64))
    )
    old_ids = stores.assert_the_old_search_leaves_moved_out(gallery, CAPTIONS.old_item_rows(), exclusion, moved)
    gallery.close()
    assert (old_ids >= 0).all()  # and still found k of the others

    stores.assert_the_rest_moves(world, items, layout.spec, N)
    got = scrolled(env, layout.vector, layout.collection)
    ids = np.array(sorted(got))
    rows = np.array([got[i] for i in ids], dtype=np.float32)
    want = await stores.assert_new_and_hybrid_are_exact(
        layout.settings(env, world), CAPTIONS, ids, rows
    )  # (local mode)

    printed = cli("backfill", "cutover", layout.spec)
    assert printed.returncode == 0, printed.stderr
    if layout is VECTOR:
        assert 'using="embedding_v2"' in printed.stdout
    else:
        assert '"alias_name": "catalogue_current"' in printed.stdout and "--apply runs it" in printed.stdout
        with Opened(env) as client:
            assert client.get_aliases().aliases == []  # printed, not run
        applied = cli("backfill", "cutover", layout.spec, "--apply")
        assert applied.returncode == 0 and "applied" in applied.stdout, applied.stderr
    with Opened(env) as client:  # the user's application, reading natively
        read = "catalogue_current" if layout is SECOND else COLLECTION
        native = client.query_points(
            read, query=CAPTIONS.new_queries()[0].tolist(), using=layout.vector, limit=10, with_payload=True
        ).points
    assert [int(p.id) for p in native] == want[0]
    assert all(p.payload == {"title": f"item {p.id}"} for p in native)  # whole points, payloads too

    cut_over = Settings(old=EncoderSettings(backend="none"), index=index_settings(env, **{layout.setting: layout.name}))
    info, alone = await stores.served_alone(cut_over, CAPTIONS)
    assert info["modes"] == ["new"] and info["gallery"]["backend"] == "qdrant-vector"
    assert stores.ids_of(alone) == want  # the cut-over answers what mode new answered
    assert old_digest(env) == before  # the user's old vectors and payloads were never written


def named(vector: str) -> Layout:
    """The named-vector layout under another name."""
    return replace(VECTOR, spec=f"qdrant:{vector}", name=vector, vector=vector)


async def test_a_wrong_model_s_vector_and_a_foreign_vector_are_refused_in_one_line(
    world: World, items: Path, env: Path
) -> None:
    done = backfill(world, items, named("by_other"), "--limit", 1, "--add-vector")
    assert done.returncode == 0, done.stderr
    with Opened(env) as client:  # as if another model had filled it: its label says so
        label = client.get_collection(COLLECTION).config.metadata["nobackfill:by_other"]
        label["model"]["model_id"] = "someone-else/model"
        client.update_collection(COLLECTION, metadata={"nobackfill:by_other": label})
        config = models.DenseVectorConfig(size=768, distance=models.Distance.COSINE)
        client.create_vector_name(COLLECTION, "foreign", models.DenseVectorNameConfig(dense=config))
    from service.errors import ArtifactError

    for name, message in (("by_other", "holds rows of someone-else/model"), ("foreign", "not added by nobackfill")):
        with pytest.raises(ArtifactError) as refused:
            async with serving(settings(env, world, qdrant_new_vector=name)):
                pass
        assert message in refused.value.message and "\n" not in refused.value.message
        again = backfill(world, items, named(name))
        assert again.returncode == 2 and message in again.stderr and again.stderr.count("\n") == 1


def test_contradicting_settings_are_refused_in_one_line(store: Path) -> None:
    cases = [
        ({"qdrant_new_vector": OLD}, "is the old model's vector"),
        ({"qdrant_new_collection": COLLECTION}, "is the old model's collection"),
        ({"qdrant_new_vector": "v2", "qdrant_new_collection": "c2"}, "each name a segment: set one"),
    ]
    index = partial(index_settings, store)
    stores.assert_contradicting_settings_refused(index, cases, "qdrant", qdrant_new_vector="v2")


def storage_changes(store: Path) -> Iterator[int]:
    """Committed writes to the collection's local storage (sqlite's data_version, read beside the writer)."""
    import sqlite3

    conn = sqlite3.connect(f"file:{store / 'collection' / COLLECTION / 'storage.sqlite'}?mode=ro", uri=True)
    try:
        while True:
            yield int(conn.execute("PRAGMA data_version").fetchone()[0])
    finally:
        conn.close()


def test_a_backfill_killed_mid_batch_and_rerun_ends_with_the_vector_of_an_uninterrupted_run(
    world: World, items: Path, env: Path
) -> None:
    import signal
    import time

    whole = backfill(world, items, named("v2_whole"), "--add-vector", "--batch-size", 50, "--shard-size", 100)
    assert whole.returncode == 0, whole.stderr  # (in this process: only the victims need one of their own)
    before = old_digest(env)
    for _ in range(3):  # killed once it has committed writes of its own, mid-run (the rate keeps it going)
        changes = storage_changes(env)
        start = next(changes)
        victim = stores.backfill_process(world, items, "qdrant:v2_killed", "--add-vector", "--rate", "300")
        deadline = time.monotonic() + 120  # a generous bound: a busy box only makes it wait longer
        while next(changes) < start + 2:  # two commits: the first is surely durable
            assert victim.poll() is None, "the run ended before it was killed"
            assert time.monotonic() < deadline, "timed out waiting for a committed write"
            time.sleep(0.02)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        changes.close()
        assert 0 < len(scrolled(env, "v2_killed")) < N
    last = backfill(world, items, named("v2_killed"), "--batch-size", 50, "--shard-size", 100)
    assert last.returncode == 0, last.stderr
    assert scrolled(env, "v2_killed") == scrolled(env, "v2_whole")  # every point, the same row
    assert old_digest(env) == before


async def test_the_cascade_writes_what_it_encodes_into_the_vector(world: World, items: Path, env: Path) -> None:
    done = backfill(world, items, named("v2_cascade"), "--limit", 1, "--add-vector")
    assert done.returncode == 0, done.stderr
    serve = settings(env, world, qdrant_new_vector="v2_cascade", item_store=items, segment_refresh_s=0.2)
    info = await stores.assert_the_cascade_writes(serve, CAPTIONS)
    assert len(scrolled(env, "v2_cascade")) >= info["segment"]["moved"]  # (it may have written more since)


async def test_the_api_key_never_appears_in_answers_logs_or_metrics(
    world: World, store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The API key is a secret: not in /v1/info, /metrics, an error answer, a log line or a CLI error."""
    secret = "qk-7d1e9a-never-shown"
    caplog.set_level("DEBUG")
    # Local mode takes no key: the service carries it everywhere here, and sends it nowhere.
    async with serving(settings(store, world, qdrant_new_vector="v2_secret", qdrant_api_key=secret)) as service:
        seen = await stores.what_anyone_sees(service)
    with pytest.MonkeyPatch.context() as env:  # a server that is not there, with the key
        stores.export_index(
            env, backend="qdrant", qdrant_url="http://127.0.0.1:1", qdrant_collection=COLLECTION, qdrant_api_key=secret
        )
        unreachable = cli("backfill", "status", "qdrant:v2_secret")
    assert unreachable.returncode == 2 and "Qdrant did not answer" in unreachable.stderr
    assert unreachable.stderr.splitlines()[-1].startswith("error: ")
    text = "\n".join([*seen, unreachable.stdout, unreachable.stderr, caplog.text])
    assert secret not in text
