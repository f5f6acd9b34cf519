"""The in-process caches, the factory, the row codec and the circuit breaker (no Redis needed)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from service import metrics
from service.cache import EmbeddingCache, cache_key, create_cache
from service.cache.base import WIRE_DTYPES, decode_row, input_digest
from service.cache.breaker import CircuitBreaker
from service.cache.memory import LruCache, NullCache
from service.settings import CacheSettings

DIM = 16


def unit_rows(n: int, dim: int = DIM, seed: int = 0) -> np.ndarray:
    """n random unit rows, float32."""
    rows = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


# ---- factory --------------------------------------------------------------------------------------


def test_factory_picks_the_backend() -> None:
    memory = create_cache(CacheSettings(lru_size=10), "m", DIM)
    off = create_cache(CacheSettings(lru_size=0), "m", DIM)
    redis = create_cache(CacheSettings(redis_url="redis://127.0.0.1:1/0"), "m", DIM)  # connects lazily
    assert (memory.kind, memory.state()) == ("memory", "memory")
    assert (off.kind, off.state()) == ("off", "off")
    assert (redis.kind, redis.state()) == ("redis", "ok")
    for cache in (memory, off, redis):
        assert isinstance(cache, EmbeddingCache)
    asyncio.run(redis.aclose())


# ---- LRU ------------------------------------------------------------------------------------------


async def test_lru_round_trip_float32_is_exact_float16_is_close() -> None:
    rows = unit_rows(5)
    inputs = [f"q{i}" for i in range(5)]
    for dtype, tolerance in (("float32", 0.0), ("float16", 1e-3)):
        cache = LruCache(10, DIM, dtype)  # type: ignore[arg-type]
        await cache.set_many("text", inputs, rows)
        got = await cache.get_many("text", inputs)
        back = np.stack([row for row in got if row is not None])
        assert back.dtype == np.float32 and back.shape == rows.shape
        assert np.max(np.abs(back - rows)) <= tolerance


async def test_lru_evicts_least_recently_used() -> None:
    cache = LruCache(3, DIM)
    rows = unit_rows(4)
    await cache.set_many("text", ["a", "b", "c"], rows[:3])
    await cache.get_many("text", ["a"])  # a is now the most recently used; b the least
    await cache.set_many("text", ["d"], rows[3:])
    got = await cache.get_many("text", ["a", "b", "c", "d"])
    assert [row is None for row in got] == [False, True, False, False]
    assert len(cache) == 3


async def test_lru_keys_by_modality() -> None:
    cache = LruCache(10, DIM)
    await cache.set_many("text", ["a"], unit_rows(1))
    assert await cache.get_many("image", ["a"]) == [None]


async def test_lru_returns_and_keeps_copies() -> None:
    cache = LruCache(10, DIM, "float32")
    rows = unit_rows(1)
    original = rows.copy()
    await cache.set_many("text", ["a"], rows)
    rows[:] = 0  # the caller reuses its buffer
    first = (await cache.get_many("text", ["a"]))[0]
    assert first is not None
    first[:] = 7  # the caller scribbles on what it got
    second = (await cache.get_many("text", ["a"]))[0]
    assert second is not None
    np.testing.assert_array_equal(second, original[0])


async def test_lru_counts_hits_and_misses() -> None:
    def count(event: str) -> float:
        return metrics.REGISTRY.get_sample_value("nobackfill_cache_events_total", {"event": event}) or 0.0

    hits, misses = count("hit"), count("miss")
    cache = LruCache(10, DIM)
    await cache.set_many("text", ["a"], unit_rows(1))
    await cache.get_many("text", ["a", "b", "c"])
    assert (count("hit") - hits, count("miss") - misses) == (1, 2)


async def test_lru_rejects_wrong_shapes() -> None:
    cache = LruCache(10, DIM)
    with pytest.raises(ValueError, match="shape"):
        await cache.set_many("text", ["a"], unit_rows(2))


def test_lru_is_thread_safe() -> None:
    cache = LruCache(50, DIM)
    rows = unit_rows(200)
    errors: list[BaseException] = []

    def hammer(offset: int) -> None:
        try:
            for i in range(200):
                j = (i + offset) % 200
                asyncio.run(cache.set_many("text", [f"k{j}"], rows[j : j + 1]))
                got = asyncio.run(cache.get_many("text", [f"k{j}", f"k{(j + 7) % 200}"]))
                if got[0] is not None:
                    np.testing.assert_allclose(got[0], rows[j], atol=1e-3)
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(k * 37,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(cache) == 50


async def test_null_cache_is_off() -> None:
    cache = NullCache(DIM)
    await cache.set_many("text", ["a"], unit_rows(1))
    assert await cache.get_many("text", ["a", "b"]) == [None, None]
    assert await cache.ping()
    with pytest.raises(ValueError, match="shape"):
        await cache.set_many("text", ["a"], unit_rows(1, dim=DIM + 1))
    await cache.aclose()


# ---- keys and codec -------------------------------------------------------------------------------


def test_key_is_namespace_model_and_sha256_of_modality_nul_input() -> None:
    import hashlib

    expected = hashlib.sha256("text\0hello wörld".encode()).hexdigest()
    assert cache_key("ns", "old-v1", "text", "hello wörld") == f"ns:old-v1:{expected}"
    assert input_digest("text", "ab") != input_digest("texta", "b")  # the NUL separates the parts
    input_digest("text", "\ud800")  # a lone surrogate hashes instead of raising


def wire(row: np.ndarray, dtype: str) -> bytes:
    """A row as the bytes the Redis backend writes."""
    return np.ascontiguousarray(row, dtype=WIRE_DTYPES[dtype]).tobytes()


@settings(max_examples=50, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 64), elements=st.floats(0.0625, 1, width=32)))
def test_codec_round_trip(row: np.ndarray) -> None:
    dim = row.shape[0]
    np.testing.assert_array_equal(decode_row(wire(row, "float32"), "float32", dim), row)
    half = decode_row(wire(row, "float16"), "float16", dim)
    assert half is not None and half.dtype == np.float32
    np.testing.assert_allclose(half, row, atol=5e-4)
    assert decode_row(wire(row, "float16"), "float32", dim) is None  # wrong size -> miss
    assert decode_row(wire(row, "float32"), "float16", dim) is None
    assert decode_row(None, "float16", dim) is None


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_value_without_a_direction_is_a_miss(dtype: str) -> None:
    row = np.full(8, 0.25, np.float32)
    for bad in (np.zeros(8, np.float32), np.where(np.arange(8) == 3, np.nan, row), np.full(8, np.inf, np.float32)):
        assert decode_row(wire(bad, dtype), dtype, 8) is None  # type: ignore[arg-type]
    assert decode_row(wire(row, dtype), dtype, 8) is not None  # type: ignore[arg-type]


# ---- breaker --------------------------------------------------------------------------------------


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_threshold_and_lets_one_trial_through() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(threshold=3, cooldown_s=10, clock=clock)
    assert breaker.allow()
    assert not breaker.record_failure() and not breaker.record_failure()
    breaker.record_success()  # not consecutive any more
    assert [breaker.record_failure() for _ in range(3)] == [False, False, True]
    assert breaker.is_open and not breaker.allow()
    clock.now = 9.9
    assert not breaker.allow()
    clock.now = 10.0
    assert breaker.allow()  # the trial
    assert not breaker.allow()  # only one at a time
    assert not breaker.record_failure()  # failed trial: open again, for another cool-down
    assert not breaker.allow()
    clock.now = 20.0
    assert breaker.allow()
    assert breaker.record_success()
    assert not breaker.is_open and breaker.allow() and breaker.allow()


def test_breaker_abandoned_trial_frees_the_slot() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(threshold=1, cooldown_s=1, clock=clock)
    breaker.record_failure()
    clock.now = 1.0
    assert breaker.allow()
    breaker.abandon()
    assert breaker.allow() and breaker.is_open
