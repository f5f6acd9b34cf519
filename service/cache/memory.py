"""In-process backends: a bounded LRU used when no Redis URL is set, and the null cache ("off").

The LRU stores rows in the configured wire dtype (float16 halves its memory, and a replica without
Redis then sees exactly the precision it would see through Redis) and returns float32 copies, so
callers may modify what they get. A lock makes it safe from worker threads as well as the loop;
its critical sections are dictionary operations on a handful of rows.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import numpy.typing as npt

from service import metrics
from service.cache.base import (
    WIRE_DTYPES,
    CacheDtype,
    CacheKind,
    CacheState,
    Row,
    check_rows,
    input_digests,
)


class LruCache:
    """At most `size` rows in process memory, least recently used evicted first."""

    kind: CacheKind = "memory"

    def __init__(self, size: int, dim: int, dtype: CacheDtype = "float16") -> None:
        if size < 1 or dim < 1:
            raise ValueError("size and dim must be >= 1")
        self._size = size
        self._dim = dim
        self._wire = WIRE_DTYPES[dtype]
        self._rows: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rows)

    async def get_many(self, modality: str, inputs: list[str]) -> list[Row | None]:
        """One float32 [dim] copy or None per input; a hit becomes most recently used."""
        digests = await input_digests(modality, inputs)
        found: list[Row | None] = []
        with self._lock:
            for digest in digests:
                row = self._rows.get(digest)
                if row is not None:
                    self._rows.move_to_end(digest)
                    found.append(row.astype(np.float32))  # astype copies: the stored row stays private
                else:
                    found.append(None)
        hits = sum(row is not None for row in found)
        metrics.cache_event("hit", hits)
        metrics.cache_event("miss", len(found) - hits)
        return found

    async def set_many(self, modality: str, inputs: list[str], rows: npt.NDArray[np.floating]) -> None:
        """Store copies of rows [len(inputs), dim], evicting the least recently used beyond `size`."""
        check_rows(rows, len(inputs), self._dim)
        digests = await input_digests(modality, inputs)
        # One private copy per row: a view into `rows` would keep the caller's whole batch alive.
        copies = [np.array(row, dtype=self._wire) for row in rows]
        with self._lock:
            for digest, row in zip(digests, copies, strict=True):
                self._rows[digest] = row
                self._rows.move_to_end(digest)
            while len(self._rows) > self._size:
                self._rows.popitem(last=False)

    def state(self) -> CacheState:
        """Always `memory`."""
        return "memory"

    async def ping(self) -> bool:
        """Always True: nothing to reach."""
        return True

    async def aclose(self) -> None:
        """Drop every row."""
        with self._lock:
            self._rows.clear()


class NullCache:
    """The cache switched off: every lookup misses, every write is ignored."""

    kind: CacheKind = "off"

    def __init__(self, dim: int) -> None:
        self._dim = dim

    async def get_many(self, modality: str, inputs: list[str]) -> list[Row | None]:  # noqa: ARG002
        """All misses (counted, so the hit ratio reads 0 rather than missing)."""
        metrics.cache_event("miss", len(inputs))
        return [None] * len(inputs)

    async def set_many(self, modality: str, inputs: list[str], rows: npt.NDArray[np.floating]) -> None:  # noqa: ARG002
        """Check the shape, store nothing."""
        check_rows(rows, len(inputs), self._dim)

    def state(self) -> CacheState:
        """Always `off`."""
        return "off"

    async def ping(self) -> bool:
        """Always True: nothing to reach."""
        return True

    async def aclose(self) -> None:
        """Nothing to release."""
