"""The migration beside a Milvus collection: the new model's rows in a second collection, on a milvus-lite server
and on a real Milvus (2.3.5 standalone, the `milvus` wheel).

`backfill run --segment milvus-collection:NAME` creates the collection (only with --add-collection) with
the user's key and vector field names, and fills it by upserts, resumably; the service serves hybrid over
the two collections, leaving the moved ids out of the old search by over-fetching (and skipping it once
every row has moved); `backfill cutover` switches an alias to the new collection.  The user's collection
is never written.  Exactness: at 0 % moved hybrid is the compatible search over the old collection, at
100 % it is the new model's exact search (FLAT indexes: Milvus searches exactly), and the cut-over
answers what hybrid answered.

The user's collection names its key `item_id` and its vector `embedding` (not nobackfill's own `id` /
`vector`): a hit's key is read under the collection's primary field, wherever it is read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.settings import CompatSettings, EncoderSettings, IndexSettings, Settings
from tests.support import stores
from tests.support.app import serving
from tests.support.cli import cli
from tests.support.milvus import MilvusServer, both_kinds, milvus_server, user_collection
from tests.support.world import World

pymilvus = pytest.importorskip("pymilvus", reason="pymilvus is not installed: pip install -e '.[milvus-lite]'")
pytest.importorskip("milvus_lite", reason="milvus-lite is not installed: pip install -e '.[milvus-lite]'")

N = 1_000  # the collection: the synthetic world's items 0..N-1 with their old-model rows
COLLECTION, PRIMARY, FIELD = "catalogue", "item_id", "embedding"
NEW = "catalogue_v2"
SPEC = f"milvus-collection:{NEW}"
WHERE = f"Milvus collection {NEW} (beside {COLLECTION})"
ALIAS = f"{COLLECTION}_current"
CAPTIONS = stores.Captions((3, 77, 512, 901, 999))


@pytest.fixture(scope="module", params=both_kinds())
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MilvusServer]:
    """One server (milvus-lite, then a real Milvus) holding the user's collection: keys, old rows, titles."""
    milvus = milvus_server(tmp_path_factory.mktemp("milvus") / "data", request.param)
    milvus.start()
    with opened(milvus.uri) as client:
        user_collection(client, COLLECTION, stores.old_model_rows(N), primary=PRIMARY, field=FIELD)
    yield milvus
    milvus.stop()


items = stores.items_fixture(N)  # the collection's items: the world's first N


