"""Hit counting in Redis: bounded, decaying counts on the shared test Redis, and fail-open when Redis is down.

The local files and the sampler: tests/unit/test_hits.py.
"""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from service import metrics
from service.errors import InputError
from service.traffic.hits import HitCounter, RedisHitStore, read_hits
from tests.support.servers import free_port

REDIS_URL = os.environ.get("NOBACKFILL_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def _hits(event: str) -> float:
    return metrics.REGISTRY.get_sample_value("nobackfill_hits_total", {"event": event}) or 0.0


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
    return free_port()
