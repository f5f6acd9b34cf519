"""The embedding stage: both query embeddings of a job, as given, from the cache, or from the two batchers at once.

Per modality, the new encoder's batch is enqueued first, so it runs while the cache is asked for the
old rows; only the misses go to the old encoder.  New old rows are written back to the cache in the
background (CacheWriteBack), so the response never waits for Redis.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

from service.cache import EmbeddingCache
from service.cache.base import usable_rows
from service.encoders.base import Embeddings
from service.encoders.batcher import MicroBatcher
from service.encoders.ticket import Ticket
from service.errors import NobackfillError
from service.query.job import SearchJob
from service.rows import normalize_rows
from service.vocabulary import Modality


class CacheWriteBack:
    """Old rows written to the cache by background tasks; drain() waits for the ones started so far.

    Not a service/sink.py BackgroundSink, on purpose (issue 45 step 7 weighed it): the cache is an
    asyncio client and set_many a coroutine on the event loop.  A sink's thread would have to hop
    each write back onto the loop (run_coroutine_threadsafe: two thread switches for I/O that is
    already non-blocking) or hold a second, synchronous Redis client beside the async one, with its
    own pool and outside the circuit breaker.  What the sink gives is here already: write() never
    waits, every write is one pipeline, a Redis failure is dropped and counted by the cache's
    breaker (cache/redis_cache.py), each task ends within the cache's deadline, so the tasks in
    flight are bounded by the request rate times that deadline, and drain() is awaited on the loop
    before the cache closes.
    """

    def __init__(self, cache: EmbeddingCache) -> None:
        self.cache = cache
        self._tasks: set[asyncio.Task[None]] = set()

    def write(self, modality: Modality, inputs: list[str], rows: Embeddings) -> None:
        """Start writing `rows` under `inputs` in the background; all-zero rows (no known token) are never cached."""
        usable = usable_rows(rows)
        if not usable.all():
            inputs = [text for text, ok in zip(inputs, usable.tolist(), strict=True) if ok]
            rows = rows[usable]
        if inputs:
            task = asyncio.create_task(self.cache.set_many(modality, inputs, rows))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for the background cache writes started so far."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


class Embedder:
    """Fills a job's old and new rows and cache statuses from the cache and the two batchers."""

    def __init__(
        self,
        old: MicroBatcher | None,
        new: MicroBatcher,
        cache: EmbeddingCache,
        write_back: CacheWriteBack,
        concurrent: bool,
    ) -> None:
        self.old = old  # None after the cut-over: validation then serves no mode that reads the old query
        self.new = new
        self.cache = cache
        self.write_back = write_back
        # Off only for benchmarks (compat.concurrent_encoders): the old encoder then finishes before the new one starts.
        self.concurrent = concurrent

    async def embed(self, job: SearchJob, ticket: Ticket | None = None) -> None:
        """Fill job.old, job.new and job.cache_status: given by the caller, cached, or encoded.

        `ticket`: the search's admission (pipeline/admission.py), carried by every encoder call it makes.
        """
        job.start_rows()
        by_modality: dict[Modality, list[int]] = {}
        for i, query in enumerate(job.queries):
            if query.content is None:
                # As given: every head normalises what it reads, and PSP's softmax needs the logits' scale.
                if query.old_embedding is not None:
                    job.old[i] = query.old_embedding
                if query.new_embedding is not None:
                    job.new[i] = query.new_embedding
            else:
                by_modality.setdefault(query.modality, []).append(i)
        groups = by_modality.items()
        await asyncio.gather(*(self._encode_group(job, modality, rows, ticket) for modality, rows in groups))

    async def _encode_group(self, job: SearchJob, modality: Modality, rows: list[int], ticket: Ticket | None) -> None:
        """One modality: start the new encoder, look up the cache, encode the old misses meanwhile."""
        inputs = [job.queries[i].content or "" for i in rows]
        need_old, need_new = job.reads.reads_old, job.reads.reads_new
        if need_old and not self.concurrent:
            await self._old_rows(job, modality, rows, inputs, ticket)
            need_old = False
        started = time.perf_counter()
        # Enqueued now, before the cache lookup, so the new encoder starts at once.
        new_rows = self._submit_new(job, modality, rows, inputs, ticket) if need_new else None
        try:
            if need_old:
                await self._old_rows(job, modality, rows, inputs, ticket)
        finally:
            if new_rows is not None:
                await self._new_rows(job, rows, new_rows)
                job.record("new_encode", time.perf_counter() - started)

    def _submit_new(
        self, job: SearchJob, modality: Modality, rows: list[int], inputs: list[str], ticket: Ticket | None
    ) -> Awaitable[Embeddings] | None:
        """Start the new encoder; a cascade with the new encoder down goes on without it (None)."""
        tolerant = job.plan.survives_new_failure
        if tolerant and self.new.problem() is not None:  # down: do not queue behind it
            _failed(job, rows)
            return None
        try:
            return self.new.submit(inputs, modality, ticket)
        except NobackfillError:
            if not tolerant:
                raise
            _failed(job, rows)
            return None

    @staticmethod
    async def _new_rows(job: SearchJob, rows: list[int], new_rows: Awaitable[Embeddings]) -> None:
        """The new rows into the job; for a cascade a failure leaves them zero (stage 1 then answers with old)."""
        try:
            job.new[rows] = await new_rows
        except NobackfillError:
            if not job.plan.survives_new_failure:
                raise
            _failed(job, rows)

    async def _old_rows(
        self, job: SearchJob, modality: Modality, rows: list[int], inputs: list[str], ticket: Ticket | None
    ) -> None:
        """Old rows from the cache, the misses from the old encoder (and back into the cache)."""
        cached = await job.timed("cache_lookup", self.cache.get_many(modality, inputs))
        misses = [j for j, row in enumerate(cached) if row is None]
        caching = self.cache.kind != "off"
        for j, row in enumerate(cached):
            if row is not None:
                job.old[rows[j]] = normalize_rows(row[None])[0]
                job.cache_status[rows[j]] = "hit"
        if not misses:
            return
        miss_inputs = [inputs[j] for j in misses]
        if self.old is None:  # validation serves no mode that reads old without an old model: a bug if reached
            raise RuntimeError(f"mode {job.mode!r} reads the old query, and this service has no old model")
        encoded = await job.timed("old_encode", self.old.encode(miss_inputs, modality, ticket))
        for j, row in zip(misses, encoded, strict=True):
            job.old[rows[j]] = row
            job.cache_status[rows[j]] = "miss" if caching else "off"
        if caching:
            self.write_back.write(modality, miss_inputs, encoded)


def _failed(job: SearchJob, rows: list[int]) -> None:
    """Mark rows whose new encoder failed: zero (no direction), so the old endpoint answers them alone."""
    job.new[rows] = 0.0
    for i in rows:
        job.new_failed[i] = True
