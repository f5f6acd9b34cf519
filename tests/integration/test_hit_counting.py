"""The service counts the gallery ids it returns (for `backfill run --order hot`): a local folder, Redis, fail-open."""

from __future__ import annotations

import os
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis

from service import metrics
from service.settings import CompatSettings, IndexSettings, Settings, TrafficSettings
from service.traffic.hits import read_hits
from tests.support.app import Running, serving
from tests.support.world import World

QUERIES = [{"text": f"item-{i:010d} caption-1"} for i in (5, 50, 500, 5_000)]


def traffic_settings(world: World, **traffic: Any) -> Settings:
    """The session's world with these traffic settings."""
    return Settings(
        index=IndexSettings(gallery_dir=world.gallery_dir),
        compat=CompatSettings(profile_dir=world.profile_dir),
        traffic=TrafficSettings(**traffic),
    )


async def returned_ids(service: Running, rounds: int) -> Counter[int]:
    """Search the queries `rounds` times; how often each id came back."""
    seen: Counter[int] = Counter()
    for _ in range(rounds):
        response = await service.search(queries=QUERIES, k=5, mode="slerp")
        assert response.status_code == 200, response.text
        for result in response.json()["results"]:
            seen.update(result["ids"])
    return seen


async def test_returned_ids_are_counted_in_the_local_folder(world: World, tmp_path: Path) -> None:
    async with serving(traffic_settings(world, hit_rate=1.0, hits_dir=tmp_path / "hits")) as service:
        seen = await returned_ids(service, rounds=3)
    ids, counts = read_hits(str(tmp_path / "hits"))
    assert dict(zip(ids.tolist(), counts.tolist(), strict=True)) == {i: float(c) for i, c in seen.items()}


async def test_returned_ids_are_counted_in_redis(world: World) -> None:
    url = os.environ.get("NOBACKFILL_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    key = f"nobackfill:test-hits:{uuid.uuid4().hex}"
    async with serving(traffic_settings(world, hit_rate=1.0, redis_url=url, hits_key=key)) as service:
        seen = await returned_ids(service, rounds=2)
    ids, counts = read_hits(url, key)
    redis.Redis.from_url(url).delete(key)
    assert dict(zip(ids.tolist(), counts.tolist(), strict=True)) == {i: float(c) for i, c in seen.items()}


async def test_with_redis_down_searches_go_on_and_the_counts_are_dropped(world: World) -> None:
    failed = metrics.HITS.labels(event="failed")
    before = failed._value.get()
    async with serving(traffic_settings(world, hit_rate=1.0, redis_url="redis://127.0.0.1:1/0")) as service:
        seen = await returned_ids(service, rounds=2)
    assert sum(seen.values()) == 2 * len(QUERIES) * 5
    assert failed._value.get() - before == pytest.approx(sum(seen.values()))
