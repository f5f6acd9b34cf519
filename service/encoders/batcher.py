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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from service import metrics
from service.encoders.base import Embeddings, Encoder
from service.encoders.poison import PoisonMemory
from service.encoders.ticket import Ticket
from service.encoders.wait_estimate import QueueState, WaitEstimator
from service.errors import (
    EncoderFailed,
    EncoderProcessExited,
    EncoderTimeout,
    NobackfillError,
    NotReady,
    Overloaded,
    PoisonInput,
)
from service.vocabulary import Modality

log = logging.getLogger(__name__)

# A collector that dies this often this quickly is broken, not unlucky: stop restarting it.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
# How often a collector holding only split calls that may not take a free replica looks again.
RECHECK_S = 0.02
RETRY_AFTER_MAX_S = 60
# A thread call this many times its measured cost (and at least SLOW_FLOOR_S) is left its thread while
# the replica takes the next batch on a fresh one (stuck_threads at most at once): a hung input then holds
# a replica for SLOW_FLOOR_S, not for timeout_s, and two hangs at once no longer stop every replica.
SLOW_FACTOR = 10.0
SLOW_FLOOR_S = 0.25


@dataclass(eq=False)
class _Lease:
    """A replica taken for one batch; `returned` once it is back in rotation."""

    replica: int
    returned: bool = False


@dataclass(eq=False)
class _Entry:
    """Up to max_batch_size items of one modality from one call, waiting for a batch."""

    items: list[str]
    modality: Modality
    future: asyncio.Future[Embeddings]
    expires: float  # queued past this: EncoderTimeout
    deadline: float | None = None  # its request's queue deadline: still queued past it, Overloaded
    enqueued: float = field(default_factory=time.perf_counter)
    # Why it was split out of a batch to run alone ("raised" or "timeout"); None: never run yet.
    suspect: str | None = None


