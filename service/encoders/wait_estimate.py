"""What a call can expect to wait in a batcher's queue, and how large a batch may grow: what admission reads.

Cut out of the batcher (encoders/batcher.py) beside its queue (batch_queue.py) and its replicas (replicas.py),
so the arithmetic admission relies on is one small unit.  The batcher hands in what it sees at the moment
(`QueueState`: items queued, replicas idle and answering, when a stuck one is expected back); the
estimator adds what it keeps itself: the measured cost per batch (service_rate.py) and the items
admitted searches reserved and have not queued yet (encoders/ticket.py).

    wait(n) = 0                                                  while a replica is idle for every batch ahead
            = (batches ahead - idle + 0.5) x cost / answering     (a running batch is on average half done)
            = back + (batches ahead + 1) x cost                  while every replica is stuck
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from service.encoders.service_rate import ServiceRate


@dataclass(frozen=True)
class QueueState:
    """What the batcher sees now: items queued, replicas idle and answering (not stuck), and the seconds
    until the first stuck replica is expected back (None while none is stuck)."""

    depth: int
    idle: int
    answering: int
    back_s: float | None


class WaitEstimator:
    """The measured cost, the reserved items, and from them the expected wait and the batch size cap."""

    def __init__(self, max_batch_size: int, *, batching: bool = True, max_batch_s: float | None = None) -> None:
        self.max_batch_size = max_batch_size
        self.batching = batching  # False: one entry per call (benchmarks' baseline)
        # A batch gathers no more items than the measured cost says fit in this (None: max_batch_size always).
        self.max_batch_s = max_batch_s
        self.rate = ServiceRate()
        self.reserved = 0  # items admitted searches are expected to bring, not queued yet

    def batch_limit(self) -> int:
        """Items a batch may gather: max_batch_size, or fewer when the measured cost says a batch that large
        would take longer than max_batch_s (every item of it waits for all of it)."""
        if not self.batching:
            return 1
        if self.max_batch_s is None:
            return self.max_batch_size
        return self.rate.largest_within(self.max_batch_s, self.max_batch_size)

    def reserve(self, n: int) -> None:
        """Count n items an admitted search is expected to submit (admission sees them before they queue)."""
        self.reserved += n

    def unreserve(self, n: int) -> None:
        """Forget n reserved items: queued now, or never coming (a cache hit, a failed request)."""
        self.reserved = max(0, self.reserved - n)

    def expected_wait_s(self, n: int, queue: QueueState) -> float:
        """Seconds a call of n items can expect to queue before its last chunk's batch starts: the batches in
        front of it (queued or reserved, and its own earlier chunks) at the measured cost, shared by the
        replicas that answer (inf while none does and none is expected back)."""
        size = self.batch_limit()
        ahead = self.batches_ahead(n, size, queue.depth)
        cost = self.rate.batch_s(min(size, queue.depth + self.reserved + max(n, 1)))
        if queue.answering <= 0:  # until the first stuck replica is expected back, then the queue on that one
            return math.inf if queue.back_s is None else queue.back_s + (ahead + 1) * cost
        if ahead < queue.idle:
            return 0.0
        return (ahead - queue.idle + 0.5) * cost / queue.answering

    def batches_ahead(self, n: int, size: int, depth: int) -> int:
        """Batches that start before the last one of a call of n items: the queued and reserved items in
        batches of `size`, less the last of them when the call's first chunk still fits beside it, and the
        call's own chunks of max_batch_size before its last (a chunk is never split, so it is one batch even
        when larger than `size`)."""
        chunks = math.ceil(max(n, 1) / self.max_batch_size)
        first = min(max(n, 1), self.max_batch_size)
        full, rest = divmod(depth + self.reserved, size)
        return full + (1 if rest and rest + first > size else 0) + chunks - 1
