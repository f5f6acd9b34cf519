"""The admission ticket of one admitted search, passed to the batchers with its calls.

The pipeline admits a search on its expected wait and issues a ticket (pipeline/admission.py): how long
its items may sit in an encoder's queue (the deadline), and the items it is expected to bring each
encoder (reserved at admission, so that searches admitted in the same instant, before any of them
reached a queue, count each other).  Each call the embedding stage makes for the search carries the
ticket: the batcher turns reserved items into queued ones and answers an entry still queued past the
deadline with 503 overloaded before it encodes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Ticket:
    """One admitted request: its queue deadline (time.perf_counter; None: no bound) and the items it has
    reserved per batcher name and not yet queued."""

    deadline: float | None
    reserved: dict[str, int] = field(default_factory=dict)
