"""Load shedding before any work: while the event loop runs late, new searches get 503 at once.

Past the CPU's capacity, requests queue where no counter of ours sees them: in the sockets and in
the event loop's backlog of ready callbacks, before the app is called.  `max_in_flight` (the queries
inside the pipeline) never fills then, and every request waits seconds.  The loop's lateness is the
measure of that hidden queue: LoopLag sleeps TICK_S again and again and keeps a moving average of
how late it woke.  While it is over `api.shed_lag_ms`, LoadShedder refuses a search before its body
is read or parsed (503 overloaded, Retry-After), which costs the loop far less than serving it, so
the backlog drains and the requests it lets in keep a bounded latency.  Only POST /v1/search is
shed: health, readiness, metrics and admin calls always get through.

The queue the service does see, in front of the encoders, is admitted by time, not by count
(pipeline/admission.py): a search is refused while the wait it can expect there is over
`api.max_queue_ms`.  The shedder asks that question too, for one query, before the body is read, so
that in a burst the refusals stay cheap; the pipeline asks again with the request's own size.

    lag <- (1 - WEIGHT) * lag + WEIGHT * late          late = how long past its deadline a tick woke
An average, not a maximum: one stall (a GC pass, a noisy neighbour taking the core for 200 ms) moves
it by WEIGHT of the stall and sheds nothing; a loop that is late tick after tick (overload) reaches
its true lateness within a few dozen ticks.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import ASGIApp, Receive, Scope, Send

from service import metrics
from service.errors import Overloaded

TICK_S = 0.01
WEIGHT = 0.1
SHED_PATHS = frozenset({"/v1/search"})


class LoopLag:
    """How late the running event loop wakes a timer: a moving average, in seconds."""

    def __init__(self) -> None:
        self.lag_s = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start measuring on the running loop; idempotent."""
        if self._task is None:
            self._task = asyncio.create_task(self._measure(), name="loop-lag")

    async def stop(self) -> None:
        """Stop measuring."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _measure(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + TICK_S
            await asyncio.sleep(TICK_S)
            late = max(loop.time() - due, 0.0)
            self.lag_s += WEIGHT * (late - self.lag_s)
            metrics.EVENT_LOOP_LAG.set(self.lag_s)


class LoadShedder:
    """Refuse POST /v1/search with 503 + Retry-After while the loop lag is over `limit_ms` (0: never)."""

    def __init__(self, app: ASGIApp, lag: LoopLag, limit_ms: float) -> None:
        self.app = app
        self.lag = lag
        self.limit_s = limit_ms / 1000

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in SHED_PATHS:
            if self.limit_s > 0 and self.lag.lag_s > self.limit_s:
                metrics.SHED_REQUESTS.inc()
                raise Overloaded(
                    f"overloaded: the server runs {self.lag.lag_s * 1000:.0f} ms behind "
                    f"(limit {self.limit_s * 1000:.0f} ms); retry later"
                )
            # The queue-time admission for one query, before the body is read and parsed: a refusal in a
            # burst then costs the loop next to nothing.  The pipeline checks the request's own size again.
            pipeline = getattr(scope["app"].state, "pipeline", None) if "app" in scope else None
            if pipeline is not None and (refusal := pipeline.admission.queue_refusal(1)) is not None:
                raise refusal
        await self.app(scope, receive, send)
