"""What encoders and the cache return is checked before use: bad rows fail only their callers, zero
rows fall back to the other endpoint, corrupt cache values are misses that get rewritten, and
readiness / liveness say when a batcher cannot serve."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis

from service import metrics
from service.cache.base import WIRE_DTYPES, cache_key, decode_row
from service.encoders import batcher as batcher_module
from service.encoders.batcher import MicroBatcher
from service.encoders.registry import create_encoder
from service.errors import EncoderFailed, EncoderTimeout
from service.pipeline import cache_model_key
from service.settings import CacheSettings, CompatSettings, EncoderSettings, IndexSettings, Settings
from tests.support.app import Running, encoder_threads_left, serving
from tests.support.faulty_encoder import FaultyEncoder, install
from tests.support.world import World

CAPTION = "item-{:010d} caption-1"
install()


@pytest.fixture
def redis_url() -> str:
    """The shared test Redis (`make test` starts one when none answers)."""
    return os.environ.get("NOBACKFILL_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def sample(name: str, **labels: str) -> float:
    """Current value of a counter sample (0 when never incremented)."""
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def faulty(role: str) -> FaultyEncoder:
    encoder = create_encoder(EncoderSettings(backend=f"faulty-{role}"), role)  # type: ignore[arg-type]
    assert isinstance(encoder, FaultyEncoder)
    return encoder


# ---- the batcher ----------------------------------------------------------------------------------


async def test_nan_rows_fail_only_the_calls_they_belong_to() -> None:
    batcher = MicroBatcher(faulty("new"), max_batch_size=32, max_wait_ms=20, name="new")
    await batcher.start()
    before = sample("nobackfill_encoder_failures_total", encoder="new", reason="bad_rows")
    try:
        texts = [CAPTION.format(1), CAPTION.format(2) + " !nan", CAPTION.format(3)]
        results = await asyncio.gather(*(batcher.encode([t]) for t in texts), return_exceptions=True)
        assert isinstance(results[1], EncoderFailed) and results[1].code == "encoder_failed"
        for good in (results[0], results[2]):
            assert isinstance(good, np.ndarray) and np.isfinite(good).all() and good.shape == (1, 768)
        assert (await batcher.encode([CAPTION.format(4)])).shape == (1, 768)  # still serving
    finally:
        await batcher.stop()
    assert sample("nobackfill_encoder_failures_total", encoder="new", reason="bad_rows") == before + 1


class WrongWidth:
    """An encoder that says 8-d and returns 7-d rows."""

    dim, model_id, device = 8, "wrong-width", "cpu"

    def encode(self, batch: list[str], modality: str = "text") -> np.ndarray:  # noqa: ARG002
        return np.ones((len(batch), 7), np.float32)

    def warmup(self) -> None:
        pass


async def test_rows_of_the_wrong_width_fail_the_batch_not_the_batcher() -> None:
    batcher = MicroBatcher(WrongWidth(), max_batch_size=4, max_wait_ms=0, name="old")  # type: ignore[arg-type]
    await batcher.start()
    try:
        for _ in range(2):
            with pytest.raises(EncoderFailed, match=r"shape \(2, 7\) for a batch of 2 \(dim 8\)"):
                await batcher.encode(["a", "b"])
        assert batcher.problem() is None
    finally:
        await batcher.stop()


async def test_a_hung_call_times_out_and_its_replica_comes_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.support.faulty_encoder.HANG_S", 1.0)
    batcher = MicroBatcher(faulty("new"), max_batch_size=4, max_wait_ms=0, name="new", timeout_s=0.3)
    await batcher.start()
    try:
        with pytest.raises(EncoderTimeout):
            await batcher.encode([CAPTION.format(1) + " !hang"])
        assert "every replica is stuck" in (batcher.problem() or "")
        # Nothing can take a batch now: a call waits timeout_s for a replica, then fails the same way.
        with pytest.raises(EncoderTimeout, match="left a call queued"):
            await batcher.encode([CAPTION.format(2)])
        for _ in range(100):  # the hung call returns after 1 s; the replica is then back in rotation
            if batcher.problem() is None:
                break
            await asyncio.sleep(0.05)
        assert batcher.problem() is None
        assert (await batcher.encode([CAPTION.format(3)])).shape == (1, 768)
    finally:
        await batcher.stop()


async def test_a_crashing_collector_is_restarted_then_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    batcher = MicroBatcher(faulty("old"), max_batch_size=4, max_wait_ms=0, name="old")
    await batcher.start()
    original = batcher._next_batch
    crashes = {"left": 1}

    async def crashing() -> Any:
        if crashes["left"] > 0:
            crashes["left"] -= 1
            raise RuntimeError("a bug in the collector")
        return await original()

    monkeypatch.setattr(batcher, "_next_batch", crashing)
    before = sample("nobackfill_batcher_restarts_total", encoder="old")
    try:
        with pytest.raises(EncoderFailed, match="lost its batch queue"):
            await batcher.encode([CAPTION.format(1)])
        assert (await batcher.encode([CAPTION.format(2)])).shape == (1, 512)  # restarted, serving
        assert sample("nobackfill_batcher_restarts_total", encoder="old") == before + 1
        assert batcher.alive and batcher.problem() is None
        crashes["left"] = batcher_module.MAX_RESTARTS + 1
        for _ in range(batcher_module.MAX_RESTARTS + 1):
            with pytest.raises((EncoderFailed, Exception)):
                await batcher.encode([CAPTION.format(3)])
        assert not batcher.alive and batcher.problem() == "collector crashed too often"
    finally:
        await batcher.stop(drain=False)


# ---- through HTTP ------------------------------------------------------------------------------


def faulty_settings(world: World, **overrides: Any) -> Settings:
    return Settings(
        old=EncoderSettings(backend="faulty-old"),
        new=EncoderSettings(
            backend="faulty-new",
            timeout_s=overrides.pop("new_timeout_s", 30.0),
            stuck_threads=overrides.pop("new_stuck_threads", 2),
        ),
        index=IndexSettings(gallery_dir=world.gallery_dir, nprobe=8),
        compat=CompatSettings(profile_dir=world.profile_dir),
        **overrides,
    )


@pytest.fixture
async def service(world: World) -> AsyncIterator[Running]:
    async with serving(faulty_settings(world)) as running:
        yield running


@pytest.mark.parametrize("fault", ["nan", "raise"])
async def test_a_failing_input_is_encoder_failed_and_concurrent_requests_are_served(
    service: Running, fault: str
) -> None:
    texts = [CAPTION.format(5) + f" !{fault}-new", CAPTION.format(6), CAPTION.format(7)]
    bad, *good = await asyncio.gather(*(service.search(queries=[{"text": t}], mode="slerp") for t in texts))
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "encoder_failed", bad.text
    assert "injected" not in bad.text  # the model's own message stays in the server log
    for response in good:  # batch-mates of a raising input are retried alone and answered
        assert response.status_code == 200 and len(response.json()["results"][0]["ids"]) == 10
    assert (await service.client.get("/readyz")).status_code == 200


async def test_zero_rows_fall_back_to_the_other_endpoint_and_are_counted(service: Running) -> None:
    def counted(by: str) -> float:
        return sample("nobackfill_zero_embedding_fallbacks_total", answered_by=by)

    before = {by: counted(by) for by in ("old", "new", "none")}
    queries = [
        {"text": CAPTION.format(10)},
        {"text": CAPTION.format(11) + " !zero-new"},  # a static new model's out-of-vocabulary row
        {"text": CAPTION.format(12) + " !zero-old"},
        {"text": CAPTION.format(13) + " !zero"},
    ]
    response = await service.search(queries=queries, mode="slerp", k=5)
    assert response.status_code == 200, response.text
    normal, new_zero, old_zero, both = response.json()["results"]
    assert "fallback" not in normal and normal["mode"] == "slerp"
    assert (new_zero["fallback"], new_zero["mode"], new_zero["alpha"]) == ("old", "old", 0.0)
    assert (old_zero["fallback"], old_zero["mode"], old_zero["alpha"]) == ("new", "aligned", 1.0)
    assert (both["fallback"], both["ids"], both["scores"]) == ("none", [], [])
    for result in (new_zero, old_zero):
        assert len(result["ids"]) == 5 and all(np.isfinite(result["scores"]))
    # The fallback answers exactly as the mode it falls back to would.
    alone = await service.search(queries=[{"text": CAPTION.format(11)}], mode="old", k=5)
    assert alone.json()["results"][0]["ids"] == new_zero["ids"]
    assert {by: counted(by) - before[by] for by in before} == {"old": 1, "new": 1, "none": 1}
    compare = await service.search(queries=[{"text": CAPTION.format(12) + " !zero-old"}], mode="compare", k=5)
    assert compare.status_code == 200 and compare.json()["results"][0]["old_ids"] == []


async def test_a_hung_call_leaves_its_replica_serving_and_ready(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    # The default: the hung call keeps its thread, the replica serves on a fresh one (encoder.stuck_threads).
    monkeypatch.setattr("tests.support.faulty_encoder.HANG_S", 1.5)
    async with serving(faulty_settings(world, new_timeout_s=0.6)) as running:
        hung = asyncio.ensure_future(running.search(queries=[{"text": CAPTION.format(1) + " !hang-new"}], mode="slerp"))
        await asyncio.sleep(0.4)  # past the slow-call bound (0.25 s), within the hang
        clean = await running.search(queries=[{"text": CAPTION.format(2)}], mode="slerp")
        ready = await running.client.get("/readyz")
        still_hung = not hung.done()
        answer = await hung
    assert still_hung and clean.status_code == 200 and ready.status_code == 200, ready.text
    assert answer.status_code == 504 and answer.json()["error"]["code"] == "encoder_timeout", answer.text


async def test_readiness_is_503_while_every_replica_is_stuck(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    # With no thread to spare (stuck_threads 0) the one replica is set aside until its call returns.
    monkeypatch.setattr("tests.support.faulty_encoder.HANG_S", 1.5)
    async with serving(faulty_settings(world, new_timeout_s=0.4, new_stuck_threads=0)) as running:
        hung = await running.search(queries=[{"text": CAPTION.format(1) + " !hang-new"}], mode="slerp")
        assert hung.status_code == 504 and hung.json()["error"]["code"] == "encoder_timeout", hung.text
        ready = await running.client.get("/readyz")
        assert ready.status_code == 503 and "new encoder: every replica is stuck" in ready.json()["problems"][0]
        assert (await running.client.get("/healthz")).status_code == 200  # stuck, not dead: no restart
        for _ in range(100):
            if (await running.client.get("/readyz")).status_code == 200:
                break
            await asyncio.sleep(0.05)
        assert (await running.client.get("/readyz")).status_code == 200
        assert (await running.search(queries=[{"text": CAPTION.format(2)}], mode="slerp")).status_code == 200


# ---- the cache ---------------------------------------------------------------------------------------


@pytest.mark.redis
@pytest.mark.parametrize("damage", ["nan", "zero", "short"])
async def test_a_corrupt_cache_value_is_a_miss_and_is_rewritten(world: World, redis_url: str, damage: str) -> None:
    namespace = f"untrusted-{uuid.uuid4().hex[:8]}"
    settings = faulty_settings(world, cache=CacheSettings(redis_url=redis_url, namespace=namespace))
    text = CAPTION.format(42)
    client = aioredis.Redis.from_url(redis_url)
    try:
        async with serving(settings) as running:
            first = await running.search(queries=[{"text": text}], mode="slerp")
            assert first.json()["results"][0]["cache"] == "miss"
            await running.pipeline.drain()
            key = cache_key(namespace, cache_model_key(running.pipeline.old.encoder), "text", text)
            good = await client.get(key)
            assert decode_row(good, "float16", 512) is not None
            bad_row = {"nan": np.full(512, np.nan), "zero": np.zeros(512), "short": np.ones(100)}[damage]
            await client.set(key, np.asarray(bad_row, WIRE_DTYPES["float16"]).tobytes())
            before = sample("nobackfill_cache_events_total", event="corrupt")
            second = await running.search(queries=[{"text": text}], mode="slerp")
            assert second.status_code == 200 and second.json()["results"][0]["cache"] == "miss"
            assert second.json()["results"][0]["ids"] == first.json()["results"][0]["ids"]
            assert sample("nobackfill_cache_events_total", event="corrupt") == before + 1
            await running.pipeline.drain()
            assert await client.get(key) == good  # rewritten from the encoder
            third = await running.search(queries=[{"text": text}], mode="slerp")
            assert third.json()["results"][0]["cache"] == "hit"
    finally:
        await client.aclose()


@pytest.mark.redis
async def test_zero_rows_are_never_cached(world: World, redis_url: str) -> None:
    namespace = f"untrusted-{uuid.uuid4().hex[:8]}"
    settings = faulty_settings(world, cache=CacheSettings(redis_url=redis_url, namespace=namespace))
    client = aioredis.Redis.from_url(redis_url)
    try:
        async with serving(settings) as running:
            texts = [CAPTION.format(50) + " !zero-old", CAPTION.format(51)]
            response = await running.search(queries=[{"text": t} for t in texts], mode="slerp")
            assert response.status_code == 200
            await running.pipeline.drain()
            encoder = running.pipeline.old.encoder
            keys = [cache_key(namespace, cache_model_key(encoder), "text", t) for t in texts]
            assert [await client.exists(k) for k in keys] == [0, 1]
    finally:
        await client.aclose()


def test_no_thread_is_left_behind() -> None:
    # Hung calls of the tests above return within HANG_S <= 1.5 s: then no encoder thread lingers, not even
    # one a hung call was left on.
    assert encoder_threads_left() == []
