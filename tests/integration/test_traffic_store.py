"""The traffic stores (real Redis db 15, local shards), the sampler's drain thread, and `traffic export`."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from service import metrics
from service.compat.io import load_query_pairs
from service.encoders.identity import ModelIdentity, read_models_json
from service.traffic.base import PairBatch, models_key
from service.traffic.local import LocalPairStore
from service.traffic.redis_store import RedisPairStore
from service.traffic.sampler import TrafficSampler
from tests.support.cli import cli
from tests.support.servers import free_port

OLD = ModelIdentity("synthetic-old", "old-v1", None, 8)
NEW = ModelIdentity("synthetic-new", "new-v1", None, 12)
NEWER = ModelIdentity("synthetic-new", "new-v2", "f" * 64, 12)
REDIS_URL = os.environ.get("NOBACKFILL_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def batch(n: int, seed: int, new: ModelIdentity = NEW) -> PairBatch:
    """n random pairs of (OLD, new), float16."""
    rng = np.random.default_rng(seed)
    old_rows = rng.standard_normal((n, OLD.dim)).astype(np.float16)
    new_rows = rng.standard_normal((n, new.dim)).astype(np.float16)
    return PairBatch(models_key(OLD, new), old_rows, new_rows, ("text",) * n)


def traffic_count(event: str) -> float:
    """nobackfill_traffic_pairs_total{event} now."""
    return metrics.REGISTRY.get_sample_value("nobackfill_traffic_pairs_total", {"event": event}) or 0.0


@pytest.fixture
def redis_store() -> Iterator[RedisPairStore]:
    """A Redis store on the shared test Redis under a key of this test's own, deleted afterwards."""
    store = RedisPairStore(REDIS_URL, key=f"nobackfill-test-traffic-{uuid.uuid4().hex}", max_pairs=30, ttl_s=600)
    try:
        store.count()
    except redis.RedisError as exc:
        pytest.fail(f"no Redis at {REDIS_URL} ({exc!r}); `make test` starts one")
    yield store
    store.clear()
    store.close()


def test_local_store_keeps_the_newest_pairs_within_the_bound(tmp_path: Path) -> None:
    store = LocalPairStore(tmp_path, max_pairs=50, ttl_s=600)
    batches = [batch(20, seed) for seed in range(8)]
    for b in batches:
        store.append([b])
        assert store.count() <= 50
    assert store.count() == 40  # whole shards rotate out: 3 x 20 would be over 50
    newest = store.read(5).runs[0]
    np.testing.assert_array_equal(newest.old, batches[-1].old[::-1][:5])
    # One flush larger than the bound keeps its newest max_pairs rows.
    store.append([batch(70, 99)])
    assert store.count() == 50
    np.testing.assert_array_equal(store.read().runs[0].new, batch(70, 99).new[::-1][:50])


def test_local_store_drops_expired_shards(tmp_path: Path) -> None:
    store = LocalPairStore(tmp_path, max_pairs=100, ttl_s=3600)
    store.append([batch(5, 1)])
    store.append([batch(7, 2)])
    (first, *_) = sorted(tmp_path.glob("pairs-*.npz"))
    # Backdate one shard's creation time (the name carries it) past the TTL.
    stamp, rest = first.name.removeprefix("pairs-").split("-", 1)
    first.rename(tmp_path / f"pairs-{int(stamp) - 2 * 3600 * 10**9:020d}-{rest}")
    assert store.count() == 7
    assert len(list(tmp_path.glob("pairs-*.npz"))) == 1


@pytest.mark.redis
def test_redis_store_bound_ttl_and_round_trip(redis_store: RedisPairStore) -> None:
    for seed in range(5):
        redis_store.append([batch(20, seed)])
        assert redis_store.count() <= 30
    assert redis_store.count() == 30  # exact MAXLEN: the bound holds after every write
    ttl = redis.Redis.from_url(REDIS_URL).ttl(redis_store.key)
    assert 0 < ttl <= 600
    stored = redis_store.read()
    assert stored.total == 30 and len(stored.runs) == 1
    last = batch(20, 4)
    np.testing.assert_array_equal(stored.runs[0].old[:20], last.old[::-1])  # float16 bytes, exactly
    np.testing.assert_array_equal(stored.runs[0].new[:20], last.new[::-1])
    assert redis_store.read(7).total == 7


