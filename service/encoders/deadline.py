"""The queue deadline of the request being served, carried to the batchers in a context variable.

The pipeline admits a search on its expected wait and sets how long its items may sit in an encoder's
queue; every entry the request submits meanwhile (tasks copy the context) carries that deadline, and
the batcher answers an entry still queued past it with 503 overloaded before it encodes it.  A context
variable, not an argument, because the calls pass through the embedding stage, which has no say in it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_DEADLINE: ContextVar[float | None] = ContextVar("nobackfill_queue_deadline", default=None)


@contextmanager
def queued_until(deadline: float | None) -> Iterator[None]:
    """Entries submitted inside this block must leave the queue by `deadline` (time.perf_counter); None: no bound."""
    token = _DEADLINE.set(deadline)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def current() -> float | None:
    """The deadline of the request being served here, or None."""
    return _DEADLINE.get()
