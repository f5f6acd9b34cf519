"""One definition of "moved": every reader of a segment's shards accepts and refuses the same ones.

The readers: the service's Segment (what hybrid searches and the gallery's search skips), MovedIds
(what `backfill run` never encodes again), `backfill status`, and SegmentSource (the cut-over's rows
and `gallery build --from-segment`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.backfill.run import RunOptions, run_backfill
from service.backfill.sources import StoreItems
from service.backfill.status import segment_status
from service.bulk.encode import load_encoder
from service.encoders.identity import ModelIdentity
from service.errors import InputError
from service.items.store import ItemStore
from service.manifest import write_manifest
from service.segment.catalog import MovedIds, ShardCatalog, moved_ids, sorted_union
from service.segment.layout import IDS, SHARDS, VECTORS, GalleryRef, create_segment, shard_names, write_shard
from service.segment.reader import Segment
from service.segment.source import SegmentSource
from service.vocabulary import Role
from tests.support.world import write_world_items

DIM = 16
MODEL = ModelIdentity("synthetic-new", "synthetic-new", None, DIM)
GALLERY = GalleryRef("ab" * 32, 100)


def _unit(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _publish_unchecked(
    segment: Path, name: str, ids: np.ndarray, rows: np.ndarray, model: ModelIdentity = MODEL
) -> None:
    """A shard written as a careless writer (an older build, a hand-made script) would: manifest and all, no checks."""
    folder = segment / SHARDS / name
    folder.mkdir()
    np.save(folder / IDS, ids.astype(np.int64))
    np.save(folder / VECTORS, rows)
    meta = {"format_version": 1, "count": len(ids), "model": model.as_dict(), "writer": "careless"}
    (folder / "shard.json").write_text(json.dumps(meta))
    write_manifest(folder)


@pytest.fixture
def segment(tmp_path: Path) -> Path:
    create_segment(tmp_path / "seg", MODEL, GALLERY)
    return tmp_path / "seg"


def _readers_moved(segment: Path) -> dict[str, list[int]]:
    """What each reader counts as moved."""
    status = segment_status(segment)
    return {
        "service": Segment.open(segment).snapshot.moved.tolist(),
        "backfill run": MovedIds(segment).update().tolist(),
        "status": _status_ids(segment, status),
        "gallery build --from-segment": SegmentSource(segment, allow_partial=True).ids(0, 10**9).tolist(),
    }


def _status_ids(segment: Path, status: dict) -> list[int]:
    """The ids behind status's count: the union of the shards it lists as intact."""
    intact = [s["name"] for s in status["shards"] if "damaged" not in s]
    ids = np.unique(np.concatenate([np.zeros(0, np.int64), *(np.load(segment / SHARDS / n / IDS) for n in intact)]))
    assert len(ids) == status["moved"]
    return ids.tolist()


def test_non_unit_rows_through_write_shard_are_served_and_counted_alike(segment: Path) -> None:
    # The bug: 10 finite rows of norm 3, as a plug-in encoder breaking the unit-row contract returns
    # them, went through write_shard as they were; moved_ids and status counted 10 moved while the
    # service refused the shard, so those items stayed on the old gallery for ever.
    rows = 3.0 * _unit(np.random.default_rng(0), 10)
    write_shard(segment, np.arange(10), rows, MODEL, "plug-in")
    service = Segment.open(segment)
    assert service.refused == {}
    assert service.snapshot.count == 10 == len(moved_ids(segment)) == segment_status(segment)["moved"]
    scores, ids = service.snapshot.search(rows[:3] / 3.0, 1)
    assert ids[:, 0].tolist() == [0, 1, 2]
    np.testing.assert_allclose(scores[:, 0], 1.0, atol=1e-5)  # stored unit rows


def test_unit_rows_are_written_bit_for_bit(segment: Path) -> None:
    rows = _unit(np.random.default_rng(1), 5)
    name = write_shard(segment, np.arange(5), rows, MODEL, "test")
    assert np.load(segment / SHARDS / name / VECTORS).tobytes() == rows.tobytes()


@pytest.mark.parametrize("bad", [0.0, np.nan, np.inf])
def test_a_row_without_a_direction_is_never_published(segment: Path, bad: float) -> None:
    rows = _unit(np.random.default_rng(2), 4)
    rows[2] = bad
    with pytest.raises(InputError, match=r"1 of 4 are all zero or not finite \(first: gallery id 12\)"):
        write_shard(segment, np.arange(10, 14), rows, MODEL, "test")
    assert shard_names(segment) == []


