"""The new-model segment: shards published whole, read back exactly, refreshed, damaged ones refused alone."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from service.encoders.identity import ModelIdentity
from service.errors import ArtifactError, InputError
from service.segment.catalog import moved_ids
from service.segment.layout import (
    SHARDS,
    VECTORS,
    GalleryRef,
    create_segment,
    read_segment_meta,
    remove_abandoned,
    shard_names,
    write_shard,
)
from service.segment.reader import MAX_BLOCKS, Segment

MODEL = ModelIdentity("synthetic-new", "synthetic-new", None, 16)
GALLERY = GalleryRef("ab" * 32, 1000)


def _rows(rng: np.random.Generator, n: int, dim: int = 16) -> np.ndarray:
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture
def segment(tmp_path: Path) -> Path:
    create_segment(tmp_path / "seg", MODEL, GALLERY)
    return tmp_path / "seg"


def test_search_is_exact_over_every_shard(segment: Path) -> None:
    rng = np.random.default_rng(0)
    rows = _rows(rng, 300)
    for start in range(0, 300, 30):  # ten shards: more than MAX_BLOCKS blocks get merged
        write_shard(segment, np.arange(start, start + 30) * 2, rows[start : start + 30], MODEL, "test")
    seg = Segment.open(segment)
    assert seg.snapshot.count == 300 and seg.coverage == pytest.approx(0.3)
    assert len(seg.snapshot.blocks) == 1  # one refresh: one block
    queries = _rows(rng, 5)
    scores, ids = seg.snapshot.search(queries, 7)
    exact = queries @ rows.T
    want = np.argsort(-exact, axis=1)[:, :7]
    assert (ids == want * 2).all()
    np.testing.assert_allclose(scores, np.take_along_axis(exact, want, axis=1), rtol=1e-5)


def test_refresh_picks_up_new_shards_and_bounds_the_blocks(segment: Path) -> None:
    rng = np.random.default_rng(1)
    seg = Segment.open(segment)
    assert seg.snapshot.count == 0
    for i in range(MAX_BLOCKS + 3):
        write_shard(segment, np.array([i]), _rows(rng, 1), MODEL, "test")
        assert len(seg.refresh()) == 1
    assert seg.snapshot.count == MAX_BLOCKS + 3
    assert len(seg.snapshot.blocks) <= MAX_BLOCKS
    assert seg.refresh() == []
    assert seg.snapshot.contains(np.array([0, 5, 999])).tolist() == [True, True, False]


def test_an_id_moved_twice_keeps_its_first_row(segment: Path) -> None:
    rng = np.random.default_rng(2)
    first, second = _rows(rng, 2), _rows(rng, 2)
    write_shard(segment, np.array([7, 8]), first, MODEL, "backfill")
    write_shard(segment, np.array([8, 9]), second, MODEL, "service")
    seg = Segment.open(segment)
    assert seg.snapshot.moved.tolist() == [7, 8, 9]
    scores, ids = seg.snapshot.search(first[1:2], 3)
    assert ids[0, 0] == 8 and scores[0, 0] == pytest.approx(1.0, abs=1e-5)
    assert moved_ids(segment).tolist() == [7, 8, 9]


def test_a_damaged_shard_is_refused_and_the_rest_serves(segment: Path) -> None:
    rng = np.random.default_rng(3)
    write_shard(segment, np.array([1, 2]), _rows(rng, 2), MODEL, "test")
    bad = write_shard(segment, np.array([3, 4]), _rows(rng, 2), MODEL, "test")
    path = segment / SHARDS / bad / VECTORS
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    seg = Segment.open(segment)
    assert seg.snapshot.moved.tolist() == [1, 2]
    assert list(seg.refused) == [bad] and "\n" not in seg.refused[bad] and "sha256" in seg.refused[bad]
    assert moved_ids(segment).tolist() == [1, 2]  # so backfill moves 3 and 4 again


def test_a_segment_refuses_another_model_or_gallery(segment: Path) -> None:
    other = ModelIdentity("sentence-transformers", "minilm", "f" * 64, 16)
    with pytest.raises(InputError, match="one segment holds one model's rows"):
        create_segment(segment, other, GALLERY)
    with pytest.raises(InputError, match="sits beside gallery"):
        create_segment(segment, MODEL, GalleryRef("cd" * 32, 1000))
    assert read_segment_meta(segment).model == MODEL


def test_a_shard_of_the_wrong_width_is_never_written(segment: Path) -> None:
    with pytest.raises(InputError, match="a shard needs rows"):
        write_shard(segment, np.array([1]), np.ones((1, 8), np.float32), MODEL, "test")
    assert shard_names(segment) == []


def test_a_dead_writers_hidden_shard_is_removed(segment: Path) -> None:
    name = write_shard(segment, np.array([1]), _rows(np.random.default_rng(4), 1), MODEL, "test")
    host = name.split("-")[1]
    dead = segment / SHARDS / f".{0:020d}-{host}-999999999-abcdef.tmp"
    alive = segment / SHARDS / f".{0:020d}-{host}-{os.getpid()}-abcdef.tmp"
    dead.mkdir()
    alive.mkdir()
    assert remove_abandoned(segment) == [dead.name]
    assert alive.exists() and shard_names(segment) == [name]


def test_a_folder_without_segment_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="not a segment"):
        Segment.open(tmp_path)


def test_a_segment_whose_creation_was_killed_is_created_again(tmp_path: Path) -> None:
    """What a writer killed mid-create leaves (shards/, a hidden segment.json temp) is no refusal: parts of a
    backfill starting together, or a run killed at its first step, must be able to go on."""
    folder = tmp_path / "seg"
    (folder / SHARDS).mkdir(parents=True)
    (folder / ".segment.json.4242.tmp").write_text('{"format_ver', encoding="utf-8")
    create_segment(folder, MODEL, GALLERY)
    assert read_segment_meta(folder).gallery == GALLERY
    create_segment(folder, MODEL, GALLERY)  # and again: it exists and matches
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine", encoding="utf-8")
    with pytest.raises(InputError, match="not a segment"):
        create_segment(tmp_path / "other", MODEL, GALLERY)
