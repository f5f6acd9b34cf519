"""Per-encoder micro-batching: concurrent `encode` calls coalesce into batches on dedicated threads.

    callers ──encode(items, modality)──► pending entries, one deque per modality
                                              │  collector task (event loop): wait for an idle replica,
                                              │  take the oldest entry's modality, fill up to
                                              │  max_batch_size, wait <= max_wait_ms
                                              ▼
                 one single-thread executor per replica "encoder-{name}-{i}" ── replica.encode(batch, modality)
                                              │
                         rows sliced back to each caller's future (event loop)

Each replica (a copy of the model; one by default) owns one worker thread, so the old and the new
encoder run at the same time (torch and time.sleep release the GIL), several replicas of one model
run batches side by side, and the event loop never runs model code.  A replica may live in a child
process (encoders/process.py, `isolation: process`): its worker thread then only waits on the pipe.
With one replica a batch is formed only when the previous one has finished, so it collects whatever
arrived meanwhile.
A call larger than `max_batch_size` is split into chunks; entries are never split further, so a
batch holds whole entries of one modality.  The batcher's `name` labels its metrics (`old` / `new`).

What a model does is not trusted.  A failure costs only the calls whose inputs cause it, and the
batcher keeps serving:
    the encoder raises, or gives no answer     a batch of several calls is split: each call goes back to
    within timeout_s                           the front of the queue to run alone, on whichever replica
                                               is free first; only a call that fails alone gets the error:
                                               EncoderFailed (encoder_failed, 500) or EncoderTimeout
                                               (encoder_timeout, 504).  A call that hung alone is
                                               remembered (encoders/poison.py) and refused at once for
                                               poison_ttl_s (PoisonInput, 422), so a retry costs nothing
    ... a slow or timed-out replica            a thread cannot be interrupted: a call past SLOW_FACTOR x
                                               its measured cost (>= SLOW_FLOOR_S) keeps its thread and the
                                               replica takes the next batch on a fresh one (stuck_threads
                                               such calls at most); past that bound a timed-out replica is
                                               "stuck" until its call returns, and takes no batch meanwhile.
                                               A replica with interrupt() (a child process) is told to give
                                               up at the timeout, so the call returns soon.  A call split
                                               out of a hung batch may hang too: it never takes the last
                                               replica that is not stuck (unless there is only one), so
                                               one keeps serving
    rows not [n, dim]                          EncoderFailed for the batch; counted as bad_rows
    a NaN / inf in some rows                   EncoderFailed for the calls those rows belong to only
    an entry queued for timeout_s              EncoderTimeout (no free replica, or a queue behind stuck
                                               ones); a split call gets 2 x timeout_s more to start alone,
                                               so no caller waits much past 5 x timeout_s in all (2 x when
                                               its batch did not fail)
    an entry queued past its request's         Overloaded (503 + Retry-After) before it is encoded, never
    queue deadline (encoders/ticket.py)        after: admission let it in on an estimate that proved wrong
The batcher measures its cost per batch (encoders/service_rate.py); `expected_wait_s` turns the items
queued in front of a call into the seconds it can expect to wait (encoders/wait_estimate.py, from the
queue state the batcher sees), which admission compares with api.max_queue_ms.
All-zero rows are data (a static model's row for text with no known token), not failures: the
pipeline answers them with its fallback.  If the collector task itself dies (a bug), the pending
callers fail, it is restarted (counted), and `alive` is False only if it keeps dying
(MAX_RESTARTS within RESTART_WINDOW_S), so liveness fails and the orchestrator replaces the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Sequence

import numpy as np

from service import metrics
from service.encoders.base import Embeddings, Encoder
from service.encoders.batch_queue import BatchQueue, Entry, fail
from service.encoders.poison import PoisonMemory
from service.encoders.replicas import ReplicaPool
from service.encoders.ticket import Ticket
from service.encoders.wait_estimate import QueueState, WaitEstimator
from service.errors import EncoderFailed, EncoderTimeout, NotReady, Overloaded, PoisonInput
from service.vocabulary import Modality

log = logging.getLogger(__name__)

# A collector that dies this often this quickly is broken, not unlucky: stop restarting it.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
# How often a collector holding only split calls that may not take a free replica looks again.
RECHECK_S = 0.02
RETRY_AFTER_MAX_S = 60


class MicroBatcher:
    """Coalesce concurrent encode calls into batches run on the encoder's own worker thread.

    The parts: the queue of calls waiting for a batch (batch_queue.py), the replicas that run the batches
    (replicas.py), and the expected wait admission reads (wait_estimate.py); the batcher takes the calls
    in, runs the collector that pairs a free replica with the next batch, and answers the calls queued
    past their time.
    """

    def __init__(
        self,
        encoder: Encoder | Sequence[Encoder],
        max_batch_size: int,
        max_wait_ms: float,
        name: str,
        *,
        batching: bool = True,
        timeout_s: float = 30.0,
        poison_ttl_s: float = 0.0,
        poison_capacity: int = 10_000,
        stuck_threads: int = 0,
        max_batch_s: float | None = None,
    ) -> None:
        replicas = [encoder] if isinstance(encoder, Encoder) else list(encoder)
        if not replicas or max_batch_size < 1 or max_wait_ms < 0 or timeout_s <= 0:
            raise ValueError("need >= 1 encoder replica, max_batch_size >= 1, max_wait_ms >= 0 and timeout_s > 0")
        # The first replica speaks for all of them (dim, model id, device): they are copies of one model.
        self.encoder = replicas[0]
        self.replicas = replicas
        self.name = name
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000
        # batching=False: one entry per encoder call, no waiting (the baseline for benchmarks).
        self.batching = batching
        self.timeout_s = timeout_s
        self.poison = PoisonMemory(poison_ttl_s, poison_capacity)
        # The measured cost, the reserved items, the expected wait and the batch cap (encoders/wait_estimate.py).
        self.wait = WaitEstimator(max_batch_size, batching=batching, max_batch_s=max_batch_s)
        self.rate = self.wait.rate
        self.stuck_threads = stuck_threads
        self._restarts: deque[float] = deque()
        self._queue = BatchQueue(batching=batching, max_wait_s=self.max_wait_s, on_depth=self._depth_changed)
        self._pool = ReplicaPool(
            replicas=replicas,
            name=name,
            timeout_s=timeout_s,
            stuck_threads=stuck_threads,
            rate=self.rate,
            poison=self.poison,
            queue=self._queue,
            on_back=self._replica_back,
        )
        self._running: set[asyncio.Task[None]] = set()
        self._collector: asyncio.Task[None] | None = None
        self._accepting = False

    def problem(self) -> str | None:
        """Why this batcher cannot serve right now (for /readyz), or None when it can."""
        if not self._accepting:
            return "stopped" if self._collector is None else "collector crashed too often"
        return self._pool.problem()

    @property
    def alive(self) -> bool:
        """False once the collector crashed too often to be restarted (liveness: replace the process)."""
        return self._accepting or self._collector is None

    async def start(self) -> None:
        """Create the worker thread and the collector task; idempotent."""
        if self._accepting:
            return
        self._pool.start()
        self._queue.reset()
        self._accepting = True
        self._collector = asyncio.create_task(self._collect_forever(), name=f"batcher-{self.name}")

    async def stop(self, drain: bool = True) -> None:
        """Refuse new calls; finish pending ones (drain) or fail them with NotReady; join the worker."""
        if self._collector is None:
            return
        self._accepting = False
        collector, self._collector = self._collector, None
        if drain:
            self._queue.draining = True
            self._queue.wakeup.set()
            await collector
        else:
            collector.cancel()
            for task in list(self._running):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collector
            await asyncio.gather(*self._running, return_exceptions=True)
            self._fail_pending(NotReady(f"encoder {self.name!r} stopped"))
        await self._pool.shutdown()

    async def encode(
        self, items: list[str], modality: Modality = Modality.text, ticket: Ticket | None = None
    ) -> Embeddings:
        """Float32 [len(items), dim] rows, encoded in whatever batches the traffic allows."""
        return await self.submit(items, modality, ticket)

    def submit(
        self, items: list[str], modality: Modality = Modality.text, ticket: Ticket | None = None
    ) -> Awaitable[Embeddings]:
        """Enqueue the items now and return an awaitable of their rows (`encode` without the first await).

        `ticket`: the admitted search's (pipeline/admission.py): its reserved items become queued ones,
        and an entry still queued past its deadline is answered 503 instead of encoded.  None: no bound.

        A caller with other work to do meanwhile (a cache lookup) starts the encoder before it,
        with no task to create and schedule.  The returned awaitable must be awaited.
        """
        if not self._accepting:
            raise NotReady(f"encoder {self.name!r} is not running")
        loop = asyncio.get_running_loop()
        if not items:
            empty: asyncio.Future[Embeddings] = loop.create_future()
            empty.set_result(np.empty((0, self.encoder.dim), dtype=np.float32))
            return empty
        step = self.max_batch_size
        chunks = [items[i : i + step] for i in range(0, len(items), step)]
        if any(self.poison.holds(modality, chunk) for chunk in chunks):
            metrics.POISON_REFUSALS.labels(encoder=self.name).inc()
            raise PoisonInput(
                f"an input of this request made encoder {self.name!r} hang alone within the last "
                f"{self.poison.ttl_s:g} s; it is refused until then"
            )
        if ticket is not None:  # its reservation becomes queued items
            taken = min(ticket.reserved.get(self.name, 0), len(items))
            ticket.reserved[self.name] = ticket.reserved.get(self.name, 0) - taken
            self.unreserve(taken)
        expires, until = time.perf_counter() + self.timeout_s, None if ticket is None else ticket.deadline
        entries = [Entry(chunk, modality, loop.create_future(), expires, until) for chunk in chunks]
        self._queue.put(entries)
        if len(entries) == 1:
            return entries[0].future
        return self._joined(entries)

    @staticmethod
    async def _joined(entries: list[Entry]) -> Embeddings:
        """The rows of a call split into several entries, in order."""
        # Wait for every chunk even when one fails, so no future is left with an unread exception.
        results = await asyncio.gather(*(entry.future for entry in entries), return_exceptions=True)
        chunks: list[Embeddings] = []
        for result in results:
            if isinstance(result, BaseException):
                raise result
            chunks.append(result)
        return np.concatenate(chunks)

    async def _collect_forever(self) -> None:
        """Form and run batches until stopped (and, when draining, until nothing is pending)."""
        while True:
            try:
                await self._collect()
                return
            except Exception:  # a bug here must not leave callers waiting forever
                log.exception("batcher %r crashed", self.name)
                self._fail_pending(EncoderFailed(f"encoder {self.name!r} lost its batch queue"))
                metrics.BATCHER_RESTARTS.labels(encoder=self.name).inc()
                now = time.monotonic()
                self._restarts.append(now)
                while self._restarts and now - self._restarts[0] > RESTART_WINDOW_S:
                    self._restarts.popleft()
                if len(self._restarts) > MAX_RESTARTS:
                    log.error(
                        "batcher %r crashed %d times in %g s: giving up",
                        self.name,
                        len(self._restarts),
                        RESTART_WINDOW_S,
                    )
                    self._accepting = False
                    return
                self._queue.wakeup.set()  # entries that arrived meanwhile are served by the restarted loop

    async def _collect(self) -> None:
        queue, pool = self._queue, self._pool
        while True:
            if not queue.depth:
                if queue.draining:
                    await asyncio.gather(*self._running, return_exceptions=True)
                    return
                queue.wakeup.clear()
                await queue.wakeup.wait()
                continue
            replica = await pool.free()  # a batch is formed only once a replica can take it
            # Entries past their time fail now rather than wait (longer) for a batch.
            self._expire()
            if replica is None:
                continue
            try:
                batch = await self._next_batch() if queue.depth else []
            except BaseException:
                pool.idle.put_nowait(replica)  # not lost to a crash or a cancel: the restarted loop needs it
                raise
            if not batch:
                pool.idle.put_nowait(replica)
                if queue.depth:  # only split calls that may not take this replica: look again soon
                    queue.wakeup.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(queue.wakeup.wait(), RECHECK_S)
                continue
            task = asyncio.create_task(pool.run(batch, replica), name=f"batch-{self.name}-{replica}")
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    def _expire(self) -> None:
        """Fail the pending entries past their time: Overloaded past their request's queue deadline (never
        for a split call, which was encoded once already), EncoderTimeout past `expires`."""
        now = time.perf_counter()
        for entry in self._queue.expire(now):
            if entry.late(now):
                metrics.ADMISSION_REFUSALS.labels(reason="deadline").inc()
                entry.future.set_exception(
                    Overloaded(
                        f"overloaded: encoder {self.name!r} did not reach this search within its queue "
                        "deadline; retry later",
                        self.retry_after_s(),
                    )
                )
            else:
                metrics.ENCODER_FAILURES.labels(encoder=self.name, reason="timeout").inc()
                entry.future.set_exception(
                    EncoderTimeout(f"encoder {self.name!r} left a call queued for {self.timeout_s:g} s")
                )

    async def _next_batch(self) -> list[Entry]:
        """The next batch a free replica may take (BatchQueue.next_batch)."""
        return await self._queue.next_batch(self.batch_limit(), self._pool.suspects_may_run())

    def batch_limit(self) -> int:
        """Items a batch may gather now (WaitEstimator.batch_limit)."""
        return self.wait.batch_limit()

    def reserve(self, n: int) -> None:
        """Count n items an admitted search is expected to submit (admission sees them before they queue)."""
        self.wait.reserve(n)

    def unreserve(self, n: int) -> None:
        """Forget n reserved items: queued now, or never coming (a cache hit, a failed request)."""
        self.wait.unreserve(n)

    def expected_wait_s(self, n: int = 1) -> float:
        """Seconds a call of n items can expect to queue before its last chunk's batch starts (wait_estimate.py)."""
        return self.wait.expected_wait_s(n, self._queue_state())

    def _queue_state(self) -> QueueState:
        """Items queued, replicas idle and answering, and when the first stuck one is expected back."""
        back = self._pool.back_s()
        return QueueState(self._queue.depth, self._pool.idle.qsize(), self._pool.answering, back)

    def retry_after_s(self) -> int:
        """Whole seconds until the queue in front of a new call has drained (1 to RETRY_AFTER_MAX_S)."""
        wait = self.expected_wait_s(0)
        return RETRY_AFTER_MAX_S if math.isinf(wait) else min(max(1, math.ceil(wait)), RETRY_AFTER_MAX_S)

    def _replica_back(self, replica: int) -> None:
        """A stuck replica's call returned: back in rotation while serving, and split calls held back may go."""
        if self._accepting:
            self._pool.idle.put_nowait(replica)
            self._queue.wakeup.set()  # split calls held back for want of a second replica may go now

    def _fail_pending(self, exc: BaseException) -> None:
        fail(self._queue.take_all(), exc)

    def _depth_changed(self, depth: int) -> None:
        metrics.QUEUE_DEPTH.labels(encoder=self.name).set(depth)
        metrics.EXPECTED_WAIT.labels(encoder=self.name).set(self.expected_wait_s(0))
