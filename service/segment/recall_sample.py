"""The segment's recall on the traffic it serves: every Nth search of the sealed indexes is searched again exactly,
over the same snapshot, in a background thread, and the share of the exact top k the served answer held is
recorded (metrics.SEGMENT_RECALL, /v1/info's segment.sampled_recall).

Why: a seal chooses its index's width on the index's own rows (sealed.measured_width), which are easier queries
than the traffic's, the more so the larger the graph (docs/backfill.md: at 10^6 rows the width that found 0.997
of its own rows' neighbours found 0.988 for caption queries).  The traffic's own recall is the figure an operator
sets index.segment_ef_search (or a request's ef_search) by, and it can only be measured where the traffic is.

One sample at a time, on its own thread: a search that comes while one is being measured is not sampled (an
exact pass over 10^6 rows of 768 floats takes about a quarter of a second of one core here).  Only snapshots with
a sealed index are sampled; without one every answer is exact already.  A served row counts when it scores at
least the exact k-th score (the served scores are exact inner products: the graphs' candidates are re-ranked by
their rows), so rows tied with the k-th count alike.
"""

from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from service import metrics
from service.rows import F32
from service.segment.reader import Snapshot

log = logging.getLogger("nobackfill.segment")

TIE = 1e-5  # a served score this close below the exact k-th still counts (float32 sums in another order)


class RecallSampler:
    """Measures one in `every` segment searches exactly in the background (every 0: none)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._seen = itertools.count(1)
        self._lock = threading.Lock()
        self._running: Future[None] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="nobackfill-recall") if every else None
        self._queries = 0
        self._recall_sum = 0.0

    def due(self, snapshot: Any) -> bool:
        """Whether the search just served over `snapshot` is the Nth, to be offered: asked first, so the other
        searches prepare nothing for a sample."""
        if self._pool is None or not isinstance(snapshot, Snapshot) or not snapshot.sealed_blocks:
            return False
        return next(self._seen) % self.every == 0

    def offer(self, snapshot: Any, queries: F32, k: int, scores: F32) -> None:
        """A search due() chose: `scores` [b, k] of `queries` [b, d] over `snapshot`, measured in the background
        unless a sample is being measured already."""
        if self._pool is None or k < 1:
            return
        with self._lock:
            if self._running is not None and not self._running.done():
                return
            args = (snapshot, np.array(queries, dtype=np.float32), k, np.array(scores, dtype=np.float32))
            self._running = self._pool.submit(self._measured, *args)

    def wait(self) -> None:
        """Until the sample being measured (if any) is recorded."""
        with self._lock:
            running = self._running
        if running is not None:
            running.result()

    def describe(self) -> dict[str, Any]:
        """What /v1/info reports: how often, how many queries measured so far, and their mean recall@k."""
        with self._lock:
            mean = self._recall_sum / self._queries if self._queries else None
            return {"every": self.every, "queries": self._queries, "mean": None if mean is None else round(mean, 4)}

    def close(self) -> None:
        """Stop the thread (a sample being measured finishes first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _measured(self, snapshot: Snapshot, queries: F32, k: int, served: F32) -> None:
        """The exact top k over the same snapshot, and each query's share of it in the served answer, recorded."""
        try:
            exact, _ = snapshot.search(queries, k, exact=True)
        except Exception:  # a sample is never worth a crash: the served answer went out already
            log.exception("segment recall sample failed")
            return
        recalls = []
        for want, got in zip(exact, served, strict=True):
            found = want[np.isfinite(want)]
            if not len(found):
                continue
            bar = found[-1] - TIE
            recalls.append(min(int(np.sum(got[np.isfinite(got)] >= bar)), len(found)) / len(found))
        for recall in recalls:
            metrics.SEGMENT_RECALL.observe(recall)
        with self._lock:
            self._queries += len(recalls)
            self._recall_sum += sum(recalls)