class MicroBatcher:
    """Coalesce concurrent encode calls into batches run on the encoder's own worker thread."""

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
        # Hung calls that may keep running on a thread of their own while a fresh thread takes their
        # replica's place (threads cannot be interrupted); past it, a replica is set aside until its call returns.
        self.stuck_threads = stuck_threads
        self._abandoned = 0  # hung calls still running on an abandoned thread
        self._replacements = 0
        self._stuck: set[int] = set()  # replicas whose call outlived timeout_s and has not returned yet
        self._stuck_since: dict[int, float] = {}
        # How long a replica set aside stays stuck (moving average; a child process: until it is replaced).
        self._stuck_s = timeout_s
        self._restarts: deque[float] = deque()
        self._pending: dict[Modality, deque[_Entry]] = {}
        self._depth = 0
        self._wakeup = asyncio.Event()
        self._executors: list[ThreadPoolExecutor] = []
        self._idle: asyncio.Queue[int] = asyncio.Queue()
        self._running: set[asyncio.Task[None]] = set()
        self._collector: asyncio.Task[None] | None = None
        self._accepting = False
        self._draining = False

    def problem(self) -> str | None:
        """Why this batcher cannot serve right now (for /readyz), or None when it can."""
        if not self._accepting:
            return "stopped" if self._collector is None else "collector crashed too often"
        if len(self._stuck) == len(self.replicas):
            return f"every replica is stuck in a call longer than {self.timeout_s:g} s"
        if all(getattr(replica, "replacing", False) for replica in self.replicas):  # process isolation only
            return "every replica's encoder process is loading its replacement"
        return None

    @property
    def alive(self) -> bool:
        """False once the collector crashed too often to be restarted (liveness: replace the process)."""
        return self._accepting or self._collector is None

    async def start(self) -> None:
        """Create the worker thread and the collector task; idempotent."""
        if self._accepting:
            return
        self._executors = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"encoder-{self.name}-{i}")
            for i in range(len(self.replicas))
        ]
        # Fresh primitives per start: asyncio primitives bind to the loop that first uses them.
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Queue()
        for i in range(len(self.replicas)):
            self._idle.put_nowait(i)
        self._draining = False
        self._stuck.clear()
        self._stuck_since.clear()
        self._accepting = True
        self._collector = asyncio.create_task(self._collect_forever(), name=f"batcher-{self.name}")

    async def stop(self, drain: bool = True) -> None:
        """Refuse new calls; finish pending ones (drain) or fail them with NotReady; join the worker."""
        if self._collector is None:
            return
        self._accepting = False
        collector, self._collector = self._collector, None
        if drain:
            self._draining = True
            self._wakeup.set()
            await collector
        else:
            collector.cancel()
            for task in list(self._running):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collector
            await asyncio.gather(*self._running, return_exceptions=True)
            self._fail_pending(NotReady(f"encoder {self.name!r} stopped"))
        executors, self._executors = self._executors, []
        for executor in executors:
            # shutdown(wait=True) blocks until a running batch ends: do that wait off the loop.
            await asyncio.to_thread(executor.shutdown, True)

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
        entries = [_Entry(chunk, modality, loop.create_future(), expires, until) for chunk in chunks]
        queue = self._pending.setdefault(modality, deque())
        queue.extend(entries)
        self._set_depth(self._depth + len(items))
        self._wakeup.set()
        if len(entries) == 1:
            return entries[0].future
        return self._joined(entries)

    @staticmethod
    async def _joined(entries: list[_Entry]) -> Embeddings:
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
                self._wakeup.set()  # entries that arrived meanwhile are served by the restarted loop

    async def _collect(self) -> None:
        while True:
            if not self._depth:
                if self._draining:
                    await asyncio.gather(*self._running, return_exceptions=True)
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            replica = await self._free_replica()  # a batch is formed only once a replica can take it
            # Entries past their time fail now rather than wait (longer) for a batch.
            self._expire()
            if replica is None:
                continue
            try:
                batch = await self._next_batch() if self._depth else []
            except BaseException:
                self._idle.put_nowait(replica)  # not lost to a crash or a cancel: the restarted loop needs it
                raise
            if not batch:
                self._idle.put_nowait(replica)
                if self._depth:  # only split calls that may not take this replica: look again soon
                    self._wakeup.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wakeup.wait(), RECHECK_S)
                continue
            task = asyncio.create_task(self._run(batch, replica), name=f"batch-{self.name}-{replica}")
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _free_replica(self) -> int | None:
        """An idle replica; None after timeout_s without one."""
        try:
            return await asyncio.wait_for(self._idle.get(), self.timeout_s)
        except TimeoutError:
            return None

    def _expire(self) -> None:
        """Fail the pending entries past their time: Overloaded past their request's queue deadline (never
        for a split call, which was encoded once already), EncoderTimeout past `expires`."""
        now = time.perf_counter()
        for queue in self._pending.values():
            if not any(self._expired(entry, now) for entry in queue):
                continue
            kept = [entry for entry in queue if not self._expired(entry, now)]
            gone = [entry for entry in queue if self._expired(entry, now)]
            for entry in gone:
                self._set_depth(self._depth - len(entry.items))
                if entry.future.done():  # the caller gave up
                    continue
                if entry.suspect is None and entry.deadline is not None and entry.deadline < now:
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
            queue.clear()
            queue.extend(kept)

    @staticmethod
    def _expired(entry: _Entry, now: float) -> bool:
        late = entry.suspect is None and entry.deadline is not None and entry.deadline < now
        return late or entry.expires < now or entry.future.done()

    def _may_take(self, entry: _Entry) -> bool:
        """Whether a free replica may run this entry now: a call split out of a hung batch may hang its replica
        too, so it never takes the last one that is not stuck (unless the encoder has only one)."""
        if entry.suspect != "timeout" or len(self.replicas) == 1:
            return True
        return len(self.replicas) - len(self._stuck) > 1

    async def _next_batch(self) -> list[_Entry]:
        """The oldest entry a free replica may take: alone when it was split out of a batch; else entries of its
        modality (never split ones), waiting up to max_wait for the batch to fill."""
        heads = [
            (entry, queue) for queue in self._pending.values() if (entry := self._first_takeable(queue)) is not None
        ]
        if not heads:
            return []
        head, queue = min(heads, key=lambda pair: pair[0].enqueued)
        limit = self.batch_limit()
        if head.suspect is not None:
            queue.remove(head)
            self._set_depth(self._depth - len(head.items))
            return [] if head.future.done() else [head]
        if self.batching and not self._draining:
            until = head.enqueued + self.max_wait_s
            while sum(len(e.items) for e in queue) < limit and not self._draining:
                remaining = until - time.perf_counter()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except TimeoutError:
                    break
        batch: list[_Entry] = []
        kept: list[_Entry] = []
        size = 0
        closed = False  # once a plain entry is left for the next batch, every later one waits too (in order)
        for entry in queue:
            closed = closed or bool(batch) and (not self.batching or size + len(entry.items) > limit)
            if entry.suspect is not None or closed:
                kept.append(entry)
                continue
            self._set_depth(self._depth - len(entry.items))
            if entry.future.done():  # the caller gave up (cancelled): do not spend compute on it
                continue
            batch.append(entry)
            size += len(entry.items)
        queue.clear()
        queue.extend(kept)
        return batch

    def _first_takeable(self, queue: deque[_Entry]) -> _Entry | None:
        """The first entry of a queue that a free replica may run now."""
        return next((entry for entry in queue if self._may_take(entry)), None)

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
        back = None
        if self._stuck_since:
            now = time.perf_counter()
            back = min(self._stuck_s - (now - since) for since in self._stuck_since.values())
            back = back if back > 0 else self._stuck_s  # stuck longer than usual: as long again
        return QueueState(self._depth, self._idle.qsize(), len(self.replicas) - len(self._stuck), back)

    def retry_after_s(self) -> int:
        """Whole seconds until the queue in front of a new call has drained (1 to RETRY_AFTER_MAX_S)."""
        wait = self.expected_wait_s(0)
        return RETRY_AFTER_MAX_S if math.isinf(wait) else min(max(1, math.ceil(wait)), RETRY_AFTER_MAX_S)

    async def _run(self, batch: list[_Entry], replica: int) -> None:
        """Encode one batch on a replica's worker thread and hand each entry its rows (or the exception)."""
        started = time.perf_counter()
        wait_hist = metrics.STAGE_DURATION.labels(stage="queue_wait")
        for entry in batch:
            wait_hist.observe(started - entry.enqueued)
        lease = _Lease(replica)
        try:
            await self._encode_batch(batch, lease)
        finally:
            self._give_back(lease)

    def _give_back(self, lease: _Lease) -> None:
        """Put a batch's replica back in rotation, once: early when its slow call was left its own thread."""
        if lease.returned:
            return
        lease.returned = True
        if lease.replica not in self._stuck:
            self._idle.put_nowait(lease.replica)

    def _split(self, batch: list[_Entry], cause: str) -> None:
        """Send each call of a failed batch back to the front of its queue, to run alone (cause: raised, timeout)."""
        metrics.ENCODER_SPLITS.labels(encoder=self.name, cause=cause).inc()
        # Twice the timeout: time for a stuck replica to come back when the split calls may not take the last one.
        expires = time.perf_counter() + 2 * self.timeout_s
        for entry in reversed(batch):
            if entry.future.done():
                continue
            entry.suspect, entry.expires = cause, expires
            self._pending.setdefault(entry.modality, deque()).appendleft(entry)
            self._set_depth(self._depth + len(entry.items))
        self._wakeup.set()

    async def _encode_batch(self, batch: list[_Entry], lease: _Lease) -> None:
        """Encode on a replica and settle every entry; a batch of several calls that raised or hung is split."""
        modality = batch[0].modality
        items = [item for entry in batch for item in entry.items]
        started = time.perf_counter()
        metrics.ENCODER_BATCH_SIZE.labels(encoder=self.name).observe(len(items))
        loop = asyncio.get_running_loop()
        replica = lease.replica
        encoder = self.replicas[replica]
        call = loop.run_in_executor(self._executors[replica], encoder.encode, items, modality)
        try:
            raw = await self._answer(call, lease, len(items))
            rows = self._shaped(raw, len(items), encoder.dim)
        except asyncio.CancelledError:
            # stop(drain=False) cancelled us mid-batch; the thread finishes on its own.
            self._fail(batch, NotReady(f"encoder {self.name!r} stopped"))
            raise
        except TimeoutError:
            interrupt = getattr(encoder, "interrupt", None)
            if lease.returned:  # already left its own thread while the replica went back to work
                pass
            elif self._may_replace(replica):
                self._replace_thread(replica, call)
            else:
                self._stuck_until_done(replica, call)
            if interrupt is not None and not call.done():
                interrupt()
            log.error("encoder %r: no answer for a batch of %d within %g s", self.name, len(items), self.timeout_s)
            metrics.ENCODER_FAILURES.labels(encoder=self.name, reason="timeout").inc()
            if len(batch) > 1:
                self._split(batch, "timeout")
                return
            # It hung alone: the input is to blame, and a retry of it would stick another replica.
            self.poison.remember(modality, batch[0].items)
            self._fail(batch, EncoderTimeout(f"encoder {self.name!r} did not answer within {self.timeout_s:g} s"))
            return
        except EncoderFailed as exc:  # wrong shape: the whole batch; the batcher keeps serving
            log.warning("encoder %r failed on a batch of %d: %s", self.name, len(items), exc)
            metrics.ENCODER_FAILURES.labels(encoder=self.name, reason="bad_rows").inc()
            self._fail(batch, exc)
            return
        except Exception as exc:  # the model raised: each call retried alone when the batch holds several
            log.warning("encoder %r raised on a batch of %d: %r", self.name, len(items), exc)
            metrics.ENCODER_FAILURES.labels(encoder=self.name, reason="raised").inc()
            if len(batch) > 1:
                self._split(batch, "raised")
                return
            # Ours on purpose (e.g. `external` refusing content): as is.  A dead child process is no answer
            # meant for the caller: a plain encoder_failed, as for any other crash.
            if isinstance(exc, NobackfillError) and not isinstance(exc, EncoderProcessExited):
                self._fail(batch, exc)
                return
            failed = EncoderFailed(f"encoder {self.name!r} failed on {len(items)} input(s)")
            failed.__cause__ = exc  # for the server log; the response names nothing of it
            self._fail(batch, failed)
            return
        finally:
            metrics.ENCODER_BATCH_DURATION.labels(encoder=self.name).observe(time.perf_counter() - started)
        self.rate.observe(len(items), time.perf_counter() - started)
        # Rows with a NaN / inf fail only the calls they belong to.
        bad = set() if np.isfinite(rows).all() else set(np.flatnonzero(~np.isfinite(rows).all(axis=1)).tolist())
        start = 0
        for entry in batch:
            stop = start + len(entry.items)
            if entry.future.done():
                pass
            elif bad.isdisjoint(range(start, stop)):
                entry.future.set_result(rows[start:stop])
            else:
                metrics.ENCODER_FAILURES.labels(encoder=self.name, reason="bad_rows").inc()
                entry.future.set_exception(EncoderFailed(f"encoder {self.name!r} returned NaN or infinite values"))
            start = stop

    def _shaped(self, raw: object, n: int, dim: int) -> Embeddings:
        """The encoder's output as float32 [n, dim], or EncoderFailed saying what came back instead."""
        rows = np.asarray(raw, dtype=np.float32)
        if rows.shape != (n, dim):
            raise EncoderFailed(f"encoder {self.name!r} returned shape {rows.shape} for a batch of {n} (dim {dim})")
        return rows

    async def _answer(self, call: asyncio.Future[Embeddings], lease: _Lease, n: int) -> Embeddings:
        """The call's rows within timeout_s (TimeoutError after).  A thread call still running after
        slow_after_s is left its thread and the replica goes back to work on a fresh one, so one slow
        or hung input does not hold a replica for the whole timeout."""
        # shield: a timeout gives up waiting, it cannot stop the thread; the call still ends later.
        slow_s = max(SLOW_FLOOR_S, SLOW_FACTOR * self.rate.batch_s(n))
        if slow_s < self.timeout_s and self._may_replace(lease.replica):
            done, _ = await asyncio.wait([call], timeout=slow_s)
            if not done and self._may_replace(lease.replica):
                self._replace_thread(lease.replica, call)
                self._give_back(lease)
            return await asyncio.wait_for(asyncio.shield(call), self.timeout_s - slow_s)
        return await asyncio.wait_for(asyncio.shield(call), self.timeout_s)

    def _may_replace(self, replica: int) -> bool:
        """Whether a call on this replica may be left its thread now: a thread replica (a child process is
        interrupted instead) and fewer than stuck_threads such calls running."""
        return getattr(self.replicas[replica], "interrupt", None) is None and self._abandoned < self.stuck_threads

    def _replace_thread(self, replica: int, call: asyncio.Future[Embeddings]) -> None:
        """Leave a hung call its thread and give the replica a fresh one: the replica keeps serving meanwhile."""
        self._abandoned += 1
        self._replacements += 1  # in the fresh thread's name, so a thread dump tells them apart
        fresh = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"encoder-{self.name}-{replica}-r{self._replacements}"
        )
        hung, self._executors[replica] = self._executors[replica], fresh
        hung.shutdown(wait=False)  # its thread ends once the hung call returns
        metrics.ENCODER_THREADS_REPLACED.labels(encoder=self.name).inc()

        def returned(_: asyncio.Future[Embeddings]) -> None:
            self._abandoned -= 1
            log.info("encoder %r: a hung call returned on its abandoned thread", self.name)

        call.add_done_callback(returned)

    def _stuck_until_done(self, replica: int, call: asyncio.Future[Embeddings]) -> None:
        """Keep a timed-out replica out of rotation until its call returns, then free it."""
        self._stuck.add(replica)
        self._stuck_since[replica] = time.perf_counter()

        def release(_: asyncio.Future[Embeddings]) -> None:
            self._stuck.discard(replica)
            since = self._stuck_since.pop(replica, None)
            if since is not None:
                self._stuck_s += 0.3 * (time.perf_counter() - since - self._stuck_s)
            if self._accepting:
                self._idle.put_nowait(replica)
                self._wakeup.set()  # split calls held back for want of a second replica may go now
            log.info("encoder %r replica %d answered again", self.name, replica)

        call.add_done_callback(release)

    def _fail(self, batch: list[_Entry], exc: BaseException) -> None:
        for entry in batch:
            if not entry.future.done():
                entry.future.set_exception(exc)

    def _fail_pending(self, exc: BaseException) -> None:
        for queue in self._pending.values():
            self._fail(list(queue), exc)
            queue.clear()
        self._set_depth(0)

    def _set_depth(self, depth: int) -> None:
        self._depth = depth
        metrics.QUEUE_DEPTH.labels(encoder=self.name).set(depth)
        metrics.EXPECTED_WAIT.labels(encoder=self.name).set(self.expected_wait_s(0))
