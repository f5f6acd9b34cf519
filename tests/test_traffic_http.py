"""Traffic sampling through the HTTP stack: off by default, on into the local shards and into real Redis."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from conftest import World, start_app

from service import metrics
from service.encoders.identity import ModelIdentity
from service.settings import CompatSettings, IndexSettings, Settings, TrafficSettings
from service.traffic.base import parse_models_key
from service.traffic.sampler import create_store

QUERIES = [{"text": f"item-{i:010d} caption-1"} for i in range(6)]
REDIS_URL = os.environ.get("NOBACKFILL_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def settings_for(world: World, traffic: TrafficSettings) -> Settings:
    """The session's synthetic world with these traffic settings."""
    return Settings(
        index=IndexSettings(gallery_dir=world.gallery_dir, nprobe=8),
        compat=CompatSettings(profile_dir=world.profile_dir),
        traffic=traffic,
    )


def sampled() -> float:
    """nobackfill_traffic_pairs_total{event="sampled"} now."""
    return metrics.REGISTRY.get_sample_value("nobackfill_traffic_pairs_total", {"event": "sampled"}) or 0.0


async def search_and_flush(settings: Settings, **body: Any) -> int:
    """Run the app, send the queries in each of the body's modes, flush the sampler; how many pairs it sampled."""
    before = sampled()
    async for running in start_app(settings):
        for mode in ("slerp", "old", "aligned"):  # only slerp reads both embeddings
            response = await running.search(queries=QUERIES, k=5, mode=mode, **body)
            assert response.status_code == 200, response.text
        given = {"old_embedding": [1.0] + [0.0] * 511, "new_embedding": [1.0] + [0.0] * 767}
        response = await running.search(queries=[given], k=5, mode="slerp")  # a caller's own: never sampled
        assert response.status_code == 200, response.text
        traffic = running.pipeline.traffic
        if traffic is not None:
            assert traffic.flush()
    return int(sampled() - before)


async def test_sampling_is_off_by_default(world: World, tmp_path: Path) -> None:
    settings = settings_for(world, TrafficSettings(local_dir=tmp_path / "traffic"))
    assert await search_and_flush(settings) == 0
    assert not (tmp_path / "traffic").exists()


async def test_sampling_on_into_local_shards(world: World, tmp_path: Path) -> None:
    settings = settings_for(world, TrafficSettings(sample_rate=1.0, store="local", local_dir=tmp_path, max_pairs=4))
    assert await search_and_flush(settings) == len(QUERIES)
    store = create_store(settings)
    assert store.count() == 4  # six sampled, the bound keeps four
    (run,) = store.read().runs
    old, new = parse_models_key(run.models)
    assert (old.model_id, old.dim, new.model_id, new.dim) == ("synthetic-old", 512, "synthetic-new", 768)
    assert run.old.dtype == np.float16 and np.allclose(np.linalg.norm(run.old.astype(np.float32), axis=1), 1, atol=1e-2)
    # What is stored is the embeddings and model identities only: no input text anywhere in the shards.
    assert all(b"caption" not in p.read_bytes() for p in tmp_path.glob("*.npz"))


@pytest.mark.redis
async def test_sampling_on_into_redis(world: World) -> None:
    key = f"nobackfill-test-traffic-{uuid.uuid4().hex}"
    traffic = TrafficSettings(sample_rate=1.0, store="redis", redis_url=REDIS_URL, stream_key=key, ttl_s=120)
    settings = settings_for(world, traffic)
    try:
        assert await search_and_flush(settings) == len(QUERIES)
        client = redis.Redis.from_url(REDIS_URL)
        assert client.xlen(key) == len(QUERIES) and 0 < client.ttl(key) <= 120
        fields = client.xrange(key, count=1)[0][1]
        assert set(fields) == {b"o", b"n", b"q", b"m"} and len(fields[b"o"]) == 512 * 2  # float16 rows
        assert ModelIdentity.from_dict(parse_models_key(fields[b"m"].decode())[1].as_dict(), "x").dim == 768
    finally:
        redis.Redis.from_url(REDIS_URL).delete(key)
