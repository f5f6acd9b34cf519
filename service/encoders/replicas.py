"""A batcher's replicas: one worker thread each, a batch run on one, its calls settled, split when it failed.

Cut out of the batcher (encoders/batcher.py, whose docstring keeps the failure table) beside its queue
(encoders/batch_queue.py).  A replica is idle (in `idle`), running a batch (leased), or stuck: its call
outlived timeout_s and has not returned, so it takes no batch until it does.  A thread call far past its
measured cost is left its thread while the replica takes the next batch on a fresh one (`stuck_threads`
such calls at most).  A batch of several calls that raised or hung goes back to the queue, each call to
run alone; a call that hung alone is remembered as poison.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from service import metrics
from service.encoders.base import Embeddings, Encoder
from service.encoders.batch_queue import BatchQueue, Entry, fail
from service.encoders.poison import PoisonMemory
from service.encoders.service_rate import ServiceRate
from service.errors import EncoderFailed, EncoderProcessExited, EncoderTimeout, NobackfillError, NotReady

log = logging.getLogger(__name__)

# A thread call this many times its measured cost (and at least SLOW_FLOOR_S) is left its thread while
# the replica takes the next batch on a fresh one (stuck_threads at most at once): a hung input then holds
# a replica for SLOW_FLOOR_S, not for timeout_s, and two hangs at once no longer stop every replica.
SLOW_FACTOR = 10.0
SLOW_FLOOR_S = 0.25


@dataclass(eq=False)
class Lease:
    """A replica taken for one batch; `returned` once it is back in rotation."""

    replica: int
    returned: bool = False


@dataclass(eq=False)
class ReplicaPool:
    """The replicas of one encoder and their worker threads: which are idle or stuck, and running a batch on one.

    queue: where the calls of a failed batch go back to run alone.  on_back: called with a stuck replica
    once its call has returned (the batcher puts it back in rotation while it is serving).
    stuck_threads: hung calls that may keep running on a thread of their own while a fresh thread takes
    their replica's place (threads cannot be interrupted); past it, a replica is set aside until its call
    returns.
    """

    replicas: Sequence[Encoder]
    name: str
    timeout_s: float
    stuck_threads: int
    rate: ServiceRate
    poison: PoisonMemory
    queue: BatchQueue
    on_back: Callable[[int], None]
    stuck: set[int] = field(default_factory=set)  # replicas whose call outlived timeout_s and has not returned yet
    idle: asyncio.Queue[int] = field(default_factory=asyncio.Queue)
    _abandoned: int = 0  # hung calls still running on an abandoned thread
    _replacements: int = 0
    _stuck_since: dict[int, float] = field(default_factory=dict)
    _executors: list[ThreadPoolExecutor] = field(default_factory=list)

    def __post_init__(self) -> None:
        # How long a replica set aside stays stuck (moving average; a child process: until it is replaced).
        self._stuck_s = self.timeout_s

    def start(self) -> None:
        """A worker thread per replica, every replica idle (fresh primitives: they bind to the running loop)."""
        self._executors = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"encoder-{self.name}-{i}")
            for i in range(len(self.replicas))
        ]
        self.idle = asyncio.Queue()
        for i in range(len(self.replicas)):
            self.idle.put_nowait(i)
        self.stuck.clear()
        self._stuck_since.clear()

    async def shutdown(self) -> None:
        """Join the worker threads (each after its running batch)."""
        executors, self._executors = self._executors, []
        for executor in executors:
            # shutdown(wait=True) blocks until a running batch ends: do that wait off the loop.
            await asyncio.to_thread(executor.shutdown, True)

    def problem(self) -> str | None:
        """Why no replica can serve right now, or None when one can."""
        if len(self.stuck) == len(self.replicas):
            return f"every replica is stuck in a call longer than {self.timeout_s:g} s"
        if all(getattr(replica, "replacing", False) for replica in self.replicas):  # process isolation only
            return "every replica's encoder process is loading its replacement"
        return None

    @property
    def answering(self) -> int:
        """Replicas not stuck."""
        return len(self.replicas) - len(self.stuck)

    def back_s(self) -> float | None:
        """Seconds until the first stuck replica is expected back (None while none is stuck)."""
        if not self._stuck_since:
            return None
        now = time.perf_counter()
        back = min(self._stuck_s - (now - since) for since in self._stuck_since.values())
        return back if back > 0 else self._stuck_s  # stuck longer than usual: as long again

    def suspects_may_run(self) -> bool:
        """Whether a free replica may run a call split out of a hung batch: it may hang its replica too, so it
        never takes the last one that is not stuck (unless the encoder has only one)."""
        return len(self.replicas) == 1 or self.answering > 1

    async def free(self) -> int | None:
        """An idle replica; None after timeout_s without one."""
        try:
            return await asyncio.wait_for(self.idle.get(), self.timeout_s)
        except TimeoutError:
            return None

    async def run(self, batch: list[Entry], replica: int) -> None:
        """Encode one batch on a replica's worker thread and hand each entry its rows (or the exception)."""
        started = time.perf_counter()
        wait_hist = metrics.STAGE_DURATION.labels(stage="queue_wait")
        for entry in batch:
            wait_hist.observe(started - entry.enqueued)
        lease = Lease(replica)
        try:
            await self._encode_batch(batch, lease)
        finally:
            self._give_back(lease)

    def _give_back(self, lease: Lease) -> None:
        """Put a batch's replica back in rotation, once: early when its slow call was left its own thread."""
        if lease.returned:
            return
        lease.returned = True
        if lease.replica not in self.stuck:
            self.idle.put_nowait(lease.replica)

    def _split(self, batch: list[Entry], cause: str) -> None:
        """Send each call of a failed batch back to the front of its queue, to run alone (cause: raised, timeout)."""
        metrics.ENCODER_SPLITS.labels(encoder=self.name, cause=cause).inc()
        # Twice the timeout: time for a stuck replica to come back when the split calls may not take the last one.
        self.queue.requeue(batch, cause, time.perf_counter() + 2 * self.timeout_s)

    async def _encode_batch(self, batch: list[Entry], lease: Lease) -> None:
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
            fail(batch, NotReady(f"encoder {self.name!r} stopped"))
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
            fail(batch, EncoderTimeout(f"encoder {self.name!r} did not answer within {self.timeout_s:g} s"))
            return
        except EncoderFailed as exc:  # wrong shape: the whole batch; the batcher keeps serving
            log.warning("encoder %r failed on a batch of %d: %s", self.name, len(items), exc)
            metrics.ENCODER_FAILURES.labels(encoder=self.name, reason="bad_rows").inc()
            fail(batch, exc)
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
                fail(batch, exc)
                return
            failed = EncoderFailed(f"encoder {self.name!r} failed on {len(items)} input(s)")
            failed.__cause__ = exc  # for the server log; the response names nothing of it
            fail(batch, failed)
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

    async def _answer(self, call: asyncio.Future[Embeddings], lease: Lease, n: int) -> Embeddings:
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
        self.stuck.add(replica)
        self._stuck_since[replica] = time.perf_counter()

        def release(_: asyncio.Future[Embeddings]) -> None:
            self.stuck.discard(replica)
            since = self._stuck_since.pop(replica, None)
            if since is not None:
                self._stuck_s += 0.3 * (time.perf_counter() - since - self._stuck_s)
            self.on_back(replica)
            log.info("encoder %r replica %d answered again", self.name, replica)

        call.add_done_callback(release)
