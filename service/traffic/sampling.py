"""What the traffic sampler and the hit counter share: a sample rate drawn on the request path.

Both pick a share of each request's rows (pairs, result lists) with one vectorised random draw and hand
them to a BackgroundSink that feeds their store; see traffic/sampler.py and traffic/hits.py.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from service.sink import BackgroundSink

Store = TypeVar("Store")


class Sampling(Generic[Store]):
    """A store fed, through the subclass's BackgroundSink, with a `rate` share of what the request path offers."""

    _sink: BackgroundSink[Any]

    def __init__(self, store: Store, rate: float, flush_s: float, seed: int | None) -> None:
        if not 0.0 < rate <= 1.0:
            raise ValueError("rate must be in (0, 1]")
        self.store = store
        self.rate = rate
        self.flush_s = flush_s
        self._rng = np.random.default_rng(seed)

    def _picked(self, n: int) -> npt.NDArray[np.bool_]:
        """Which of n rows the rate picks (no draw at rate 1: every row)."""
        return np.ones(n, dtype=bool) if self.rate >= 1.0 else self._rng.random(n) < self.rate

    @property
    def pending(self) -> int:
        """Rows offered but not stored yet."""
        return self._sink.pending
