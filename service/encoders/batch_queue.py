"""A batcher's queue: the calls waiting for a batch, one deque per modality, and how a batch is taken from it.

Cut out of the batcher (encoders/batcher.py) beside the replicas that run the batches (encoders/replicas.py)
and the arithmetic admission reads (encoders/wait_estimate.py).  The queue keeps the entries in arrival
order, counts the items queued (`depth`, reported through `on_depth` at every change), wakes the collector
(`wakeup`) when something arrives, and hands out the batches: the oldest entry a free replica may take,
alone when it was split out of a failed batch, else with the later entries of its modality up to the
batch limit, waiting up to max_wait for the batch to fill (not while `draining`).  What the entries past
their time are answered, and who runs a batch, is the batcher's.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from service.encoders.base import Embeddings
from service.vocabulary import Modality


@dataclass(eq=False)
class Entry:
    """Up to max_batch_size items of one modality from one call, waiting for a batch."""

    items: list[str]
    modality: Modality
    future: asyncio.Future[Embeddings]
    expires: float  # queued past this: EncoderTimeout
    deadline: float | None = None  # its request's queue deadline: still queued past it, Overloaded
    enqueued: float = field(default_factory=time.perf_counter)
    # Why it was split out of a batch to run alone ("raised" or "timeout"); None: never run yet.
    suspect: str | None = None

    def late(self, now: float) -> bool:
        """Still queued past its request's queue deadline (never said of a split call: encoded once already)."""
        return self.suspect is None and self.deadline is not None and self.deadline < now

    def expired(self, now: float) -> bool:
        """Late, queued past `expires`, or given up by its caller."""
        return self.late(now) or self.expires < now or self.future.done()


class BatchQueue:
    """The pending entries of one batcher, their item count, and the batches taken from them."""

    def __init__(self, *, batching: bool, max_wait_s: float, on_depth: Callable[[int], None] = lambda _: None) -> None:
        # batching=False: one entry per batch, no waiting (the baseline for benchmarks).
        self.batching = batching
        self.max_wait_s = max_wait_s
        self.on_depth = on_depth  # told the new depth at every change (the batcher's gauges)
        self.pending: dict[Modality, deque[Entry]] = {}
        self.depth = 0  # items queued
        self.wakeup = asyncio.Event()
        self.draining = False  # stopping: take what is queued without waiting for batches to fill

    def reset(self) -> None:
        """Fresh primitives for a (re)start: asyncio primitives bind to the loop that first uses them."""
        self.wakeup = asyncio.Event()
        self.draining = False

    def set_depth(self, depth: int) -> None:
        self.depth = depth
        self.on_depth(depth)

    def put(self, entries: list[Entry]) -> None:
        """Queue a call's entries (one modality) behind the others and wake the collector."""
        self.pending.setdefault(entries[0].modality, deque()).extend(entries)
        self.set_depth(self.depth + sum(len(entry.items) for entry in entries))
        self.wakeup.set()

    def requeue(self, batch: list[Entry], cause: str, expires: float) -> None:
        """Send each call of a failed batch back to the front of its queue, to run alone (cause: raised, timeout)."""
        for entry in reversed(batch):
            if entry.future.done():
                continue
            entry.suspect, entry.expires = cause, expires
            self.pending.setdefault(entry.modality, deque()).appendleft(entry)
            self.set_depth(self.depth + len(entry.items))
        self.wakeup.set()

    def expire(self, now: float) -> Iterator[Entry]:
        """Take the entries past their time out of the queue; yield those whose caller still waits, each once
        the depth no longer counts it (the caller answers it: Overloaded when late, else EncoderTimeout)."""
        for queue in self.pending.values():
            if not any(entry.expired(now) for entry in queue):
                continue
            kept = [entry for entry in queue if not entry.expired(now)]
            gone = [entry for entry in queue if entry.expired(now)]
            for entry in gone:
                self.set_depth(self.depth - len(entry.items))
                if not entry.future.done():  # else the caller gave up
                    yield entry
            queue.clear()
            queue.extend(kept)

    def take_all(self) -> list[Entry]:
        """Every pending entry, out of the queue (to be failed)."""
        entries = [entry for queue in self.pending.values() for entry in queue]
        for queue in self.pending.values():
            queue.clear()
        self.set_depth(0)
        return entries

    async def next_batch(self, limit: int, suspects_may_run: bool) -> list[Entry]:
        """The oldest entry a free replica may take: alone when it was split out of a batch; else entries of its
        modality (never split ones), up to `limit` items, waiting up to max_wait for the batch to fill.

        suspects_may_run: whether the replica may take a call split out of a hung batch (which may hang it too).
        """
        heads = [
            (entry, queue)
            for queue in self.pending.values()
            if (entry := self._first_takeable(queue, suspects_may_run)) is not None
        ]
        if not heads:
            return []
        head, queue = min(heads, key=lambda pair: pair[0].enqueued)
        if head.suspect is not None:
            queue.remove(head)
            self.set_depth(self.depth - len(head.items))
            return [] if head.future.done() else [head]
        if self.batching and not self.draining:
            until = head.enqueued + self.max_wait_s
            while sum(len(e.items) for e in queue) < limit and not self.draining:
                remaining = until - time.perf_counter()
                if remaining <= 0:
                    break
                self.wakeup.clear()
                try:
                    await asyncio.wait_for(self.wakeup.wait(), remaining)
                except TimeoutError:
                    break
        batch: list[Entry] = []
        kept: list[Entry] = []
        size = 0
        closed = False  # once a plain entry is left for the next batch, every later one waits too (in order)
        for entry in queue:
            closed = closed or bool(batch) and (not self.batching or size + len(entry.items) > limit)
            if entry.suspect is not None or closed:
                kept.append(entry)
                continue
            self.set_depth(self.depth - len(entry.items))
            if entry.future.done():  # the caller gave up (cancelled): do not spend compute on it
                continue
            batch.append(entry)
            size += len(entry.items)
        queue.clear()
        queue.extend(kept)
        return batch

    @staticmethod
    def _first_takeable(queue: deque[Entry], suspects_may_run: bool) -> Entry | None:
        """The first entry of a queue that a free replica may run now."""
        return next((entry for entry in queue if entry.suspect != "timeout" or suspects_may_run), None)


def fail(entries: list[Entry], exc: BaseException) -> None:
    """Answer every entry whose caller still waits with the exception."""
    for entry in entries:
        if not entry.future.done():
            entry.future.set_exception(exc)
