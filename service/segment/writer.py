"""The service's own writes into its segment: rows the cascade encoded on the query path, published as shards.

    cascade ──add(ids, rows)──► pending rows (id -> row; what the next query reads before they publish)
                                    │  a BackgroundSink (service/sink.py), thread "nobackfill-segment-writer":
                                    │  once shard_rows wait, or flush_s after the first of them, or at close
                                    ▼
        refresh the segment (other writers' rows) ─► drop what they moved ─► segment.write ─► refresh

It writes through the segment's store (segment/base.py).  In a folder that is one shard through
layout.write_shard like `backfill run`'s (hidden, fsynced, one rename, a name no other writer can
pick), so two service workers and a `backfill run` add to one segment at the same time without a
lock; a row moved by two of them at once is kept once by every reader.  The first publish creates
the segment when its folder holds none yet.  A failed write (disk full, a folder that is not a
segment) is counted and logged (at most once a minute); unlike the sampler's pairs the rows are
kept, first in line, and retried RETRY_S later; past max_pending new rows are dropped (counted): the
query path never waits on the disk.  close(timeout) publishes what it can in time; rows still
pending then are dropped (counted, one log line).

The sink holds (id, row) items in arrival order; the writer keeps its own map of the same rows by
id, for rows_of (the cascade reads a pending row before it publishes) and to skip an id already
pending.  A row leaves the map once it is published (or dropped at close); a row the sink drops
for want of room never entered it.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import numpy.typing as npt

from service import metrics
from service.rows import F32, I64
from service.segment.base import SegmentStore
from service.sink import BackgroundSink, Closed

log = logging.getLogger("nobackfill.segment")

WRITER = "service-cascade"
RETRY_S = 5.0  # after a failed write, the next try waits at least this long
CLOSE_S = 30.0  # close() publishes what waits within this long (a shard of max_pending rows, fsynced)


def _rows_dropped(rows: int) -> None:
    metrics.CASCADE_SEGMENT_ROWS.labels(outcome="dropped").inc(rows)


def _write_failed(_rows: int) -> None:
    metrics.SEGMENT_WRITE_FAILURES.inc()  # one per failed shard write, as before


class SegmentWriter:
    """Rows encoded on the query path, published into the service's segment by one background thread."""

    def __init__(self, segment: SegmentStore, *, shard_rows: int, flush_s: float, max_pending: int) -> None:
        self.segment = segment
        self.shard_rows = shard_rows
        self.flush_s = flush_s
        self.max_pending = max_pending
        self._pending: dict[int, F32] = {}
        self._published = 0  # rows published so far, for flush()'s answer
        self._lock = threading.Lock()
        self._sink: BackgroundSink[tuple[int, F32]] = BackgroundSink(
            self._write,
            thread_name="nobackfill-segment-writer",
            label=f"segment {segment.where}",
            unit="cascade rows",
            capacity=max_pending,
            batch_size=shard_rows,
            interval_s=flush_s,
            on_drop=_rows_dropped,
            on_failure=_write_failed,
            retry_s=RETRY_S,
            logger=log,
        )

    def add(self, ids: I64, rows: F32) -> None:
        """Queue unit rows for `ids` (never blocks on the disk); rows past max_pending are dropped and counted."""
        with self._lock:
            for gallery_id, row in zip(ids.tolist(), rows, strict=True):
                if gallery_id in self._pending:
                    continue
                if self._sink.offer((gallery_id, row)):  # full: dropped, counted by the sink
                    self._pending[gallery_id] = row

    def rows_of(self, ids: I64) -> tuple[npt.NDArray[np.bool_], F32]:
        """Which of `ids` wait to be published, and their rows (zero elsewhere)."""
        found = np.zeros(len(ids), dtype=bool)
        rows = np.zeros((len(ids), self.segment.dim), dtype=np.float32)
        with self._lock:
            if not self._pending:
                return found, rows
            for i, gallery_id in enumerate(ids.tolist()):
                row = self._pending.get(gallery_id)
                if row is not None:
                    found[i], rows[i] = True, row
        return found, rows

    @property
    def pending(self) -> int:
        """Rows waiting to be published."""
        with self._lock:
            return len(self._pending)

    def flush(self, timeout_s: float = CLOSE_S) -> int:
        """Publish what waits now and wait for it; the rows published (0 on a failure: counted, logged, kept)."""
        before = self._published
        self._sink.flush(timeout_s)
        return self._published - before

    def close(self, timeout_s: float = CLOSE_S) -> Closed:
        """Publish what still waits within timeout_s and stop the thread; what is left then is dropped (counted)."""
        closed = self._sink.close(timeout_s)
        if closed.dropped:  # those rows never publish: rows_of and pending forget them (a late in-flight write too)
            with self._lock:
                self._pending.clear()
        return closed

    def _write(self, batch: list[tuple[int, F32]]) -> None:
        """The sink's flush: publish the batch; forget its rows once they are in the segment (raises on a failure)."""
        rows = dict(batch)
        published = self._publish(rows)
        with self._lock:
            for gallery_id in rows:
                self._pending.pop(gallery_id, None)
            self._published += published

    def _publish(self, batch: dict[int, F32]) -> int:
        """Drop what another writer moved meanwhile, write the rest as one shard, and let the service read it."""
        segment = self.segment
        segment.refresh()
        ids = np.fromiter(batch, dtype=np.int64, count=len(batch))
        fresh = ~segment.snapshot.contains(ids)
        metrics.CASCADE_SEGMENT_ROWS.labels(outcome="already_moved").inc(int((~fresh).sum()))
        if not fresh.any():
            return 0
        ids = ids[fresh]
        rows = np.stack([batch[int(i)] for i in ids]).astype(np.float32)
        segment.write(ids, rows, WRITER)
        metrics.CASCADE_SEGMENT_ROWS.labels(outcome="published").inc(len(ids))
        segment.refresh()
        return len(ids)
