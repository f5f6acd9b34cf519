"""`backfill run` as a library: goals, orders, resumption, and the refusals (real synthetic encoders)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.backfill.run import Order, Part, RunOptions, RunReport, goal, one_run_at_a_time, plan, run_backfill
from service.backfill.sources import StoreItems, open_items
from service.backfill.status import segment_status
from service.bulk.encode import load_encoder
from service.encoders.base import Encoder
from service.encoders.identity import ModelIdentity
from service.encoders.synthetic import IMAGE_VIEW, format_item
from service.errors import InputError
from service.items.store import ItemStore
from service.segment.catalog import moved_ids
from service.segment.layout import GalleryRef, shard_names
from service.segment.reader import Segment
from service.vocabulary import Modality, Role
from tests.support.world import write_world_items

N = 600
GALLERY = GalleryRef("ef" * 32, N)


@pytest.fixture(scope="module")
def items(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_world_items(tmp_path_factory.mktemp("items") / "store", N, "synthetic")


@pytest.fixture(scope="module")
def encoder() -> tuple[Encoder, ModelIdentity]:
    return load_encoder("synthetic-new", None, role=Role.new, threads=1)


Model = tuple[Encoder, ModelIdentity]


def _run(segment: Path, items: Path, encoder: Model, **options: Any) -> RunReport:
    enc, identity = encoder
    source = StoreItems(ItemStore.open(items))
    opts = RunOptions(progress=False, batch_size=50, shard_size=100, **options)
    return run_backfill(segment, source, enc, identity, GALLERY, opts)


def _content(segment: Path) -> dict[int, bytes]:
    snap = Segment.open(segment).snapshot
    out = {}
    for block in snap.blocks:
        for item, row in zip(block.ids.tolist(), block.vectors(), strict=True):
            out[item] = row.tobytes()
    return out


def test_fraction_then_the_rest_continues_where_it_stopped(tmp_path: Path, items: Path, encoder: Model) -> None:
    seg = tmp_path / "seg"
    first = _run(seg, items, encoder, fraction=0.25, order=Order.given)
    assert first.moved == 150 and moved_ids(seg).tolist() == list(range(150))
    second = _run(seg, items, encoder, fraction=1.0, order=Order.given)
    assert second.moved == 450 and second.moved_before == 150
    content = _content(seg)
    enc, _ = encoder
    want = enc.encode([format_item(i, IMAGE_VIEW) for i in range(N)], Modality.text)
    assert sorted(content) == list(range(N))
    assert all(content[i] == want[i].tobytes() for i in range(N))
    status = segment_status(seg)
    assert status["moved"] == N and status["coverage"] == 1.0 and status["damaged_shards"] == 0


def test_a_run_stopped_anywhere_and_resumed_ends_like_one_run(tmp_path: Path, items: Path, encoder: Model) -> None:
    whole = tmp_path / "whole"
    _run(whole, items, encoder, fraction=0.7, order=Order.random, seed=5)
    pieces = tmp_path / "pieces"
    for limit in (1, 99, 130, 7):  # stopped after a few items, then again, as a killed run would be
        _run(pieces, items, encoder, limit=limit, order=Order.random, seed=5)
    _run(pieces, items, encoder, fraction=0.7, order=Order.random, seed=5)
    assert _content(pieces) == _content(whole)
    assert len(shard_names(pieces)) > len(shard_names(whole))


def test_hot_order_moves_the_counted_ids_first_then_the_seeded_rest() -> None:
    ids = np.arange(10, dtype=np.int64)
    hot = np.array([7, 3, 99, 7], dtype=np.int64)  # 99 is no gallery id; 7 twice
    order = plan(ids, Order.hot, seed=1, hot=hot)
    assert order[:2].tolist() == [7, 3] and sorted(order.tolist()) == list(range(10))
    assert order[2:].tolist() == [i for i in plan(ids, Order.random, seed=1).tolist() if i not in (7, 3)]
    with pytest.raises(InputError, match="hit counts"):
        plan(ids, Order.hot, seed=1, hot=None)


def test_goal_counts_what_other_writers_moved() -> None:
    assert goal(1000, 0, 0.5, None) == 500
    assert goal(1000, 400, 0.5, None) == 100
    assert goal(1000, 700, 0.5, None) == 0
    assert goal(1000, 0, None, 30) == 30 and goal(1000, 990, None, 30) == 10
    with pytest.raises(InputError, match="--fraction"):
        goal(1000, 0, 1.5, None)


def test_items_that_are_not_the_gallerys_are_refused(tmp_path: Path, items: Path, encoder: Model) -> None:
    enc, identity = encoder
    source = StoreItems(ItemStore.open(items))
    with pytest.raises(InputError, match="holds 600 items, but the gallery holds 601"):
        run_backfill(tmp_path / "s", source, enc, identity, GalleryRef("ef" * 32, N + 1), RunOptions(progress=False))
    assert not (tmp_path / "s").exists()


def test_a_text_file_maps_lines_to_ids_or_to_given_ids(tmp_path: Path) -> None:
    path = tmp_path / "items.txt"
    path.write_text("a\nb\nc\n", encoding="utf-8")
    source = open_items(path, Modality.text, None, None, None)
    assert source.ids().tolist() == [0, 1, 2] and source.values([2, 0, 9]) == ["c", "a", None]
    np.save(tmp_path / "ids.npy", np.array([10, 20, 30]))
    given = open_items(path, Modality.text, None, None, tmp_path / "ids.npy")
    assert given.values([20]) == ["b"]
    np.save(tmp_path / "short.npy", np.array([10, 20]))
    with pytest.raises(InputError, match="--ids holds 2 ids"):
        open_items(path, Modality.text, None, None, tmp_path / "short.npy")


def test_parts_split_the_items_once_each_and_keep_the_plans_order() -> None:
    ids = np.arange(10_000, dtype=np.int64) * 3
    parts = [Part(i, 3) for i in range(3)]
    held = np.stack([part.holds(ids) for part in parts])
    assert (held.sum(axis=0) == 1).all()  # every id in exactly one part
    assert all(3000 < row.sum() < 3700 for row in held)  # about a third each
    order = plan(ids, Order.hot, seed=2, hot=ids[::-1][:50])
    mine = order[parts[1].holds(order)]
    assert mine.tolist() == [i for i in order.tolist() if parts[1].holds(np.array([i]))[0]]
    for bad in ("3/3", "1", "a/b", "-1/2", "0/0"):
        with pytest.raises(InputError, match="--part"):
            Part.parse(bad)
    assert Part.parse("2/4") == Part(2, 4) and str(Part(2, 4)) == "2/4"


def test_parts_run_side_by_side_and_fill_the_segment_between_them(tmp_path: Path, items: Path, encoder: Model) -> None:
    seg = tmp_path / "seg"
    first = _run(seg, items, encoder, fraction=1.0, part=Part(0, 2))
    assert 0 < first.moved < N and Part(0, 2).holds(moved_ids(seg)).all()
    second = _run(seg, items, encoder, fraction=1.0, part=Part(1, 2))
    assert first.moved + second.moved == N and moved_ids(seg).tolist() == list(range(N))
    whole = tmp_path / "whole"
    _run(whole, items, encoder, fraction=1.0)
    assert _content(seg) == _content(whole)  # the same rows as one run


def test_a_part_runs_once_at_a_time_and_not_beside_a_whole_run(tmp_path: Path, items: Path, encoder: Model) -> None:
    seg = tmp_path / "seg"
    _run(seg, items, encoder, limit=10)
    with one_run_at_a_time(seg, Part(0, 2)):  # as part 0 running in another process holds it
        with pytest.raises(InputError, match=r"part 0/2 is being moved by another run"):
            _run(seg, items, encoder, limit=10, part=Part(0, 2))
        with pytest.raises(InputError, match=r"parts of a `backfill run --part` are moving items into it"):
            _run(seg, items, encoder, limit=10)  # a whole run would move part 0's items too
        assert _run(seg, items, encoder, limit=10, part=Part(1, 2)).moved == 10  # the other part goes ahead
    with one_run_at_a_time(seg), pytest.raises(InputError, match=r"a `backfill run` \(pid \d+\) is moving items"):
        _run(seg, items, encoder, limit=10, part=Part(1, 2))
