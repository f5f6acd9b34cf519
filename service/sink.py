"""One fail-open background sink: what the request path hands off, written in batches by one thread.

    offer(item) (any thread, never blocks)          the sink's thread
    ──────────────────────────────────────          ─────────────────
    bounded buffer of `capacity` items ───────────► the oldest items, up to batch_size units, once
      full (or closed): the item is dropped,          batch_size units wait, interval_s after the first
      on_drop(units)                                  of them, or on flush() / close() ──► flush(batch)
                                                           raised: on_failure(units), one log line per
                                                           log_every_s; the batch dropped, or (retry_s) put
                                                           back first in line and tried again retry_s later

The traffic sampler, the hit counter and the cascade's segment writer each own one; the request path
pays a lock and a deque append.  Items are measured in units (pairs, ids, rows: `size_of`) for the
batch size and every count; `capacity` bounds the items held, the one being flushed included, so
memory stays bounded however fast the traffic and however slow the flush.  A periodic job (`Periodic`,
the hit counts' halving) may run on the same thread, between flushes.

close(timeout_s) returns within about timeout_s whatever the flush does: the thread gets that long to
write what waits; what still waits then is dropped (on_drop, one log line) and a flush that has not
returned is left to the daemon thread (its units are reported `in_flight`; the flush counts their
fate itself when it returns).  Nothing is counted twice: the dropped units leave the buffer first.

Not a sink: the embedding cache's write-back (query/embedding.py CacheWriteBack), asyncio tasks on
the event loop; its docstring says why.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
log = logging.getLogger("nobackfill")
LOG_EVERY_S = 60.0  # a failing flush is logged at most this often; its counter counts every failure


@dataclass(frozen=True)
class Closed:
    """What close() left unwritten, in units."""

    dropped: int  # waiting when the time ran out (or kept after a failed last try): counted by on_drop
    in_flight: int  # in a flush that had not returned: the flush's own counting says what became of them


@dataclass(frozen=True)
class Periodic:
    """A job the sink's thread runs every `every_s` between flushes; a failure is logged (throttled), not counted."""

    every_s: float
    what: str  # names it in the log line, e.g. "age"
    run: Callable[[], object]


class Throttled:
    """Warnings at most once per `every_s`; the next line says how many were held back meanwhile."""

    def __init__(self, logger: logging.Logger, every_s: float) -> None:
        self.logger = logger
        self.every_s = every_s
        self._last: float | None = None
        self._held = 0
        self._lock = threading.Lock()

    def warning(self, message: str) -> bool:
        """Log `message` unless a line went out less than every_s ago; True when it was logged."""
        with self._lock:
            now = time.monotonic()
            if self._last is not None and now - self._last < self.every_s:
                self._held += 1
                return False
            held, self._held, self._last = self._held, 0, now
        self.logger.warning("%s%s", message, f" ({held} more since the last line)" if held else "")
        return True


def _one(_item: object) -> int:
    return 1


def _ignore(_units: int) -> None:
    return None


