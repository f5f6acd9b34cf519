"""The service's own writes into its segment: rows the cascade encoded on the query path, published as shards.

    cascade ──add(ids, rows)──► pending rows (id -> row; what the next query reads before they publish)
                                    │  one thread "nobackfill-segment-writer": once shard_rows wait, or
                                    │  flush_s after the first of them, or at close
                                    ▼
        refresh the segment (other writers' rows) ─► drop what they moved ─► segment.write ─► refresh

It writes through the segment's store (segment/base.py).  In a folder that is one shard through
layout.write_shard like `backfill run`'s (hidden, fsynced, one rename, a name no other writer can
pick), so two service workers and a `backfill run` add to one segment at the same time without a
lock; a row moved by two of them at once is kept once by every reader.  The first publish creates
the segment when its folder holds none yet.  A failed write (disk full, a folder
that is not a segment) is logged and counted, the rows stay pending and are retried at the next
flush; past max_pending new rows are dropped (counted): the query path never waits on the disk.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import numpy.typing as npt

from service import metrics
from service.errors import NobackfillError
from service.segment.base import SegmentStore

log = logging.getLogger("nobackfill.segment")

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
WRITER = "service-cascade"
RETRY_S = 5.0  # after a failed write, the next try waits at least this long


class SegmentWriter:
    """Rows encoded on the query path, published into the service's segment by one background thread."""

    def __init__(self, segment: SegmentStore, *, shard_rows: int, flush_s: float, max_pending: int) -> None:
        self.segment = segment
        self.shard_rows = shard_rows
        self.flush_s = flush_s
        self.max_pending = max_pending
        self._pending: dict[int, F32] = {}
        self._first_at: float | None = None  # when the oldest pending row arrived
        self._retry_at = 0.0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="nobackfill-segment-writer", daemon=True)
        self._thread.start()

    def add(self, ids: I64, rows: F32) -> None:
        """Queue unit rows for `ids` (never blocks on the disk); rows past max_pending are dropped and counted."""
        with self._lock:
            for i, (gallery_id, row) in enumerate(zip(ids.tolist(), rows, strict=True)):
                if gallery_id in self._pending:
                    continue
                if len(self._pending) >= self.max_pending:  # this row and the rest of the call
                    metrics.CASCADE_SEGMENT_ROWS.labels(outcome="dropped").inc(len(ids) - i)
                    break
                self._pending[gallery_id] = row
            if self._pending and self._first_at is None:  # the thread sleeps until something waits
                self._first_at = time.monotonic()
                self._wake.notify()
            elif len(self._pending) >= self.shard_rows:
                self._wake.notify()

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

    def flush(self) -> int:
        """Publish what waits now, on the caller's thread; returns the rows published (0 on a failure, logged)."""
        with self._lock:
            batch = dict(self._pending)
        if not batch:
            return 0
        try:
            published = self._publish(batch)
        except (NobackfillError, OSError) as exc:
            metrics.SEGMENT_WRITE_FAILURES.inc()
            log.error(
                "segment %s: writing %d cascade rows failed, kept for a retry: %s", self.segment.where, len(batch), exc
            )
            self._retry_at = time.monotonic() + RETRY_S
            return 0
        with self._lock:
            for gallery_id in batch:
                self._pending.pop(gallery_id, None)
            self._first_at = time.monotonic() if self._pending else None
        return published

    def close(self) -> None:
        """Stop the thread and publish what still waits."""
        with self._lock:
            self._closing = True
            self._wake.notify()
        self._thread.join()
        self.flush()

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

    def _due(self) -> float | None:
        """Seconds until the next publish is due (0: now), None while nothing waits; called under the lock."""
        if not self._pending or self._first_at is None:
            return None
        now = time.monotonic()
        if now < self._retry_at:
            return self._retry_at - now
        if len(self._pending) >= self.shard_rows:
            return 0.0
        return max(0.0, self._first_at + self.flush_s - now)

    def _run(self) -> None:
        """Publish whenever a shard's worth waits or flush_s has passed since the first waiting row."""
        while True:
            with self._lock:
                due = self._due()
                while not self._closing and (due is None or due > 0):
                    self._wake.wait(timeout=due)
                    due = self._due()
                if self._closing:
                    return
            self.flush()
