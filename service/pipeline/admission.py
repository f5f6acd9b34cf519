"""Admission: whether a search may come in now, and the ticket it carries to the encoders' queues.

A search is admitted by count (api.max_in_flight queries inside the pipeline) and by time: refused
while the wait it can expect in front of the encoders it needs is over api.max_queue_ms.  An admitted
search gets a Ticket (encoders/ticket.py): the deadline past which a batcher answers its still-queued
items 503 instead of encoding them, and the items it reserves on each encoder, so that searches
admitted in the same instant count each other before any of them reached a queue.  The ticket is an
argument of the embedding stage's calls, as TEI passes its permit; release() gives back what a search
reserved and never queued (its cache hits, a failure before its calls).

The old encoder only sees the cache's misses, so its expected share is the queries the moving hit
ratio says the cache will not answer (learn_hits moves it after each search).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

from service import metrics
from service.encoders.batcher import RETRY_AFTER_MAX_S, MicroBatcher
from service.encoders.ticket import Ticket
from service.errors import Overloaded
from service.query.job import SearchJob
from service.settings import ApiSettings

# An admitted search may sit in an encoder's queue this many times api.max_queue_ms before it is answered
# 503 instead of encoded: the estimate's margin of error, and the bound on an accepted search's wait.
DEADLINE_FACTOR = 2.0
# Weight of each request's cache hits in the moving hit ratio that admission expects of the next ones.
HIT_WEIGHT = 0.05


class Admission:
    """Counts the queries in flight and admits a search on its count and its expected queue wait.

    `old` is None after the cut-over: only the new model's queue is waited on.
    """

    def __init__(self, old: MicroBatcher | None, new: MicroBatcher, api: ApiSettings) -> None:
        self.old = old
        self.new = new
        self.api = api  # read at each admission: max_in_flight, max_queue_ms (0: no bound on the queue wait)
        self.in_flight = 0
        self.hit_ratio = 0.0  # the old rows the cache answers (moving): work it takes off the old encoder

    @property
    def limit_s(self) -> float:
        """api.max_queue_ms in seconds (0: no bound)."""
        return self.api.max_queue_ms / 1000

    @contextmanager
    def admit(self, job: SearchJob) -> Iterator[Ticket]:
        """Count the job's queries in flight (and in the gauge) while they are served; Overloaded past
        api.max_in_flight or when they would wait longer than api.max_queue_ms for the encoders."""
        n, limit = len(job.queries), self.api.max_in_flight
        if self.in_flight + n > limit:
            metrics.ADMISSION_REFUSALS.labels(reason="in_flight").inc()
            wait = self.expected_wait_s(n)
            raise Overloaded(f"{self.in_flight} queries in flight; the limit is {limit}", retry_after(wait, 0.0))
        encoded = sum(query.content is not None for query in job.queries)
        reads_old, reads_new = job.reads.reads_old, job.reads.reads_new
        refusal = self.queue_refusal(encoded, reads_old, reads_new) if encoded else None
        if refusal is not None:
            raise refusal
        ticket = self._ticket(encoded, reads_old, reads_new)
        self.in_flight += n
        metrics.IN_FLIGHT.inc(n)
        try:
            yield ticket
        finally:
            self.in_flight -= n
            metrics.IN_FLIGHT.dec(n)

    def expected_wait_s(self, n: int, reads_old: bool = True, reads_new: bool = True) -> float:
        """Seconds n queries can expect to queue for the encoders they need: the longer of the two waits,
        the old encoder's for the share of them the cache is not expected to answer."""
        wait = self.new.expected_wait_s(n) if reads_new else 0.0
        if reads_old and self.old is not None:
            misses = math.ceil(n * (1.0 - self.hit_ratio))
            wait = max(wait, self.old.expected_wait_s(misses) if misses else 0.0)
        return wait

    def queue_refusal(self, n: int, reads_old: bool = True, reads_new: bool = True) -> Overloaded | None:
        """The 503 for n more queries to encode when their expected wait is over api.max_queue_ms, else None
        (counted; the load shedder asks for one query before a body is read)."""
        limit_s = self.limit_s
        if limit_s <= 0:
            return None
        wait = self.expected_wait_s(n, reads_old, reads_new)
        if wait <= limit_s:
            return None
        metrics.ADMISSION_REFUSALS.labels(reason="queue_time").inc()
        waited = "every replica of an encoder is stuck" if math.isinf(wait) else f"about {wait * 1000:.0f} ms"
        return Overloaded(
            f"overloaded: a search now would queue for the encoders {waited} (limit {limit_s * 1000:.0f} ms, "
            "NOBACKFILL_API__MAX_QUEUE_MS); retry later",
            retry_after(wait, limit_s),
        )

    def _ticket(self, n: int, reads_old: bool, reads_new: bool) -> Ticket:
        """The admitted request's ticket: its queue deadline, and the items it reserves on each encoder."""
        limit_s = self.limit_s
        ticket = Ticket(time.perf_counter() + DEADLINE_FACTOR * limit_s if limit_s > 0 else None)
        expected = {self.new: n if reads_new else 0}
        if reads_old and self.old is not None:
            expected[self.old] = math.ceil(n * (1.0 - self.hit_ratio))
        for batcher, items in expected.items():
            if items:
                batcher.reserve(items)
                ticket.reserved[batcher.name] = items
        return ticket

    def release(self, ticket: Ticket) -> None:
        """Give back what the request reserved and never queued (cache hits, a failure before its calls)."""
        for batcher in (self.old, self.new):
            if batcher is not None:
                batcher.unreserve(ticket.reserved.pop(batcher.name, 0))

    def learn_hits(self, job: SearchJob) -> None:
        """Move the hit ratio towards this job's: the share of its looked-up old rows the cache had."""
        looked_up = [status for status in job.cache_status if status in ("hit", "miss")]
        if looked_up:
            share = looked_up.count("hit") / len(looked_up)
            self.hit_ratio += HIT_WEIGHT * (share - self.hit_ratio)


def retry_after(wait_s: float, limit_s: float) -> int:
    """Whole seconds until a queue expected to take wait_s is down to limit_s (1 to RETRY_AFTER_MAX_S)."""
    if math.isinf(wait_s):
        return RETRY_AFTER_MAX_S
    return min(max(1, math.ceil(wait_s - limit_s)), RETRY_AFTER_MAX_S)