class BackgroundSink(Generic[T]):
    """A bounded buffer written by one daemon thread in batches; offer never blocks, close is bounded."""

    def __init__(
        self,
        flush: Callable[[list[T]], object],
        *,
        thread_name: str,
        label: str,
        capacity: int,
        batch_size: int,
        interval_s: float,
        unit: str = "items",
        size_of: Callable[[T], int] = _one,
        on_drop: Callable[[int], None] = _ignore,
        on_failure: Callable[[int], None] = _ignore,
        retry_s: float | None = None,
        periodic: Periodic | None = None,
        logger: logging.Logger = log,
        log_every_s: float = LOG_EVERY_S,
    ) -> None:
        if capacity < 1 or batch_size < 1 or interval_s <= 0:
            raise ValueError("capacity and batch_size must be >= 1 and interval_s > 0")
        self.label = label
        self.unit = unit
        self.capacity = capacity
        self.batch_size = batch_size
        self.interval_s = interval_s
        self.retry_s = retry_s
        self.log = Throttled(logger, log_every_s)
        self._flush = flush
        self._size_of = size_of
        self._on_drop = on_drop
        self._on_failure = on_failure
        self._periodic = periodic
        lock = threading.Lock()
        self._wake = threading.Condition(lock)  # the thread waits on it
        self._done = threading.Condition(lock)  # flush() callers wait on it
        self._items: deque[tuple[T, int]] = deque()  # (item, units), oldest first
        self._units = 0  # units waiting (not in flight)
        self._in_flight = (0, 0)  # (items, units) of the flush running now
        self._first_at: float | None = None  # when the oldest waiting item arrived (or came back after a failure)
        self._retry_at = 0.0
        self._asked = 0  # flush() calls so far
        self._served = 0  # flush() calls answered by a finished pass
        self._closing = False
        self._abandoned = False  # close() gave up waiting: a late failed batch is dropped, not put back
        self._closed: Closed | None = None
        self._next_tick = time.monotonic() + periodic.every_s if periodic else 0.0
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    # -- the request path -------------------------------------------------------------------------

    def offer(self, item: T) -> bool:
        """Hold `item` for the thread; False (dropped, counted) when the buffer is full or the sink closed."""
        units = self._size_of(item)
        with self._wake:
            accepted = not self._closing and len(self._items) + self._in_flight[0] < self.capacity
            if accepted:
                self._items.append((item, units))
                self._units += units
                if self._first_at is None:  # the thread sleeps while nothing waits: give it a deadline
                    self._first_at = time.monotonic()
                    self._wake.notify()
                elif self._units >= self.batch_size:
                    self._wake.notify()
        if not accepted:
            self._on_drop(units)
        return accepted

    @property
    def pending(self) -> int:
        """Units not written yet: waiting, and in the flush running now."""
        with self._wake:
            return self._units + self._in_flight[1]

    # -- flush and close --------------------------------------------------------------------------

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Have the thread write everything waiting now; False if it did not finish within timeout_s."""
        with self._wake:
            if self._closing:
                return self._units == 0 and self._in_flight[1] == 0
            self._asked += 1
            ticket = self._asked
            self._wake.notify()
            return self._done.wait_for(lambda: self._served >= ticket, timeout_s)

    def close(self, timeout_s: float = 5.0) -> Closed:
        """Write what waits, within timeout_s; drop (and count) what is left then. Returns within about timeout_s."""
        with self._wake:
            if self._closing:  # a second close: the first one said what was left
                return self._closed or Closed(0, 0)
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout_s)
        with self._wake:
            self._abandoned = True
            dropped, in_flight = self._units, self._in_flight[1]
            self._items.clear()
            self._units, self._first_at = 0, None
            closed = self._closed = Closed(dropped, in_flight)
        if dropped:
            self._on_drop(dropped)
        if dropped or in_flight:  # not throttled: once per sink
            self.log.logger.warning(
                "%s: closed with %d %s unwritten after %gs: %d dropped, %d in a write that has not returned",
                self.label, dropped + in_flight, self.unit, timeout_s, dropped, in_flight,
            )  # fmt: skip
        return closed

    # -- the thread -------------------------------------------------------------------------------

    def _batch_due_at(self) -> float | None:
        """When the next batch is due (monotonic), None while nothing waits; under the lock."""
        if not self._items or self._first_at is None:
            return None
        if self._retry_at:  # a kept batch waits first in line: it goes once retry_s has passed, whatever its size
            return self._retry_at
        if self._units >= self.batch_size:
            return 0.0
        return self._first_at + self.interval_s

    def _next_job(self) -> tuple[str, int]:
        """Sleep until there is something to do: ("drain", asked), ("tick", 0) or ("batch", 0); under the lock."""
        while True:
            now = time.monotonic()
            if self._closing or self._asked > self._served:
                return "drain", self._asked
            if self._periodic is not None and now >= self._next_tick:
                return "tick", 0
            due = self._batch_due_at()
            if due is not None and due <= now:
                return "batch", 0
            wake = [t for t in (due, self._next_tick if self._periodic else None) if t is not None]
            self._wake.wait(min(wake) - now if wake else None)

    def _run(self) -> None:
        """Write batches when due, run the periodic job, answer flush() and close() with a drain pass."""
        while True:
            with self._wake:
                job, asked = self._next_job()
                closing = self._closing
            if job == "tick":
                self._tick()
            elif job == "batch":
                self._write_one()
            else:
                self._drain()
                with self._wake:
                    self._served = max(self._served, asked)
                    self._done.notify_all()
                if closing:
                    return

    def _tick(self) -> None:
        """The periodic job, guarded: a failure is logged (throttled) and the sink goes on."""
        assert self._periodic is not None
        try:
            self._periodic.run()
        except Exception as exc:  # noqa: BLE001 (fail-open: the sink outlives its store's errors)
            self.log.warning(f"{self.label}: {self._periodic.what} failed ({type(exc).__name__}: {exc})")
        with self._wake:
            self._next_tick = time.monotonic() + self._periodic.every_s

    def _drain(self) -> None:
        """Write what waited when the pass began, batch after batch; stops at a failure that keeps its batch."""
        with self._wake:
            left = len(self._items)
        while left > 0:
            written = self._write_one()
            if written is None or (written[1] is False and self.retry_s is not None) or self._abandoned:
                return
            left -= written[0]

    def _write_one(self) -> tuple[int, bool] | None:
        """Flush the oldest batch: (items in it, whether it was written); None when nothing waits."""
        with self._wake:
            if not self._items:
                return None
            taken: list[tuple[T, int]] = []
            units = 0
            while self._items and (not taken or units < self.batch_size):
                item = self._items.popleft()
                taken.append(item)
                units += item[1]
            self._units -= units
            self._in_flight = (len(taken), units)
            self._first_at = time.monotonic() if self._items else None
        ok = True
        try:
            self._flush([item for item, _ in taken])
        except Exception as exc:  # noqa: BLE001 (fail-open: any error of the flush is counted, never raised)
            ok = False
            self._on_failure(units)
            fate = "kept for a retry" if self.retry_s is not None else "dropped"
            self.log.warning(f"{self.label}: writing {units} {self.unit} failed ({type(exc).__name__}: {exc}); {fate}")
        late_drop = 0
        with self._wake:
            self._in_flight = (0, 0)
            if ok:
                self._retry_at = 0.0
            elif self.retry_s is not None:
                if self._abandoned:  # close() has already reported; nothing will try again
                    late_drop = units
                else:  # first in line again, tried once retry_s has passed
                    self._items.extendleft(reversed(taken))
                    self._units += units
                    now = time.monotonic()
                    self._first_at, self._retry_at = now, now + self.retry_s
            self._done.notify_all()
        if late_drop:
            self._on_drop(late_drop)
        return len(taken), ok