def test_export_round_trips_and_refuses_other_models(tmp_path: Path) -> None:
    store = LocalPairStore(tmp_path / "store", max_pairs=1000, ttl_s=600)
    before, first, second = batch(6, 1, NEWER), batch(10, 2), batch(4, 3)
    for b in (before, first, second):  # pairs of an earlier model pair, then today's
        store.append([b])
    env = {"NOBACKFILL_TRAFFIC__LOCAL_DIR": str(tmp_path / "store"), "NOBACKFILL_TRAFFIC__STORE": "local"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        done = cli("traffic", "export", "--out", tmp_path / "out")
        limited = cli("traffic", "export", "--out", tmp_path / "last3", "--limit", 3)
        again = cli("traffic", "export", "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    # `second`, the newest pair, is of (OLD, NEW): the 6 pairs of the earlier model pair are refused.
    assert "refused 6 stored pair(s) of models old-v1 -> new-v2" in done.stderr
    pairs = load_query_pairs(tmp_path / "out")
    np.testing.assert_array_equal(pairs.old, np.concatenate([first.old, second.old]).astype(np.float32))
    np.testing.assert_array_equal(pairs.new, np.concatenate([first.new, second.new]).astype(np.float32))
    assert read_models_json(tmp_path / "out") == (OLD, NEW)
    meta = json.loads((tmp_path / "out" / "models.json").read_text())
    assert meta["refused_pairs"] == {"old-v1 -> new-v2": 6} and meta["pairs"] == 14 and meta["source"] == "traffic"
    assert limited.returncode == 0 and len(load_query_pairs(tmp_path / "last3").old) == 3
    assert again.returncode == 2 and "--force" in again.stderr


def test_export_from_an_empty_or_unreachable_store_is_one_line(tmp_path: Path) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NOBACKFILL_TRAFFIC__LOCAL_DIR", str(tmp_path / "none"))
        mp.setenv("NOBACKFILL_TRAFFIC__STORE", "local")
        empty = cli("traffic", "export", "--out", tmp_path / "out")
        mp.setenv("NOBACKFILL_TRAFFIC__STORE", "redis")
        mp.setenv("NOBACKFILL_TRAFFIC__REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
        down = cli("traffic", "export", "--out", tmp_path / "out")
    assert empty.returncode == 2 and "holds no pairs" in empty.stderr
    assert down.returncode == 2 and "could not be read" in down.stderr
    assert not (tmp_path / "out").exists()


def test_sampler_stores_off_thread_and_fails_open(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    old = rng.standard_normal((16, OLD.dim)).astype(np.float32)
    new = rng.standard_normal((16, NEW.dim)).astype(np.float32)
    old[3] = 0.0  # no direction: never sampled
    eligible = np.ones(16, dtype=bool)
    eligible[5] = False  # e.g. the caller's own embeddings
    store = LocalPairStore(tmp_path, max_pairs=100, ttl_s=600)
    sampler = TrafficSampler(store, 1.0, OLD, NEW, flush_s=30.0)
    stored_before = traffic_count("stored")
    assert sampler.offer(old, new, ["text"] * 16, eligible) == 14
    assert sampler.flush()
    assert store.count() == 14 and traffic_count("stored") - stored_before == 14
    sampler.close()

    # A store that cannot be reached: offer() still returns at once, the drain thread counts the failure.
    down = RedisPairStore(f"redis://127.0.0.1:{free_port()}/0", key="k", max_pairs=10, ttl_s=60, timeout_s=0.2)
    failing = TrafficSampler(down, 1.0, OLD, NEW, flush_s=30.0)
    failed_before = traffic_count("failed")
    assert failing.offer(old, new, ["text"] * 16) == 15
    assert failing.flush()
    assert traffic_count("failed") - failed_before == 15
    failing.close()
