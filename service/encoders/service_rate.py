"""An encoder's measured cost, seconds = base + per_item * n, fitted to its recent batches.

The batcher feeds every answered batch in; admission reads `batch_s(n)` to turn the items queued in
front of a request into an expected wait.  A weighted least-squares line with exponential forgetting
(each batch's weight decays by DECAY per later batch, so the last ~100 batches speak), because the cost
changes with the model, the hardware and whatever else shares them.  Until batches of two sizes were
seen the slope is unknown: the cost is then taken as proportional to n (base 0), which overestimates
larger batches, so a burst that arrives after a quiet spell is admitted conservatively at first.

The line also caps how large a batch may grow (`largest_within`): every item of a batch waits for the
whole batch, so a batch must end within the time the service allows a queued search.  A CPU model's
cost is nearly all per item (MiniLM on 2 cores: a batch of 31 took 330 ms, one of 10 about 120 ms, for
88 % of the throughput), a GPU's mostly per call, so the size follows the measured cost.  The last
line fitted is kept while batches of one size leave the slope unknown, as they do once a sustained
burst fills every batch to the cap.  No cap applies before a line is known, nor below the size at
which the fixed cost is half the batch (a busy box makes every call slow: capping then would only
split what batching amortises, and refuse concurrent searches that one batch would serve).
"""

from __future__ import annotations

import math

DECAY = 0.99


class ServiceRate:
    """Recent batches' seconds as a line in their size; zero cost until a batch was seen."""

    def __init__(self) -> None:
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self._last_line: tuple[float, float] | None = None  # (base, per_item) of the last fit with a slope

    def observe(self, n: int, seconds: float) -> None:
        """One answered batch of n items that took `seconds`."""
        for name, value in (("_w", 1.0), ("_n", n), ("_t", seconds), ("_nn", n * n), ("_nt", n * seconds)):
            setattr(self, name, getattr(self, name) * DECAY + value)

    def batch_s(self, n: int) -> float:
        """Expected seconds of a batch of n items."""
        if self._w == 0 or n <= 0:
            return 0.0
        line = self._line()
        if line is None:  # no two batch sizes seen yet: proportional to n
            return self._t / self._n * n
        base, per_item = line
        return base + per_item * n

    def largest_within(self, seconds: float, most: int) -> int:
        """The largest batch (1 to `most`) expected to take at most `seconds`, but never smaller than the size at
        which the fixed cost is half the batch: below it a smaller batch costs more throughput than its items
        gain in wait (a GPU, or a box so busy that every call is slow).  `most` until a line is known."""
        line = self._line()
        if line is None:  # no slope yet: a cost taken as proportional to n would shrink every batch to one
            return most
        base, per_item = line
        if per_item <= 0:
            return most
        within = int((seconds - base) / per_item)
        return max(1, min(most, max(within, math.ceil(base / per_item))))

    def _line(self) -> tuple[float, float] | None:
        """(base, per_item) seconds of the weighted least-squares line, or the last one fitted; None before one."""
        if self._w == 0:
            return None
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var_n = self._nn / self._w - mean_n * mean_n
        if var_n >= 1e-6 * max(mean_n * mean_n, 1.0):
            slope = max((self._nt / self._w - mean_n * mean_t) / var_n, 0.0)
            self._last_line = (max(mean_t - slope * mean_n, 0.0), slope)
        return self._last_line
