"""The re-rank cascade: stage 1's top candidates re-ranked by the new query against their new-model rows.

    stage 1 (search.py)   the head's compatible search, or hybrid beside a segment: the top
                          max(k, cascade.candidates) hits
    rows                  each candidate's new-model row: from the segment's snapshot, else from the
                          rows encoded but not published yet (segment/writer.py), else encoded from
                          the item store on the request's path: the first cascade.encode_budget such
                          candidates of each query, in stage-1 order.  Each item is its own entry of
                          the new encoder's batcher, so concurrent requests share batches and a bad
                          item fails alone; the request waits cascade.encode_timeout_s at most.
    re-rank               the candidates with a row first, by new query . row (cosines); below them
                          the others in their stage-1 order, with their stage-1 scores
    write                 rows encoded on the path go to the segment writer (rows that arrive after
                          the timeout too): the next query finds them, and the segment fills with
                          what users get, with no backfill job
A candidate with no item in the store, an encoder failure, a timeout or an all-zero row keeps its
stage-1 place (counted); the request still answers.  A query whose new embedding is all-zero or
failed was answered by stage 1 alone (fallback), and is not re-ranked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import numpy.typing as npt

from service import metrics
from service.bulk.inputs import encoder_input
from service.encoders.base import Embeddings
from service.encoders.batcher import MicroBatcher
from service.errors import NobackfillError
from service.items.store import ItemStore
from service.query.job import QueryResult, SearchJob
from service.rows import F32, I64, normalize_rows
from service.segment.base import SegmentStore
from service.segment.layout import unit_rows
from service.segment.writer import SegmentWriter

log = logging.getLogger("nobackfill.cascade")


@dataclass
class Rerank:
    """One request's cascade under way: the results it re-ranks, the rows at hand, and the ids still to encode."""

    usable: list[int]  # results re-ranked: stage 1 answered them with a usable new query
    rows: dict[int, F32] = field(default_factory=dict)  # gallery id -> unit new-model row
    source: dict[int, str] = field(default_factory=dict)  # segment | pending | encoded
    wanted: I64 = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    seconds: float = 0.0  # the cascade's time so far, over its parts: recorded once, as the stage "cascade"

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Add the time of one part to the cascade's."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start


