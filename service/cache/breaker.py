"""A consecutive-failure circuit breaker, so a dead Redis costs nothing per request.

    closed ──threshold consecutive failures──► open ──cooldown_s passed──► one trial call
      ▲                                         ▲                              │
      └──────────────── success ────────────────┴────────── failure ───────────┘

While open every caller is refused at once; after the cool-down exactly one caller is let through
as a trial, the rest stay refused until that trial ends. Single event loop only (no lock): the
state changes between awaits, never across them.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class CircuitBreaker:
    """Refuse calls for `cooldown_s` after `threshold` consecutive failures, then try one."""

    def __init__(self, threshold: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if threshold < 1:
            raise ValueError("threshold must be >= 1")
        self._threshold = threshold
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._failures = 0
        self._open_until = 0.0
        self._trial_running = False

    @property
    def is_open(self) -> bool:
        """True from the opening failure until a call succeeds again."""
        return self._failures >= self._threshold

    def allow(self) -> bool:
        """May a call go through now? Claims the single trial slot once the cool-down has passed."""
        if not self.is_open:
            return True
        if self._trial_running or self._clock() < self._open_until:
            return False
        self._trial_running = True
        return True

    def record_success(self) -> bool:
        """A call worked; returns True if this closed an open breaker."""
        was_open = self.is_open
        self._failures = 0
        self._trial_running = False
        return was_open

    def record_failure(self) -> bool:
        """A call failed; returns True if this opened the breaker (not merely extended it)."""
        was_open = self.is_open
        self._failures += 1
        self._trial_running = False
        if self.is_open:
            self._open_until = self._clock() + self._cooldown_s
        return self.is_open and not was_open

    def abandon(self) -> None:
        """A call ended without an answer (cancelled): free the trial slot without judging Redis."""
        self._trial_running = False
