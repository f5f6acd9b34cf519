"""Redis backend of the old-embedding cache: MGET lookups, pipelined SET+TTL writes, fail-open.

Any error from Redis (refused, reset, timed out, a server that hangs) turns the lookup into misses
or drops the write; it is counted in `nobackfill_cache_events_total` and never reaches the caller.
After `error_threshold` consecutive errors a circuit breaker skips Redis for `cooldown_s`, then
lets one trial call through. Every call is also bounded by an overall deadline, so a slow Redis
costs a request at most a few socket timeouts.

Redis Cluster: a URL with the scheme `redis+cluster://` (or `rediss+cluster://`) uses
`redis.asyncio.cluster.RedisCluster`; lookups then use MGET split per slot (`mget_nonatomic`),
since one MGET cannot span slots. Other schemes (`redis://`, `rediss://`, `unix://`) use one node.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from service import metrics
from service.cache.base import (
    WIRE_DTYPES,
    CacheDtype,
    CacheKind,
    CacheState,
    Row,
    check_rows,
    decode_row,
    input_digests,
)
from service.cache.breaker import CircuitBreaker
from service.settings import CacheSettings

log = logging.getLogger(__name__)
T = TypeVar("T")

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
# Budget for one whole call in socket timeouts: connect, send, read, plus slack for the loop.
DEADLINE_TIMEOUTS = 4


def split_cluster_url(url: str) -> tuple[str, bool]:
    """`(url redis-py understands, is_cluster)`: strips the `+cluster` marker from the scheme."""
    scheme, sep, rest = url.partition("://")
    plain = CLUSTER_SCHEMES.get(scheme.lower())
    if sep and plain is not None:
        return f"{plain}://{rest}", True
    return url, False


def connect(url: str, socket_timeout_s: float, max_connections: int = 64) -> tuple[Redis | RedisCluster, bool]:
    """A lazily connecting client with short timeouts, no retries (the breaker decides) and a bounded pool."""
    plain_url, cluster = split_cluster_url(url)
    options: dict[str, Any] = {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": socket_timeout_s,
        # Retrying inside redis-py would multiply the latency a dead Redis adds to each request.
        "retry": Retry(NoBackoff(), 0),
        "decode_responses": False,
    }
    if cluster:
        return RedisCluster.from_url(plain_url, max_connections=max_connections, **options), True
    # Bounded and blocking: a burst waits (at most one socket timeout) for a free connection
    # instead of opening thousands; a wait that times out is one more cache error, i.e. a miss.
    pool = BlockingConnectionPool.from_url(
        plain_url, max_connections=max_connections, timeout=socket_timeout_s, **options
    )
    return Redis.from_pool(pool), False


class RedisCache:
    """Old-model embeddings in Redis, shared by every replica; fail-open."""

    kind: CacheKind = "redis"

    def __init__(
        self,
        client: Redis | RedisCluster,
        *,
        namespace: str,
        old_model_id: str,
        dim: int,
        dtype: CacheDtype = "float16",
        ttl_s: int = 7 * 24 * 3600,
        deadline_s: float = 0.2,
        breaker: CircuitBreaker | None = None,
        cluster: bool = False,
    ) -> None:
        if dim < 1:
            raise ValueError("dim must be >= 1")
        self._client = client
        self._cluster = cluster
        self._prefix = f"{namespace}:{old_model_id}:"
        self._dim = dim
        self._dtype: CacheDtype = dtype
        self._ttl_s = ttl_s
        self._deadline_s = deadline_s
        self._breaker = breaker or CircuitBreaker(threshold=3, cooldown_s=10.0)

    @classmethod
    def from_settings(cls, settings: CacheSettings, old_model_id: str, dim: int) -> RedisCache:
        """Build from the cache settings; connects lazily, so a down Redis does not stop startup."""
        if not settings.redis_url:
            raise ValueError("settings.redis_url is not set")
        client, cluster = connect(settings.redis_url, settings.socket_timeout_s, settings.max_connections)
        return cls(
            client,
            namespace=settings.namespace,
            old_model_id=old_model_id,
            dim=dim,
            dtype=settings.dtype,
            ttl_s=settings.ttl_s,
            deadline_s=DEADLINE_TIMEOUTS * settings.socket_timeout_s,
            breaker=CircuitBreaker(settings.error_threshold, settings.cooldown_s),
            cluster=cluster,
        )

    async def get_many(self, modality: str, inputs: list[str]) -> list[Row | None]:
        """One float32 [dim] row or None per input; Redis trouble gives all misses."""
        if not inputs:
            return []
        keys = [self._prefix + digest for digest in await input_digests(modality, inputs)]
        values = await self._guarded(self._mget(keys), failure_event="error")
        if values is None:
            metrics.cache_event("miss", len(inputs))
            return [None] * len(inputs)
        rows = [decode_row(value, self._dtype, self._dim) for value in values]
        hits = sum(row is not None for row in rows)
        corrupt = sum(row is None and value is not None for row, value in zip(rows, values, strict=True))
        metrics.cache_event("hit", hits)
        metrics.cache_event("miss", len(rows) - hits)
        if corrupt:
            metrics.cache_event("corrupt", corrupt)
            log.warning("redis cache: %d unusable value(s) (wrong size, NaN/inf or zero) treated as misses", corrupt)
        return rows

    async def set_many(self, modality: str, inputs: list[str], rows: npt.NDArray[np.floating]) -> None:
        """Write rows [len(inputs), dim] with the TTL in one pipeline; Redis trouble drops the write."""
        check_rows(rows, len(inputs), self._dim)
        if not inputs:
            return
        keys = [self._prefix + digest for digest in await input_digests(modality, inputs)]
        wire = np.ascontiguousarray(rows, dtype=WIRE_DTYPES[self._dtype])
        await self._guarded(self._set(keys, [row.tobytes() for row in wire]), failure_event="write_error")

    def state(self) -> CacheState:
        """`cooling_down` while the breaker skips Redis, else `ok`."""
        return "cooling_down" if self._breaker.is_open else "ok"

    async def ping(self) -> bool:
        """True when Redis answers PING within the deadline; does not move the breaker."""
        try:
            async with asyncio.timeout(self._deadline_s):
                return bool(await self._client.ping())
        except Exception:  # fail-open: a health probe reports, it never raises
            return False

    async def aclose(self) -> None:
        """Close the connection pool."""
        try:
            await self._client.aclose()
        except Exception as exc:  # closing a broken connection must not fail shutdown
            log.debug("closing the redis client failed: %r", exc)

    async def _mget(self, keys: list[str]) -> list[bytes | None]:
        if self._cluster:
            assert isinstance(self._client, RedisCluster)
            raw = await self._client.mget_nonatomic(keys)
        else:
            raw = await self._client.mget(keys)
        if len(raw) != len(keys):
            raise RuntimeError(f"MGET returned {len(raw)} values for {len(keys)} keys")
        # The client never decodes responses, so anything but bytes is not one of our values: a miss.
        return [value if isinstance(value, bytes) else None for value in raw]

    async def _set(self, keys: list[str], payloads: list[bytes]) -> bool:
        async with self._client.pipeline(transaction=False) as pipe:
            for key, payload in zip(keys, payloads, strict=True):
                pipe.set(key, payload, ex=self._ttl_s)
            await pipe.execute()
        return True

    async def _guarded(self, call: Coroutine[Any, Any, T], failure_event: str) -> T | None:
        """Await `call` under the breaker and the deadline; None when skipped or failed."""
        if not self._breaker.allow():
            call.close()  # never awaited: close it so Python does not warn
            metrics.cache_event("skipped")
            return None
        try:
            async with asyncio.timeout(self._deadline_s):
                result: T = await call
        except Exception as exc:  # fail-open: every Redis failure is a miss or a dropped write
            metrics.cache_event(failure_event)
            self._note(opened=self._breaker.record_failure(), closed=False, exc=exc)
            return None
        except BaseException:
            self._breaker.abandon()  # the caller was cancelled; that says nothing about Redis
            raise
        self._note(opened=False, closed=self._breaker.record_success(), exc=None)
        return result

    def _note(self, *, opened: bool, closed: bool, exc: Exception | None) -> None:
        metrics.CACHE_BREAKER_OPEN.set(1 if self._breaker.is_open else 0)
        if opened:
            log.warning("redis cache unavailable (%r): skipping it, serving misses meanwhile", exc)
        elif closed:
            log.info("redis cache reachable again")
        elif exc is not None:
            log.debug("redis cache error: %r", exc)
