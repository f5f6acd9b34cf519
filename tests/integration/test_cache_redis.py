"""The Redis cache against real redis-servers: round trips, keys, TTL, and fail-open through outages.

The shared Redis (NOBACKFILL_TEST_REDIS_URL, default db 15) serves the ordinary tests, each under its
own namespace. Outage tests start a private redis-server on a free port so they may kill, pause
(SIGSTOP) and restart it without disturbing anyone else.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
import redis.asyncio

from service import metrics
from service.cache import cache_key, create_cache
from service.cache.redis_cache import RedisCache, split_cluster_url
from service.settings import CacheSettings
from tests.support.servers import REDIS_SERVER, PrivateRedis, free_cluster_port, free_port

pytestmark = pytest.mark.redis

DIM = 64
MODEL = "old-model-v1"


def unit_rows(n: int, dim: int = DIM, seed: int = 0) -> np.ndarray:
    """n random unit rows, float32."""
    rows = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def event_count(event: str) -> float:
    """Current value of nobackfill_cache_events_total{event}."""
    value = metrics.REGISTRY.get_sample_value("nobackfill_cache_events_total", {"event": event})
    return value or 0.0


class Events:
    """Cache-event counts since construction."""

    def __init__(self) -> None:
        self._start = {event: event_count(event) for event in metrics.CACHE_EVENTS}

    def __getitem__(self, event: str) -> float:
        return event_count(event) - self._start[event]


@pytest.fixture
def shared_url() -> str:
    """The shared test Redis; a missing one fails the test (`make test` starts one)."""
    url = os.environ.get("NOBACKFILL_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"no Redis at {url} ({exc!r}); `make test` starts one")
    finally:
        client.close()
    return url


@pytest.fixture
async def namespace(shared_url: str) -> AsyncIterator[str]:
    """A namespace of this test's own; its keys are deleted afterwards."""
    ns = f"nobackfill-test-{uuid.uuid4().hex}"
    yield ns
    client = redis.asyncio.Redis.from_url(shared_url)
    try:
        keys = [key async for key in client.scan_iter(match=f"{ns}:*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


def settings_for(url: str, namespace: str, **overrides: object) -> CacheSettings:
    """Cache settings pointing at `url`, with test-friendly timeouts."""
    values: dict[str, object] = {"redis_url": url, "namespace": namespace, "socket_timeout_s": 0.25}
    values.update(overrides)
    return CacheSettings.model_validate(values)


async def wait_until_ok(cache: RedisCache, rows: np.ndarray, timeout_s: float = 10.0) -> None:
    """Keep using the cache until its breaker closes again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await cache.set_many("text", ["probe"], rows[:1])
        if cache.state() == "ok":
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"cache still {cache.state()} after {timeout_s} s")


# ---- the shared Redis -----------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 0.0), ("float16", 1e-3)])
async def test_round_trip_accuracy(shared_url: str, namespace: str, dtype: str, tolerance: float) -> None:
    cache = create_cache(settings_for(shared_url, namespace, dtype=dtype), MODEL, DIM)
    assert cache.kind == "redis" and cache.state() == "ok"
    rows = unit_rows(20)
    inputs = [f"item-{i} caption-0" for i in range(20)]
    events = Events()
    try:
        await cache.set_many("text", inputs, rows)
        got = await cache.get_many("text", inputs)
    finally:
        await cache.aclose()
    assert all(row is not None and row.dtype == np.float32 and row.shape == (DIM,) for row in got)
    back = np.stack([row for row in got if row is not None])
    assert np.max(np.abs(back - rows)) <= tolerance
    cosine = np.sum(back * rows, axis=1) / np.linalg.norm(back, axis=1)
    assert np.all(cosine > 0.99999)
    assert events["hit"] == 20 and events["miss"] == 0


async def test_float16_values_are_half_the_size(shared_url: str, namespace: str) -> None:
    sizes = {}
    for dtype in ("float16", "float32"):
        ns = f"{namespace}-{dtype}"
        cache = create_cache(settings_for(shared_url, ns, dtype=dtype), MODEL, DIM)
        await cache.set_many("text", ["x"], unit_rows(1))
        await cache.aclose()
        client = redis.asyncio.Redis.from_url(shared_url)
        key = cache_key(ns, MODEL, "text", "x")
        sizes[dtype] = await client.strlen(key)
        await client.delete(key)
        await client.aclose()
    assert sizes == {"float16": DIM * 2, "float32": DIM * 4}


async def test_key_layout_and_ttl(shared_url: str, namespace: str) -> None:
    cache = create_cache(settings_for(shared_url, namespace, ttl_s=120), MODEL, DIM)
    await cache.set_many("image", ["a.jpg"], unit_rows(1))
    await cache.aclose()
    import hashlib

    key = f"{namespace}:{MODEL}:{hashlib.sha256(b'image' + bytes([0]) + b'a.jpg').hexdigest()}"
    assert key == cache_key(namespace, MODEL, "image", "a.jpg")
    client = redis.asyncio.Redis.from_url(shared_url)
    try:
        ttl = await client.ttl(key)
    finally:
        await client.aclose()
    assert 0 < ttl <= 120


async def test_misses_duplicates_modalities_and_models_are_separate(shared_url: str, namespace: str) -> None:
    cache = create_cache(settings_for(shared_url, namespace), MODEL, DIM)
    other_model = create_cache(settings_for(shared_url, namespace), "old-model-v2", DIM)
    rows = unit_rows(2)
    try:
        await cache.set_many("text", ["a", "b"], rows)
        got = await cache.get_many("text", ["a", "zzz", "a", "b"])
        assert [row is None for row in got] == [False, True, False, False]
        assert (await cache.get_many("image", ["a"])) == [None]  # same input, other modality
        assert (await other_model.get_many("text", ["a"])) == [None]  # same input, other old model
        assert (await cache.get_many("text", [])) == []
    finally:
        await cache.aclose()
        await other_model.aclose()


async def test_wrong_size_values_are_misses(shared_url: str, namespace: str) -> None:
    cache = create_cache(settings_for(shared_url, namespace), MODEL, DIM)
    client = redis.asyncio.Redis.from_url(shared_url)
    events = Events()
    try:
        await client.set(cache_key(namespace, MODEL, "text", "short"), b"\x00" * (DIM * 2 - 1))
        await client.set(cache_key(namespace, MODEL, "text", "f32"), unit_rows(1).tobytes())  # 4 bytes each
        await client.set(cache_key(namespace, MODEL, "text", "empty"), b"")
        await cache.set_many("text", ["good"], unit_rows(1))
        got = await cache.get_many("text", ["short", "f32", "empty", "good"])
    finally:
        await client.aclose()
        await cache.aclose()
    assert [row is None for row in got] == [True, True, True, False]
    assert events["miss"] == 3 and events["hit"] == 1 and events["error"] == 0
    assert cache.state() == "ok"


async def test_wrong_row_shape_is_a_caller_error(shared_url: str, namespace: str) -> None:
    cache = create_cache(settings_for(shared_url, namespace), MODEL, DIM)
    try:
        with pytest.raises(ValueError, match="shape"):
            await cache.set_many("text", ["a", "b"], unit_rows(3))
        with pytest.raises(ValueError, match="shape"):
            await cache.set_many("text", ["a"], unit_rows(1, dim=DIM + 1))
    finally:
        await cache.aclose()


async def test_large_inputs_are_hashed_off_loop_with_the_same_keys(shared_url: str, namespace: str) -> None:
    cache = create_cache(settings_for(shared_url, namespace), MODEL, DIM)
    big = ["x" * 700_000, "y" * 700_000]  # over OFFLOAD_CHARS together
    try:
        await cache.set_many("image", big, unit_rows(2))
        got = await cache.get_many("image", [big[1]])
        client = redis.asyncio.Redis.from_url(shared_url)
        exists = await client.exists(cache_key(namespace, MODEL, "image", big[0]))
        await client.aclose()
    finally:
        await cache.aclose()
    assert got[0] is not None and exists == 1


async def test_ping(shared_url: str, namespace: str) -> None:
    cache = create_cache(settings_for(shared_url, namespace), MODEL, DIM)
    assert await cache.ping()
    await cache.aclose()


# ---- outages --------------------------------------------------------------------------------------


async def test_nothing_listening_is_fail_open() -> None:
    settings = settings_for(f"redis://127.0.0.1:{free_port()}/0", "ns", error_threshold=2, cooldown_s=60)
    cache = create_cache(settings, MODEL, DIM)
    events = Events()
    try:
        assert await cache.get_many("text", ["a", "b"]) == [None, None]
        await cache.set_many("text", ["a"], unit_rows(1))
        assert cache.state() == "cooling_down"  # two consecutive errors opened the breaker
        assert await cache.get_many("text", ["a"]) == [None]
        await cache.set_many("text", ["a"], unit_rows(1))
        assert not await cache.ping()
    finally:
        await cache.aclose()
    assert events["error"] == 1 and events["write_error"] == 1
    assert events["skipped"] == 2 and events["miss"] == 3
    assert metrics.REGISTRY.get_sample_value("nobackfill_cache_breaker_open") == 1.0


async def test_server_killed_mid_test_then_back(private_redis: PrivateRedis) -> None:
    settings = settings_for(private_redis.url, "ns", error_threshold=2, cooldown_s=0.3)
    cache = create_cache(settings, MODEL, DIM)
    assert isinstance(cache, RedisCache)
    rows = unit_rows(3)
    inputs = ["a", "b", "c"]
    try:
        await cache.set_many("text", inputs, rows)
        assert all(row is not None for row in await cache.get_many("text", inputs))

        private_redis.stop()
        events = Events()
        assert await cache.get_many("text", inputs) == [None] * 3
        assert cache.state() == "ok"  # one error is not an outage yet
        await cache.set_many("text", inputs, rows)
        assert cache.state() == "cooling_down"
        for _ in range(5):  # skipped without touching the network
            assert await cache.get_many("text", inputs) == [None] * 3
        assert events["error"] == 1 and events["write_error"] == 1 and events["skipped"] == 5
        assert not await cache.ping()

        private_redis.start()  # same port, empty (nothing persisted)
        await wait_until_ok(cache, rows)
        assert await cache.get_many("text", inputs) == [None] * 3
        await cache.set_many("text", inputs, rows)
        assert all(row is not None for row in await cache.get_many("text", inputs))
        assert metrics.REGISTRY.get_sample_value("nobackfill_cache_breaker_open") == 0.0
    finally:
        await cache.aclose()


async def test_failed_trial_reopens_the_breaker(private_redis: PrivateRedis) -> None:
    cache = create_cache(settings_for(private_redis.url, "ns", error_threshold=1, cooldown_s=0.2), MODEL, DIM)
    try:
        private_redis.stop()
        await cache.get_many("text", ["a"])
        assert cache.state() == "cooling_down"
        await asyncio.sleep(0.25)
        events = Events()
        # After the cool-down exactly one call tries Redis; it fails, so the next one is skipped again.
        await cache.get_many("text", ["a"])
        await cache.get_many("text", ["a"])
        assert events["error"] == 1 and events["skipped"] == 1
        assert cache.state() == "cooling_down"
    finally:
        await cache.aclose()


async def test_hung_server_costs_a_bounded_wait(private_redis: PrivateRedis) -> None:
    settings = settings_for(private_redis.url, "ns", socket_timeout_s=0.05, error_threshold=3)
    cache = create_cache(settings, MODEL, DIM)
    try:
        await cache.set_many("text", ["a"], unit_rows(1))
        private_redis.pause()
        events = Events()
        start = time.monotonic()
        got = await asyncio.gather(*(cache.get_many("text", ["a"]) for _ in range(8)))
        elapsed = time.monotonic() - start
        private_redis.resume()
    finally:
        await cache.aclose()
    assert got == [[None]] * 8
    assert events["error"] == 8
    # Deadline is 4 socket timeouts (0.2 s); 2 s leaves room for a loaded machine, not for a hang.
    assert elapsed < 2.0, elapsed


# ---- Redis Cluster ---------------------------------------------------------------------------------


def test_cluster_url_scheme() -> None:
    assert split_cluster_url("redis+cluster://h:7000/0") == ("redis://h:7000/0", True)
    assert split_cluster_url("rediss+cluster://u:p@h:7000") == ("rediss://u:p@h:7000", True)
    assert split_cluster_url("redis://h:6379/15") == ("redis://h:6379/15", False)
    assert split_cluster_url("unix:///tmp/r.sock") == ("unix:///tmp/r.sock", False)


@pytest.fixture
def one_node_cluster(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A single-node Redis Cluster owning all 16384 slots (keys still land in different slots)."""
    if REDIS_SERVER is None:
        pytest.fail("redis-server is not installed; apt-get install redis-server")
    server = PrivateRedis(tmp_path, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
    server.port = free_cluster_port()
    server.start()
    client = redis.Redis(port=server.port, socket_timeout=1)
    try:
        client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        deadline = time.monotonic() + 10
        while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
            if time.monotonic() > deadline:
                raise TimeoutError("cluster did not become ok")
            time.sleep(0.05)
    finally:
        client.close()
    yield server
    server.stop()


async def test_cluster_round_trip_across_slots(one_node_cluster: PrivateRedis) -> None:
    url = f"redis+cluster://127.0.0.1:{one_node_cluster.port}"
    cache = create_cache(settings_for(url, "ns"), MODEL, DIM)
    inputs = [f"item-{i}" for i in range(50)]  # 50 keys: certainly more than one slot
    rows = unit_rows(50)
    events = Events()
    try:
        await cache.set_many("text", inputs, rows)
        got = await cache.get_many("text", [*inputs, "missing"])
        assert await cache.ping()
    finally:
        await cache.aclose()
    assert events["error"] == 0 and events["write_error"] == 0
    assert all(row is not None for row in got[:50]) and got[50] is None
    assert np.max(np.abs(np.stack(got[:50]) - rows)) < 1e-3  # type: ignore[arg-type]
