"""Searching the frozen gallery without the moved items: faiss' id selector and the over-fetch fallback agree."""

from __future__ import annotations

import numpy as np

from service.index.base import Exclusion, excluding_by_overfetch
from service.index.gallery import Gallery
from tests.support.world import World


def test_selector_and_overfetch_drop_exactly_the_excluded_ids(world: World) -> None:
    gallery = Gallery.load(world.gallery_dir)
    rng = np.random.default_rng(0)
    queries = rng.standard_normal((8, gallery.dim)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    _, top = gallery.search(queries, 40, 16)
    moved = np.unique(np.concatenate([top[:, :25].ravel(), rng.integers(0, gallery.ntotal, 500)]))
    exclusion = Exclusion(moved)
    scores, ids = gallery.search(queries, 10, 16, exclude=exclusion)
    assert not np.isin(ids, moved).any()
    wide_s, wide_i = gallery.search(queries, 400, 16)
    for row in range(len(queries)):
        kept = ~np.isin(wide_i[row], moved)
        assert ids[row].tolist() == wide_i[row][kept][:10].tolist()
        np.testing.assert_allclose(scores[row], wide_s[row][kept][:10], rtol=1e-6)
    over_s, over_i = excluding_by_overfetch(gallery.search, queries, 10, 16, exclusion)
    assert (over_i == ids).all()
    np.testing.assert_allclose(over_s, scores, rtol=1e-6)


def test_excluding_everything_leaves_padding() -> None:
    def search(q: np.ndarray, k: int, _nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.tile(np.arange(k), (len(q), 1)) % 5  # a gallery of five items
        return np.ones((len(q), k), np.float32), np.where(np.arange(k) < 5, ids, -1)

    scores, ids = excluding_by_overfetch(search, np.zeros((2, 3), np.float32), 4, 1, Exclusion(np.arange(5)))
    assert (ids == -1).all() and np.isneginf(scores).all()


def test_bitmap_and_hash_set_selectors_exclude_the_same_ids() -> None:
    import faiss

    rng = np.random.default_rng(1)
    moved = np.sort(rng.choice(5000, 1200, replace=False)).astype(np.int64)
    sparse = np.append(moved, 2**40)  # an id past the bitmap's bound: the hash set takes over
    bitmap, hashed = Exclusion(moved).faiss_selector, Exclusion(sparse).faiss_selector
    assert isinstance(bitmap.inner, faiss.IDSelectorBitmap) and isinstance(hashed.inner, faiss.IDSelectorBatch)
    for probe in (*moved[:50].tolist(), *range(0, 6000, 7), 2**40 - 1, 2**40):
        expected = probe not in set(sparse.tolist())
        assert hashed.outer.is_member(probe) == expected
        if probe < 2**40:
            assert bitmap.outer.is_member(probe) == expected, probe


def test_overfetch_stops_at_the_backend_s_bound_on_one_list() -> None:
    """Milvus takes at most topk hits per search: past the bound the row comes back short, never refused."""
    asked: list[int] = []

    def search(q: np.ndarray, k: int, _nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        asked.append(k)  # a gallery of 1,000 items ranked 0, 1, 2, ...
        assert k <= 50, "asked past the bound"
        ids = np.tile(np.arange(k), (len(q), 1))
        return np.tile(-np.arange(k, dtype=np.float32), (len(q), 1)), ids

    moved = Exclusion(np.arange(45))  # the first 45 moved: 5 of the top 10 lie within the bound of 50
    scores, ids = excluding_by_overfetch(search, np.zeros((1, 3), np.float32), 10, 1, moved, max_fetch=50)
    assert asked == [20, 50] and ids[0].tolist() == [45, 46, 47, 48, 49, -1, -1, -1, -1, -1]
    assert np.isneginf(scores[0, 5:]).all()
