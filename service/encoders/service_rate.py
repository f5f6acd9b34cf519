"""An encoder's measured cost, seconds = base + per_item * n, fitted to its recent batches.

The batcher feeds every answered batch in; admission reads `batch_s(n)` to turn the items queued in
front of a request into an expected wait.  A weighted least-squares line with exponential forgetting
(each batch's weight decays by DECAY per later batch, so the last ~100 batches speak), because the cost
changes with the model, the hardware and whatever else shares them.  While every recent batch had one
size the slope is unknown: the cost is then taken as proportional to n (base 0), which overestimates
larger batches, so a burst that arrives after a quiet spell is admitted conservatively at first.
"""

from __future__ import annotations

DECAY = 0.99


class ServiceRate:
    """Recent batches' seconds as a line in their size; zero cost until a batch was seen."""

    def __init__(self) -> None:
        self._w = self._n = self._t = self._nn = self._nt = 0.0

    def observe(self, n: int, seconds: float) -> None:
        """One answered batch of n items that took `seconds`."""
        for name, value in (("_w", 1.0), ("_n", n), ("_t", seconds), ("_nn", n * n), ("_nt", n * seconds)):
            setattr(self, name, getattr(self, name) * DECAY + value)

    def batch_s(self, n: int) -> float:
        """Expected seconds of a batch of n items."""
        if self._w == 0 or n <= 0:
            return 0.0
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var_n = self._nn / self._w - mean_n * mean_n
        if var_n < 1e-6 * max(mean_n * mean_n, 1.0):  # one batch size so far: proportional to n
            return mean_t * n / mean_n
        slope = max((self._nt / self._w - mean_n * mean_t) / var_n, 0.0)
        base = max(mean_t - slope * mean_n, 0.0)
        return base + slope * n
