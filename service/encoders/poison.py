"""Inputs that hung an encoder on their own, remembered for a while so a retry is refused at once.

A thread stuck in a model call cannot be interrupted: each retry of an input that hangs the model
takes a replica away for as long as the hang lasts.  The batcher convicts an input only when its call
timed out with no batch-mate to blame (it ran alone), and remembers a hash of it (never the text) for
ttl_s; submit() refuses it meanwhile with PoisonInput (422).  Bounded: past `capacity` the oldest is
forgotten first.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Sequence


def _key(modality: str, items: Sequence[str]) -> bytes:
    """One digest for a call's chunk (a single input is a chunk of one)."""
    digest = hashlib.blake2b(modality.encode(), digest_size=16)
    for item in items:
        digest.update(b"\0")
        digest.update(item.encode("utf-8", "surrogatepass"))
    return digest.digest()


class PoisonMemory:
    """A bounded set of input hashes, each forgotten ttl_s after it was remembered."""

    def __init__(self, ttl_s: float, capacity: int) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._until: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._until)

    def remember(self, modality: str, items: Sequence[str]) -> None:
        """Refuse these inputs (as one chunk) for ttl_s from now; no-op when ttl_s is 0."""
        if self.ttl_s <= 0:
            return
        key = _key(modality, items)
        self._until.pop(key, None)
        self._until[key] = time.monotonic() + self.ttl_s
        while len(self._until) > self.capacity:
            self._until.popitem(last=False)

    def holds(self, modality: str, items: Sequence[str]) -> bool:
        """Whether this chunk, or any one of its inputs, hung the encoder within ttl_s."""
        if not self._until:
            return False
        now = time.monotonic()
        while self._until and next(iter(self._until.values())) <= now:  # forget the expired, oldest first
            self._until.popitem(last=False)
        keys = [_key(modality, items)]
        if len(items) > 1:
            keys += [_key(modality, [item]) for item in items]
        return any(key in self._until for key in keys)