@dataclass(frozen=True)
class Cascade:
    """The cascade's settings and what it reads: the new batcher, the segment, its writer, the item store.

    prepare() and finish() run on the search pool right after stage 1, in the same call: a request whose
    candidates all have rows (or that encodes nothing) costs no extra thread hop; encode() runs on the
    event loop, through the batcher.
    """

    candidates: int
    budget: int
    timeout_s: float
    new: MicroBatcher
    pool: ThreadPoolExecutor  # item lookups run here, never on the event loop
    segment: SegmentStore | None = None
    writer: SegmentWriter | None = None
    items: ItemStore | None = None

    def depth(self, k: int) -> int:
        """How many hits stage 1 returns for a request of k."""
        return max(k, self.candidates)

    def prepare(self, job: SearchJob, results: list[QueryResult]) -> Rerank:
        """The rows at hand for every candidate (segment, then pending) and, per query, the first `budget` without."""
        plan = Rerank([i for i, r in enumerate(results) if r.fallback is None and r.ids and job.new[i].any()])
        with plan.timed():
            if not plan.usable:
                return plan
            ids = np.unique(np.array([x for i in plan.usable for x in results[i].ids if x >= 0], dtype=np.int64))
            for source, lookup in (("segment", self._segment_rows), ("pending", self._pending_rows)):
                missing = ids[[int(x) not in plan.rows for x in ids.tolist()]]
                found, rows = lookup(missing)
                for gallery_id, row in zip(missing[found].tolist(), rows[found], strict=True):
                    plan.rows[gallery_id], plan.source[gallery_id] = row, source
            plan.wanted = self._to_encode(results, plan)
            return plan

    async def encode(self, plan: Rerank) -> None:
        """Encode the wanted candidates (the event loop's part of the cascade)."""
        if len(plan.wanted):
            with plan.timed():
                await self._encode(plan.wanted, plan)

    def finish(self, job: SearchJob, results: list[QueryResult], plan: Rerank) -> None:
        """Each usable result: candidates with a row by new cosine, then the rest in stage-1 order; all cut to k."""
        with plan.timed():
            queries = normalize_rows(job.new)
            for i, result in enumerate(results):
                if i in plan.usable:
                    _reorder_one(result, queries[i], plan)
                elif job.new_failed[i]:
                    metrics.CASCADE_SKIPPED.labels(reason="new_encoder").inc()
                result.ids, result.scores = result.ids[: job.k], result.scores[: job.k]
                if i in plan.usable:
                    result.reranked = min(result.reranked or 0, job.k)
                    if result.segment_hits is not None:  # hybrid's count, of the hits that are left
                        result.segment_hits = sum(plan.source.get(x) == "segment" for x in result.ids)
        job.record("cascade", plan.seconds)

    def _segment_rows(self, ids: I64) -> tuple[npt.NDArray[np.bool_], F32]:
        """Rows of the segment's current snapshot."""
        if self.segment is None or not len(ids):
            return np.zeros(len(ids), dtype=bool), np.zeros((len(ids), 0), dtype=np.float32)
        return self.segment.snapshot.rows_of(ids)

    def _pending_rows(self, ids: I64) -> tuple[npt.NDArray[np.bool_], F32]:
        """Rows encoded earlier and not published yet."""
        if self.writer is None or not len(ids):
            return np.zeros(len(ids), dtype=bool), np.zeros((len(ids), 0), dtype=np.float32)
        return self.writer.rows_of(ids)

    def _to_encode(self, results: list[QueryResult], plan: Rerank) -> I64:
        """Per query, its first `budget` candidates with no row, in stage-1 order; each id once per request."""
        if self.items is None or self.budget == 0:
            return np.zeros(0, dtype=np.int64)
        wanted: dict[int, None] = {}
        for i in plan.usable:
            missing = [x for x in results[i].ids if x >= 0 and x not in plan.rows]
            wanted.update(dict.fromkeys(missing[: self.budget]))
        return np.fromiter(wanted, dtype=np.int64, count=len(wanted))

    async def _encode(self, ids: I64, plan: Rerank) -> None:
        """Encode the items of `ids` through the new batcher, waiting timeout_s at most; usable rows join the plan's."""
        assert self.items is not None
        if self.new.problem() is not None:  # down: do not queue behind it, stage 1's order stands
            metrics.CASCADE_ENCODE_FAILURES.labels(reason="encoder_failed").inc(len(ids))
            return
        loop = asyncio.get_running_loop()
        try:
            values = await loop.run_in_executor(self.pool, self._values, ids)
        except Exception as exc:  # an unreadable store: stage 1's order stands, the request still answers
            log.error("cascade: reading %d items from the item store failed: %r", len(ids), exc)
            metrics.CASCADE_ENCODE_FAILURES.labels(reason="missing_item").inc(len(ids))
            return
        calls: dict[int, asyncio.Future[Embeddings]] = {}
        for gallery_id, value in zip(ids.tolist(), values, strict=True):
            if value is None:
                metrics.CASCADE_ENCODE_FAILURES.labels(reason="missing_item").inc()
                continue
            try:
                calls[gallery_id] = asyncio.ensure_future(self._submit(value))
            except NobackfillError:  # the batcher stopped meanwhile
                metrics.CASCADE_ENCODE_FAILURES.labels(reason="encoder_failed").inc()
        if not calls:
            return
        done, late = await asyncio.wait(calls.values(), timeout=self.timeout_s)
        encoded: dict[int, F32] = {}
        for gallery_id, call in calls.items():
            if call in late:
                metrics.CASCADE_ENCODE_FAILURES.labels(reason="timeout").inc()
                call.add_done_callback(partial(self._arrived_late, gallery_id))
            elif (row := self._usable(call)) is not None:
                encoded[gallery_id] = row
        for gallery_id, row in encoded.items():
            plan.rows[gallery_id], plan.source[gallery_id] = row, "encoded"
        self._write(encoded)

    def _submit(self, value: str) -> Awaitable[Embeddings]:
        """One item as its own batcher entry (a failure then fails this item alone)."""
        assert self.items is not None
        return self.new.submit([value], self.items.modality)

    def _values(self, ids: I64) -> list[str | None]:
        """The items to encode: texts, or images read from their paths as the encoder takes them (None: missing)."""
        assert self.items is not None
        out: list[str | None] = []
        for value in self.items.get_many(ids):
            try:
                out.append(None if value is None else encoder_input(value, self.items.modality))
            except (OSError, NobackfillError):
                out.append(None)
        return out

    @staticmethod
    def _usable(call: asyncio.Future[Embeddings]) -> F32 | None:
        """The unit row of a finished call, or None (counted) when it failed or has no direction (zero, not finite)."""
        if call.cancelled() or call.exception() is not None:
            metrics.CASCADE_ENCODE_FAILURES.labels(reason="encoder_failed").inc()
            return None
        row = _segment_row(call.result()[0])
        if row is None:
            metrics.CASCADE_ENCODE_FAILURES.labels(reason="zero_row").inc()
        return row

    def _arrived_late(self, gallery_id: int, call: asyncio.Future[Embeddings]) -> None:
        """A row that came after its request stopped waiting still goes to the segment."""
        if not call.cancelled() and call.exception() is None and (row := _segment_row(call.result()[0])) is not None:
            self._write({gallery_id: row})

    def _write(self, encoded: dict[int, F32]) -> None:
        """Hand rows encoded on the path to the segment writer (none without a segment folder)."""
        if self.writer is not None and encoded:
            ids = np.fromiter(encoded, dtype=np.int64, count=len(encoded))
            self.writer.add(ids, np.stack(list(encoded.values())))


def _segment_row(raw: F32) -> F32 | None:
    """An encoder's row as write_shard stores it (so the re-rank reads the row the segment will hold); None
    for a row without a direction, which write_shard would refuse and which stays on the old gallery."""
    unit: F32 = unit_rows(raw[None])[0]
    return unit if unit.any() else None


def _reorder_one(result: QueryResult, query: F32, plan: Rerank) -> None:
    """One result's re-rank (before the cut to k), its counts, and how many of its hits were re-ranked."""
    ids = result.ids
    with_row = [j for j, x in enumerate(ids) if x in plan.rows]
    kept = [j for j, x in enumerate(ids) if x not in plan.rows]
    sources = Counter(plan.source[ids[j]] for j in with_row)
    for source, n in sources.items():
        metrics.CASCADE_CANDIDATES.labels(source=source).inc(n)
    metrics.CASCADE_CANDIDATES.labels(source="kept").inc(len(kept))
    metrics.CASCADE_ENCODED.observe(sources["encoded"])
    ranked: list[int] = []
    scores: dict[int, float] = {}
    if with_row:
        cosines = np.stack([plan.rows[ids[j]] for j in with_row]) @ query
        ranked = [with_row[o] for o in np.argsort(-cosines, kind="stable").tolist()]  # a tie keeps stage 1's order
        scores = dict(zip(with_row, cosines.tolist(), strict=True))
    order = ranked + kept
    result.ids = [ids[j] for j in order]
    result.scores = [scores.get(j, result.scores[j]) for j in order]
    result.reranked = len(ranked)
