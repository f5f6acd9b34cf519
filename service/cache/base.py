"""The `EmbeddingCache` protocol, the cache key and the row codec shared by every backend.

A value is one old-model embedding row as raw little-endian float16 (default) or float32 bytes.
What Redis returns is untrusted: a value of the wrong length, with a NaN / inf, or all zeros (no
direction to search with) is a miss, counted as `corrupt`, and the pipeline's write-back of the miss
replaces it.  Only rows with a direction are written in the first place (`usable_rows`).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

CacheKind = Literal["redis", "memory", "off"]
CacheState = Literal["ok", "cooling_down", "memory", "off"]
CacheDtype = Literal["float16", "float32"]
Row = npt.NDArray[np.float32]

# sha256 runs at about 1 GB/s: past this many characters (base64 images) keys are hashed on a
# worker thread, where hashlib releases the GIL, so the event loop keeps serving meanwhile.
OFFLOAD_CHARS = 1 << 20

# Explicit little-endian so replicas on any architecture read each other's values.
WIRE_DTYPES: dict[str, np.dtype[np.floating]] = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
}


@runtime_checkable
class EmbeddingCache(Protocol):
    """Old-model embeddings by (modality, input); never raises on backend trouble (fail-open)."""

    kind: CacheKind

    async def get_many(self, modality: str, inputs: list[str]) -> list[Row | None]:
        """One float32 [dim] row or None per input, in order."""
        ...

    async def set_many(self, modality: str, inputs: list[str], rows: npt.NDArray[np.floating]) -> None:
        """Store rows [len(inputs), dim]; a backend failure drops the write."""
        ...

    def state(self) -> CacheState:
        """`ok` / `cooling_down` for Redis, `memory` for the LRU, `off` when disabled."""
        ...

    async def ping(self) -> bool:
        """True when the backend answers (always True for in-process backends)."""
        ...

    async def aclose(self) -> None:
        """Release connections; the cache must not be used afterwards."""
        ...


def input_digest(modality: str, text: str) -> str:
    """Hex sha256 of `modality + NUL + input`: fixed-size, so huge inputs never become huge keys."""
    # surrogatepass: a lone surrogate from a JSON body must hash, not crash the lookup.
    return hashlib.sha256(f"{modality}\0{text}".encode("utf-8", "surrogatepass")).hexdigest()


async def input_digests(modality: str, inputs: list[str]) -> list[str]:
    """`input_digest` of every input, off the event loop when the inputs are large."""
    if sum(len(text) for text in inputs) < OFFLOAD_CHARS:
        return [input_digest(modality, text) for text in inputs]
    return await asyncio.to_thread(lambda: [input_digest(modality, text) for text in inputs])


def cache_key(namespace: str, old_model_id: str, modality: str, text: str) -> str:
    """`{namespace}:{old_model_id}:{sha256(modality NUL input)}`."""
    return f"{namespace}:{old_model_id}:{input_digest(modality, text)}"


def check_rows(rows: npt.NDArray[np.floating], n: int, dim: int) -> None:
    """Raise ValueError unless rows is [n, dim] (a caller bug, unlike backend trouble)."""
    if rows.ndim != 2 or rows.shape != (n, dim):
        raise ValueError(f"expected rows of shape ({n}, {dim}), got {rows.shape}")


def decode_row(value: bytes | None, dtype: CacheDtype, dim: int) -> Row | None:
    """Wire bytes back to a float32 [dim] row; None for a missing, wrongly sized, non-finite or zero value."""
    wire = WIRE_DTYPES[dtype]
    if value is None or len(value) != dim * wire.itemsize:
        return None
    row = np.frombuffer(value, dtype=wire).astype(np.float32)
    return row if usable_rows(row[None])[0] else None


def usable_rows(rows: npt.NDArray[np.floating]) -> npt.NDArray[np.bool_]:
    """Mask of the rows worth caching or serving from a cache: finite and not all zero."""
    usable: npt.NDArray[np.bool_] = np.isfinite(rows).all(axis=1) & rows.any(axis=1)
    return usable
