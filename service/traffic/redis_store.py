"""Sampled pairs in one Redis stream, capped by length and age: XADD MAXLEN, XTRIM MINID, EXPIRE.

Entry fields: o (old row, float16 bytes), n (new row, float16 bytes), q (modality), m (models_key).
Every flush is one pipeline: XADD each pair with an exact MAXLEN = max_pairs (the bound holds after
every write, not eventually), XTRIM MINID drops entries older than ttl_s (stream ids are
millisecond timestamps), EXPIRE ttl_s removes the whole key once nothing is sampled for that long.
The client is the synchronous redis-py one: it runs on the sampler's drain thread, never on the event
loop, with short timeouts and no retries (a failed flush is counted and dropped by the sampler).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import redis

from service.traffic.base import PairBatch, StoredPairs, StoreKind, merge_runs

_READ_CHUNK = 1000


def _client(url: str, timeout_s: float) -> Any:
    """A synchronous client for a plain or `+cluster` URL (the cache's URL rules)."""
    from service.cache.redis_cache import split_cluster_url

    plain, cluster = split_cluster_url(url)
    options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if cluster:
        return redis.RedisCluster.from_url(plain, **options)
    return redis.Redis.from_url(plain, **options)


class RedisPairStore:
    """One stream key holding at most max_pairs entries, none older than ttl_s."""

    kind: StoreKind = "redis"

    def __init__(self, url: str, *, key: str, max_pairs: int, ttl_s: int, timeout_s: float = 1.0) -> None:
        if max_pairs < 1:
            raise ValueError("max_pairs must be >= 1")
        self.key = key
        self.max_pairs = max_pairs
        self.ttl_s = ttl_s
        self._client = _client(url, timeout_s)

    def append(self, batches: Sequence[PairBatch]) -> int:
        """XADD every pair (exact MAXLEN), trim by age, refresh the key's TTL: one round trip."""
        pipe = self._client.pipeline(transaction=False)
        stored = 0
        for batch in batches:
            old, new = batch.old.astype(np.float16), batch.new.astype(np.float16)
            for i in range(len(batch)):
                fields = {"o": old[i].tobytes(), "n": new[i].tobytes(), "q": batch.modality[i], "m": batch.models}
                pipe.xadd(self.key, fields, maxlen=self.max_pairs, approximate=False)
                stored += 1
        if not stored:
            return 0
        oldest_ms = int(time.time() * 1000) - self.ttl_s * 1000
        pipe.xtrim(self.key, minid=f"{max(0, oldest_ms)}-0", approximate=False)
        pipe.expire(self.key, self.ttl_s)
        pipe.execute()
        return stored

    def read(self, limit: int | None = None) -> StoredPairs:
        """The newest `limit` entries (all when None), newest first, paged with XREVRANGE."""
        runs: list[PairBatch] = []
        upper = "+"
        left = limit
        oldest_ms = int(time.time() * 1000) - self.ttl_s * 1000
        while left is None or left > 0:
            count = _READ_CHUNK if left is None else min(_READ_CHUNK, left)
            entries = self._client.xrevrange(self.key, max=upper, min=f"{max(0, oldest_ms)}-0", count=count)
            if not entries:
                break
            for _, fields in entries:
                runs.append(_decode(fields))
            upper = "(" + _text(entries[-1][0])
            if left is not None:
                left -= len(entries)
            if len(entries) < count:
                break
        return StoredPairs(merge_runs(runs))

    def count(self) -> int:
        """XLEN of the stream."""
        return int(self._client.xlen(self.key))

    def clear(self) -> None:
        """Delete the stream (tests and operators)."""
        self._client.delete(self.key)

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()


def _text(value: bytes | str) -> str:
    """A Redis reply as str."""
    return value.decode() if isinstance(value, bytes) else value


def _decode(fields: dict[bytes, bytes]) -> PairBatch:
    """One stream entry as a one-row batch; ValueError when a field is missing or malformed."""
    try:
        old = np.frombuffer(fields[b"o"], dtype=np.float16)[None]
        new = np.frombuffer(fields[b"n"], dtype=np.float16)[None]
        return PairBatch(_text(fields[b"m"]), old, new, (_text(fields[b"q"]),))
    except (KeyError, ValueError) as exc:
        raise ValueError(f"malformed traffic entry ({type(exc).__name__}: {exc})") from exc
