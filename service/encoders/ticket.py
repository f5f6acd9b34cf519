"""The admission ticket of the request being served, carried to the batchers in a context variable.

The pipeline admits a search on its expected wait and issues a ticket: how long its items may sit in
an encoder's queue (the deadline), and the items it is expected to bring each encoder (reserved at
admission, so that searches admitted in the same instant, before any of them reached a queue, count
each other).  Every entry the request submits meanwhile (tasks copy the context) carries the deadline
and turns reserved items into queued ones; the batcher answers an entry still queued past the deadline
with 503 overloaded before it encodes it.  A context variable, not an argument, because the calls pass
through the embedding stage, which has no say in either.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass(eq=False)
class Ticket:
    """One admitted request: its queue deadline (time.perf_counter; None: no bound) and the items it has
    reserved per batcher name and not yet queued."""

    deadline: float | None
    reserved: dict[str, int] = field(default_factory=dict)


_TICKET: ContextVar[Ticket | None] = ContextVar("nobackfill_admission_ticket", default=None)


@contextmanager
def admitted(ticket: Ticket) -> Iterator[None]:
    """Entries submitted inside this block belong to `ticket`."""
    token = _TICKET.set(ticket)
    try:
        yield
    finally:
        _TICKET.reset(token)


def current() -> Ticket | None:
    """The ticket of the request being served here, or None."""
    return _TICKET.get()
