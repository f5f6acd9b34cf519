"""The Qdrant gallery: the user's collection searched where it is (qdrant-client's embedded local mode).

Local mode is the client's own engine (brute force), not the Qdrant server: these tests check the
contract, the batching, the scores and the refusals; the server's HNSW recall is Qdrant's.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.errors import ArtifactError
from service.index.base import Exclusion
from service.settings import IndexSettings
from tests.support.stores import Captions, assert_old_rows_are_served_exactly
from tests.support.world import World

qdrant_client = pytest.importorskip("qdrant_client")
models = qdrant_client.models

DIM = 32
N = 1500


def _rows(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((n, DIM)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


ROWS, QUERIES = _rows(0, N), _rows(1, 20)
IDS = 11 * np.arange(N, dtype=np.int64) + 5


def _collection(path: Path, name: str, distance: Any, vector: str | None = "old", ids: list[Any] | None = None) -> None:
    """A collection as a user has it (one client at a time may hold a local folder: closed after)."""
    client = qdrant_client.QdrantClient(path=str(path))
    try:
        params = models.VectorParams(size=DIM, distance=distance)
        client.create_collection(name, vectors_config={vector: params} if vector else params)
        points = [
            models.PointStruct(id=pid, vector={vector: row.tolist()} if vector else row.tolist())
            for pid, row in zip(ids if ids is not None else IDS.tolist(), ROWS, strict=True)
        ]
        client.upsert(name, points=points)
    finally:
        client.close()


def _open(path: Path, name: str, vector: str | None = "old") -> Any:
    from service.index.qdrant import QdrantGallery

    return QdrantGallery.open(
        IndexSettings(backend="qdrant", qdrant_path=path, qdrant_collection=name, qdrant_vector=vector)
    )


@pytest.mark.parametrize("distance", ["Dot", "Cosine", "Euclid"])
def test_a_collection_answers_its_ranking_in_cosines_and_skips_moved_ids(tmp_path: Path, distance: str) -> None:
    _collection(tmp_path, "items", models.Distance(distance))
    gallery = _open(tmp_path, "items")
    try:
        assert (gallery.dim, gallery.ntotal, gallery.max_nprobe) == (DIM, N, None)
        scores, ids = gallery.search(QUERIES, 10, nprobe=1)
        exact = QUERIES @ ROWS.T
        order = np.argsort(-exact, axis=1, kind="stable")[:, :10]
        np.testing.assert_array_equal(ids, IDS[order])
        np.testing.assert_allclose(scores, np.take_along_axis(exact, order, axis=1), atol=1e-4)
        moved = np.unique(ids[:, :4])
        _, kept = gallery.search(QUERIES, 10, nprobe=1, exclude=Exclusion(moved))
        exact[:, np.isin(IDS, moved)] = -np.inf
        np.testing.assert_array_equal(kept, IDS[np.argsort(-exact, axis=1, kind="stable")[:, :10]])
    finally:
        gallery.close()


def test_the_default_vector_of_a_collection_without_names(tmp_path: Path) -> None:
    _collection(tmp_path, "plain", models.Distance.DOT, vector=None)
    gallery = _open(tmp_path, "plain", vector=None)
    try:
        assert gallery.search(QUERIES[:1], 1, nprobe=1)[1][0, 0] == IDS[np.argmax(QUERIES[0] @ ROWS.T)]
    finally:
        gallery.close()


def test_what_cannot_be_served_is_refused_in_one_line(tmp_path: Path) -> None:
    _collection(tmp_path, "items", models.Distance.DOT)
    _collection(tmp_path, "manhattan", models.Distance.MANHATTAN)
    _collection(tmp_path, "uuids", models.Distance.DOT, ids=[str(uuid.UUID(int=i)) for i in range(N)])
    client = qdrant_client.QdrantClient(path=str(tmp_path))
    client.create_collection(
        "empty", vectors_config={"old": models.VectorParams(size=DIM, distance=models.Distance.DOT)}
    )
    client.close()
    for name, vector, message in (
        ("nowhere", "old", "no collection 'nowhere'"),
        ("items", "new", "has no vector 'new' (it has: old)"),
        ("manhattan", "old", "distance Manhattan"),
        ("uuids", "old", "point ids are UUIDs"),
        ("empty", "old", "holds no points"),
    ):
        with pytest.raises(ArtifactError) as refused:
            _open(tmp_path, name, vector)
        assert message in refused.value.message and "\n" not in refused.value.message
        assert "NOBACKFILL_INDEX__BACKEND=qdrant" in refused.value.message


async def test_the_service_serves_a_qdrant_collection_of_the_old_models_rows(world: World, tmp_path: Path) -> None:
    from service.encoders.synthetic import SyntheticOldEncoder

    items = np.arange(0, 20_000, 8, dtype=np.int64)  # 2,500 of the world's items
    rows = SyntheticOldEncoder().encode_items(items)
    client = qdrant_client.QdrantClient(path=str(tmp_path))
    client.create_collection(
        "world", vectors_config={"old": models.VectorParams(size=rows.shape[1], distance=models.Distance.COSINE)}
    )
    client.upsert(
        "world",
        points=[models.PointStruct(id=int(i), vector={"old": r.tolist()}) for i, r in zip(items, rows, strict=True)],
    )
    client.close()
    index = IndexSettings(backend="qdrant", qdrant_path=tmp_path, qdrant_collection="world", qdrant_vector="old")
    captions = Captions((8, 800, 8_000, 16_000))
    info = await assert_old_rows_are_served_exactly(world, index, captions, items, rows)
    assert info["gallery"]["backend"] == "qdrant" and info["gallery"]["ntotal"] == 2500