@pytest.fixture
def env(server: MilvusServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """The settings a user exports for both the service and `backfill run`; the server's URI."""
    stores.export_index(monkeypatch, backend="milvus", milvus_uri=server.uri, milvus_collection=COLLECTION)
    return server.uri


class opened:  # noqa: N801 (used as a context manager, like open)
    """A client for a moment."""

    def __init__(self, uri: str) -> None:
        self.client = pymilvus.MilvusClient(uri=uri)

    def __enter__(self) -> Any:
        return self.client

    def __exit__(self, *exc: object) -> None:
        self.client.close()


def index_settings(uri: str, **index: Any) -> IndexSettings:
    return IndexSettings(backend="milvus", milvus_uri=uri, milvus_collection=COLLECTION, **index)


def settings(uri: str, world: World, **index: Any) -> Settings:
    return Settings(index=index_settings(uri, **index), compat=CompatSettings(profile_dir=world.profile_dir))


def entities(uri: str, collection: str, fields: list[str]) -> dict[int, dict[str, Any]]:
    """Every entity of `collection` by key (keys 0..N-1 asked for: a get, strongly consistent)."""
    with opened(uri) as client:
        got = client.get(collection, ids=list(range(N)), output_fields=fields, consistency_level="Strong")
    return {int(e[PRIMARY]): e for e in got}


def old_digest(uri: str) -> str:
    """sha256 over (key, old row, title) by key: the user's data, which nothing may write."""
    found = entities(uri, COLLECTION, [FIELD, "title"])
    assert len(found) == N
    return hashlib.sha256(repr(sorted((i, list(e[FIELD]), e["title"]) for i, e in found.items())).encode()).hexdigest()


def backfill(world: World, items: Path, *args: str | int, segment: str = SPEC) -> Any:
    return stores.backfill(world, items, segment, *args)


async def test_the_migration_fills_the_second_collection_and_hybrid_rises_from_compat_to_reindexed(
    world: World, items: Path, env: str
) -> None:
    from service.index.base import Exclusion
    from service.index.milvus import MilvusGallery

    before = old_digest(env)
    stores.assert_refused_without_consent(world, items, SPEC, "--add-collection")
    # Day 0: the collection named, not there yet: hybrid serves the old collection's compatible answers.
    slerp = await stores.assert_hybrid_is_compat_before_anything_moved(
        settings(env, world, milvus_new_collection=NEW), CAPTIONS
    )
    assert all(len(h["ids"]) == 10 for h in slerp)  # read under item_id, not a hard-coded "id"
    first = ("--add-collection", "--batch-size", 100)
    stores.assert_half_moves_resumably(world, items, SPEC, N, where=WHERE, unit="rows", first=first)
    at_half = settings(env, world, milvus_new_collection=NEW, segment_refresh_s=0.2)
    await stores.assert_both_answer_at_half(at_half, CAPTIONS, "milvus-collection", 500)
    moved = set(entities(env, NEW, [PRIMARY]))
    assert len(moved) == 500
    gallery = MilvusGallery.open(index_settings(env))
    queries = CAPTIONS.old_item_rows()
    by_ids = Exclusion(np.array(sorted(moved), dtype=np.int64))
    old_ids = stores.assert_the_old_search_leaves_moved_out(gallery, queries, by_ids, moved)
    assert (old_ids >= 0).all()  # and still found k of the others

    stores.assert_the_rest_moves(world, items, SPEC, N)
    _, none_left = gallery.search(queries, 10, nprobe=1, exclude=Exclusion(np.arange(N, dtype=np.int64)))
    gallery.close()
    assert (none_left == -1).all()  # every row moved: the old search answers nothing (and is not sent)
    got = entities(env, NEW, [FIELD])
    ids = np.array(sorted(got))
    rows = np.array([got[i][FIELD] for i in ids], dtype=np.float32)
    want = await stores.assert_new_and_hybrid_are_exact(
        settings(env, world, milvus_new_collection=NEW), CAPTIONS, ids, rows
    )

    printed = cli("backfill", "cutover", SPEC)
    assert printed.returncode == 0, printed.stderr
    assert f'client.create_alias(collection_name="{NEW}", alias="{ALIAS}")' in printed.stdout
    assert "/v2/vectordb/aliases/create" in printed.stdout and "--apply runs it" in printed.stdout
    with opened(env) as client:
        assert client.list_aliases(NEW)["aliases"] == []  # printed, not run
    applied = cli("backfill", "cutover", SPEC, "--apply")
    assert applied.returncode == 0 and "applied" in applied.stdout, applied.stderr
    with opened(env) as client:  # the user's application, reading natively through the alias
        native = client.search(
            ALIAS,
            data=[CAPTIONS.new_queries()[0].tolist()],
            limit=10,
            anns_field=FIELD,
            output_fields=[PRIMARY, "title"],
        )[0]
    assert [int(hit[PRIMARY]) for hit in native] == want[0]
    assert all(hit["entity"]["title"] == f"item {hit[PRIMARY]}" for hit in native)  # whole entities, titles too

    cut_over = Settings(old=EncoderSettings(backend="none"), index=index_settings(env, milvus_new_collection=NEW))
    info, alone = await stores.served_alone(cut_over, CAPTIONS)
    assert info["modes"] == ["new"] and info["gallery"]["backend"] == "milvus-collection"
    assert stores.ids_of(alone) == want  # the cut-over answers what hybrid answered (want, asserted above)
    assert old_digest(env) == before  # the user's old rows and titles were never written


async def test_a_wrong_model_s_collection_and_a_foreign_one_are_refused_in_one_line(
    world: World, items: Path, env: str
) -> None:
    import json

    from service.errors import ArtifactError

    done = backfill(world, items, "--limit", 1, "--add-collection", segment="milvus-collection:by_other")
    assert done.returncode == 0, done.stderr
    with opened(env) as client:  # as if another model had filled it: its label says so
        label = json.loads(client.describe_collection("by_other")["properties"]["nobackfill.segment"])
        label["model"]["model_id"] = "someone-else/model"
        client.alter_collection_properties("by_other", properties={"nobackfill.segment": json.dumps(label)})
        user_collection(client, "foreign", np.eye(4, 768, dtype=np.float32), primary=PRIMARY, field=FIELD)
    for name, message in (("by_other", "holds rows of someone-else/model"), ("foreign", "not created by nobackfill")):
        with pytest.raises(ArtifactError) as refused:
            async with serving(settings(env, world, milvus_new_collection=name)):
                pass
        assert message in refused.value.message and "\n" not in refused.value.message
        again = backfill(world, items, segment=f"milvus-collection:{name}")
        assert again.returncode == 2 and message in again.stderr and again.stderr.count("\n") == 1


def test_contradicting_settings_are_refused_in_one_line() -> None:
    cases = [
        ({"milvus_new_collection": COLLECTION}, "is the old model's collection"),
        ({"milvus_new_collection": "c2", "segment_dir": Path("seg")}, "each name a segment: set one"),
    ]
    index = partial(index_settings, "http://127.0.0.1:1")
    stores.assert_contradicting_settings_refused(index, cases, "milvus", milvus_new_collection="c2")
    elsewhere = cli("backfill", "status", "milvus-collection:c2")  # no Milvus gallery configured
    assert elsewhere.returncode == 2 and "set NOBACKFILL_INDEX__BACKEND=milvus" in elsewhere.stderr


async def test_the_cascade_writes_what_it_encodes_into_the_collection(world: World, items: Path, env: str) -> None:
    spec = "milvus-collection:v2_cascade"
    done = backfill(world, items, "--limit", 1, "--add-collection", segment=spec)
    assert done.returncode == 0, done.stderr
    serve = settings(env, world, milvus_new_collection="v2_cascade", item_store=items, segment_refresh_s=0.2)
    info = await stores.assert_the_cascade_writes(serve, CAPTIONS)
    written = entities(env, "v2_cascade", ["title"])
    assert len(written) >= info["segment"]["moved"]  # (it may have written more since)
    assert all(e["title"] == f"item {i}" for i, e in written.items())  # each row carries its item's fields


def test_the_cut_over_switches_the_alias_an_application_already_reads(server: MilvusServer) -> None:
    """NOBACKFILL_INDEX__MILVUS_COLLECTION is an alias: the cut-over re-points it (alter_alias), once."""
    from service.backfill.milvus_cutover import apply_cutover, plan_cutover
    from service.encoders.identity import ModelIdentity
    from service.errors import InputError
    from service.segment.milvus_rows import MilvusNewRows

    rows = np.eye(4, 8, dtype=np.float32)
    new_rows = MilvusNewRows(
        IndexSettings(backend="milvus", milvus_uri=server.uri, milvus_collection="shop"), "tiny_v2"
    )
    with opened(server.uri) as client:
        user_collection(client, "tiny", rows, primary=PRIMARY, field=FIELD)
        client.create_alias("tiny", "shop")  # what the application reads
        new_rows.add(client, ModelIdentity("synthetic-new", "tiny-new", None, 8), "milvus:shop@unknown")
        new_rows.write(client, np.arange(3, dtype=np.int64), rows[:3])
        with pytest.raises(InputError, match=r"holds 3 of 4 rows \(75.0%\)"):
            plan_cutover(new_rows, client, None)
        new_rows.write(client, np.arange(4, dtype=np.int64), rows)  # the fourth; the three others stay
        assert new_rows.count(client) == 4
        planned = plan_cutover(new_rows, client, None)
        assert planned.call == ("alter_alias", "tiny_v2", "shop")
        assert planned.after.startswith("the application reads alias shop as before")
        apply_cutover(client, planned)
        assert client.describe_alias("shop")["collection_name"] == "tiny_v2"
        assert plan_cutover(new_rows, client, None).call is None  # done: nothing left to run
