"""The service's segment writer: rows published as shards the segment reads back, retried, bounded, on its clock."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from service import metrics
from service.encoders.identity import ModelIdentity
from service.segment.layout import GalleryRef, shard_names
from service.segment.reader import Segment
from service.segment.writer import SegmentWriter

DIM = 8
MODEL = ModelIdentity.from_dict(
    {"backend": "synthetic-new", "model_id": "synthetic-new", "fingerprint": None, "dim": DIM}, "test"
)
GALLERY = GalleryRef("ab" * 32, 1_000)


def unit_rows(n: int, seed: int = 0) -> np.ndarray:
    rows = np.random.default_rng(seed).normal(size=(n, DIM)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def count(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def writer_for(folder: Path, **knobs: float) -> SegmentWriter:
    settings = {"shard_rows": 1_000, "flush_s": 3600.0, "max_pending": 1_000, **knobs}
    return SegmentWriter(
        Segment.beside(folder, MODEL, GALLERY),
        shard_rows=int(settings["shard_rows"]),
        flush_s=settings["flush_s"],
        max_pending=int(settings["max_pending"]),
    )


def test_a_flush_creates_the_segment_and_publishes_rows_the_segment_then_serves(tmp_path: Path) -> None:
    writer = writer_for(tmp_path / "segment")
    ids, rows = np.array([5, 9, 2]), unit_rows(3)
    writer.add(ids, rows)
    found, pending = writer.rows_of(np.array([9, 7]))
    assert found.tolist() == [True, False] and np.array_equal(pending[0], rows[1])
    assert writer.flush() == 3 and writer.pending == 0
    snapshot = writer.segment.snapshot  # refreshed by the writer itself
    found, served = snapshot.rows_of(ids)
    assert found.all() and np.allclose(served, rows)
    already = count("nobackfill_cascade_segment_rows_total", outcome="already_moved")
    writer.add(np.array([5, 11]), unit_rows(2, seed=1))  # 5 moved already: only 11 is new
    assert writer.flush() == 1
    assert count("nobackfill_cascade_segment_rows_total", outcome="already_moved") == already + 1
    writer.close()
    assert len(shard_names(tmp_path / "segment")) == 2
    assert Segment.open(tmp_path / "segment").snapshot.count == 4


def test_a_failed_write_keeps_the_rows_for_a_retry_and_counts_it(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the segment's parent folder should be")
    writer = writer_for(blocker / "segment")
    failures = count("nobackfill_segment_write_failures_total")
    writer.add(np.array([1, 2]), unit_rows(2))
    assert writer.flush() == 0
    assert writer.pending == 2  # kept: the next flush tries again
    assert count("nobackfill_segment_write_failures_total") == failures + 1
    dropped = count("nobackfill_cascade_segment_rows_total", outcome="dropped")
    closed = writer.close()  # the last try fails too: the rows can go nowhere, so they are dropped and counted
    assert closed.dropped == 2 and writer.pending == 0
    assert count("nobackfill_cascade_segment_rows_total", outcome="dropped") == dropped + 2


def test_rows_past_max_pending_are_dropped_and_counted(tmp_path: Path) -> None:
    writer = writer_for(tmp_path / "segment", max_pending=3)
    dropped = count("nobackfill_cascade_segment_rows_total", outcome="dropped")
    writer.add(np.arange(5), unit_rows(5))
    assert writer.pending == 3
    assert count("nobackfill_cascade_segment_rows_total", outcome="dropped") == dropped + 2
    writer.close()


@pytest.mark.parametrize("knobs", [{"flush_s": 0.05}, {"shard_rows": 2}])
def test_the_thread_publishes_on_its_clock_or_a_full_shard(tmp_path: Path, knobs: dict[str, float]) -> None:
    writer = writer_for(tmp_path / "segment", **knobs)
    writer.add(np.array([3, 4]), unit_rows(2))
    for _ in range(200):
        if writer.segment.snapshot.count == 2:
            break
        time.sleep(0.025)
    assert writer.segment.snapshot.count == 2 and writer.pending == 0
    writer.close()
