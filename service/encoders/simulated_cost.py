"""A wrapper that adds a fixed, simulated compute time to every batch of another encoder.

Benchmarks and tests use it to give the synthetic encoders the cost profile of a real model on a
GPU: the wait releases the GIL as a CUDA kernel wait would, so two of them can overlap.
"""

from __future__ import annotations

import time

from service.encoders.base import Embeddings, Encoder, Wrapper, fingerprint_of
from service.vocabulary import Modality


class SimulatedCostEncoder(Wrapper):
    """Delegates to `inner`, then waits so each batch costs `base_ms + per_item_ms * len(batch)`."""

    def __init__(self, inner: Encoder, base_ms: float, per_item_ms: float = 0.0) -> None:
        super().__init__(inner)
        self.base_ms = base_ms
        self.per_item_ms = per_item_ms
        self.fingerprint = fingerprint_of(inner)

    def encode(self, batch: list[str], modality: Modality = Modality.text) -> Embeddings:
        """Encode with the inner encoder, padded to the simulated cost."""
        start = time.perf_counter()
        rows = self.inner.encode(batch, modality)
        target_s = (self.base_ms + self.per_item_ms * len(batch)) / 1000
        remaining = target_s - (time.perf_counter() - start)
        if remaining > 0:
            time.sleep(remaining)
        return rows
