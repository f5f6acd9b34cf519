"""Hit counting: bounded, decaying counts in Redis or local files, sampled off the request path, fail-open."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np
import pytest

from service import metrics
from service.backfill.hits import HitCounter, LocalHitStore, RedisHitStore, read_hits, read_local_hits
from service.errors import InputError

REDIS_URL = os.environ.get("NOBACKFILL_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def _hits(event: str) -> float:
    return metrics.REGISTRY.get_sample_value("nobackfill_hits_total", {"event": event}) or 0.0


def test_local_counts_add_up_decay_and_stay_bounded(tmp_path: Path) -> None:
    store = LocalHitStore(tmp_path, capacity=3)
    store.add({1: 5.0, 2: 1.0, 3: 2.0})
    store.add({2: 4.0, 4: 0.5})  # 4 is the lowest: capped away
    ids, counts = store.read()
    assert ids.tolist() == [1, 2, 3] and counts.tolist() == [5.0, 5.0, 2.0]  # a tie goes to the smaller id
    store.age(0.5)
    ids, counts = read_local_hits(tmp_path)
    assert ids.tolist() == [1, 2, 3] and counts.tolist() == [2.5, 2.5, 1.0]
    store.age(0.4)  # 3 falls below one half
    assert read_local_hits(tmp_path)[0].tolist() == [1, 2]


def test_readers_sum_every_process_file(tmp_path: Path) -> None:
    LocalHitStore(tmp_path, capacity=10).add({7: 1.0})
    other = LocalHitStore(tmp_path, capacity=10)
    other.path = tmp_path / "hits-otherhost-1.npz"  # another worker's file
    other.add({7: 2.0, 8: 1.0})
    ids, counts = read_hits(str(tmp_path))
    assert dict(zip(ids.tolist(), counts.tolist(), strict=True)) == {7: 3.0, 8: 1.0}


def test_redis_counts_add_up_decay_and_stay_bounded() -> None:
    key = f"nobackfill:test:hits:{uuid.uuid4().hex}"
    store = RedisHitStore(REDIS_URL, key, capacity=2)
    try:
        store.add({10: 1.0, 11: 3.0})
        store.add({10: 1.0, 12: 0.5})
        ids, counts = store.read()
        assert ids.tolist() == [11, 10] and counts.tolist() == [3.0, 2.0]
        store.age(0.25)  # 0.75 and 0.5: both stay (what falls below one half goes)
        assert read_hits(REDIS_URL, key=key)[0].tolist() == [11, 10]
        store.age(0.8)  # 0.6 and 0.4
        assert read_hits(REDIS_URL, key=key)[0].tolist() == [11]
    finally:
        store._client.delete(key)
        store.close()


def test_the_counter_samples_flushes_on_close_and_skips_padding(tmp_path: Path) -> None:
    counter = HitCounter(LocalHitStore(tmp_path, capacity=100), rate=1.0, flush_s=60.0)
    before = _hits("counted")
    counter.offer(np.array([[1, 2, -1], [2, 3, -1]]))
    counter.close()
    ids, counts = read_local_hits(tmp_path)
    assert dict(zip(ids.tolist(), counts.tolist(), strict=True)) == {1: 1.0, 2: 2.0, 3: 1.0}
    assert _hits("counted") - before == 4


def test_a_dead_redis_fails_open(free_port_value: int) -> None:
    before = _hits("failed")
    store = RedisHitStore(f"redis://127.0.0.1:{free_port_value}/0", "k", capacity=10, timeout_s=0.2)
    counter = HitCounter(store, rate=1.0, flush_s=60.0)
    counter.offer(np.array([[5, 6]]))  # never raises on the request path
    counter.close()
    assert _hits("failed") - before == 2
    with pytest.raises(InputError, match="hit counts at redis://127.0.0.1"):
        read_hits(f"redis://127.0.0.1:{free_port_value}/0")


@pytest.fixture
def free_port_value() -> int:
    from conftest import free_port

    return free_port()