def test_every_reader_agrees_on_intact_non_unit_truncated_and_wrong_dim_shards(segment: Path) -> None:
    rng = np.random.default_rng(3)
    write_shard(segment, np.arange(0, 10), _unit(rng, 10), MODEL, "backfill")
    _publish_unchecked(segment, "00000000000000000001-nonunit", np.arange(10, 20), 2.0 * _unit(rng, 10))
    truncated = write_shard(segment, np.arange(20, 30), _unit(rng, 10), MODEL, "backfill")
    path = segment / SHARDS / truncated / VECTORS
    os.truncate(path, path.stat().st_size - 64)
    _publish_unchecked(segment, "00000000000000000002-wrongdim", np.arange(30, 40), _unit(rng, 10, DIM // 2))
    write_shard(segment, np.arange(35, 45), _unit(rng, 10), MODEL, "service-cascade")

    intact = [*range(10), *range(35, 45)]
    assert _readers_moved(segment) == dict.fromkeys(
        ["service", "backfill run", "status", "gallery build --from-segment"], intact
    )
    status = segment_status(segment)
    damaged = {s["name"]: s["damaged"] for s in status["shards"] if "damaged" in s}
    assert status["damaged_shards"] == 3 and damaged == Segment.open(segment).refused
    assert "not finite unit vectors" in damaged["00000000000000000001-nonunit"]
    assert "truncated" in damaged[truncated]
    assert "expected float32 (10, 16)" in damaged["00000000000000000002-wrongdim"]
    assert status["moved_by_writer"] == {"backfill": 10, "service-cascade": 10}


def test_backfill_run_moves_again_what_a_refused_shard_held(tmp_path: Path) -> None:
    encoder, identity = load_encoder("synthetic-new", None, role=Role.new, threads=1)
    segment = tmp_path / "seg"
    create_segment(segment, identity, GALLERY)
    rows = 2.0 * _unit(np.random.default_rng(4), 50, identity.dim)
    _publish_unchecked(segment, "00000000000000000001-nonunit", np.arange(0, 50), rows, identity)
    store = tmp_path / "items"
    write_world_items(store, 100, "synthetic")
    options = RunOptions(progress=False, batch_size=25, shard_size=50, fraction=1.0)
    report = run_backfill(segment, StoreItems(ItemStore.open(store)), encoder, identity, GALLERY, options)
    assert report.moved_before == 0 and report.moved == 100  # the refused shard's 50 moved again
    assert _readers_moved(segment) == dict.fromkeys(
        ["service", "backfill run", "status", "gallery build --from-segment"], list(range(100))
    )


def test_a_catalogue_checks_each_shard_once(segment: Path) -> None:
    rng = np.random.default_rng(5)
    catalog = ShardCatalog.of(segment)
    first = write_shard(segment, np.arange(3), _unit(rng, 3), MODEL, "test")
    assert [e.name for e in catalog.scan()] == [first]
    second = write_shard(segment, np.arange(3, 6), _unit(rng, 3), MODEL, "test")
    assert [e.name for e in catalog.scan()] == [second]  # only what was published since
    assert catalog.scan() == [] and catalog.moved().tolist() == list(range(6))


@settings(max_examples=200, deadline=None)
@given(
    held=st.lists(st.integers(-(2**62), 2**62), max_size=60, unique=True),
    fresh=st.lists(st.integers(-(2**62), 2**62), max_size=60, unique=True),
)
def test_sorted_union_is_the_union_of_two_ascending_id_arrays(held: list[int], fresh: list[int]) -> None:
    a, b = np.array(sorted(held), dtype=np.int64), np.array(sorted(fresh), dtype=np.int64)
    union = sorted_union(a, b)
    assert union.dtype == np.int64 and union.tolist() == sorted(set(held) | set(fresh))


def test_moved_ids_updated_shard_by_shard_are_every_intact_shards_ids(segment: Path) -> None:
    rng = np.random.default_rng(5)
    moved = MovedIds(segment)
    assert moved.update().tolist() == []
    for _ in range(6):  # ids moved again by a later shard, and shards published two at a time
        for _ in range(int(rng.integers(1, 3))):
            ids = np.unique(rng.integers(0, 100, 20))
            write_shard(segment, ids, _unit(rng, len(ids)), MODEL, "t")
        assert moved.update().tolist() == moved_ids(segment).tolist()
        assert moved.contains(np.arange(100)).tolist() == np.isin(np.arange(100), moved_ids(segment)).tolist()
