"""Traffic sampling through the HTTP stack: off by default, on into the local shards and into real Redis."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from service import metrics
from service.compat.hubness import load_hubness
from service.compat.profile import load_profile
from service.encoders.identity import ModelIdentity
from service.index.gallery import Gallery
from service.settings import CompatSettings, IndexSettings, Settings, TrafficSettings
from service.traffic.base import parse_models_key
from service.traffic.sampler import create_store
from tests.support.app import serving
from tests.support.cli import cli
from tests.support.world import World

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
    async with serving(settings) as running:
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


async def test_rollout_export_refit_compare_reload(world: World, tmp_path: Path) -> None:
    """The documented rollout with the CLI: sample, export, refit with the pairs, gate, reload by the admin route."""
    shards, profiles = tmp_path / "shards", tmp_path / "profiles"
    settings = Settings(
        index=IndexSettings(gallery_dir=world.gallery_dir, nprobe=8),
        compat=CompatSettings(profile_dir=world.profile_dir),
        traffic=TrafficSettings(sample_rate=1.0, store="local", local_dir=shards),
        api={"admin_key": "adm1n", "profiles_root": str(profiles)},
    )
    test_dir = tmp_path / "test"
    assert cli("synth", "test", "--n", 300, "--gallery-size", 3000, "--seed", 7, "--out", test_dir).returncode == 0
    async with serving(settings) as running:
        for start in range(0, 600, 60):  # 600 caption queries of items outside the test set's 3,000
            queries = [{"text": f"item-{3000 + 25 * i:010d} caption-5"} for i in range(start, start + 60)]
            assert (await running.search(queries=queries, k=5, mode="slerp")).status_code == 200
        assert running.pipeline.traffic.flush()
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("NOBACKFILL_TRAFFIC__STORE", "local")
            mp.setenv("NOBACKFILL_TRAFFIC__LOCAL_DIR", str(shards))
            exported = cli("traffic", "export", "--out", tmp_path / "export")
        assert exported.returncode == 0 and "wrote 600 pairs" in exported.stdout, exported.stderr
        fitted = cli(
            "fit", world.support_dir, "--out", profiles / "candidate", "--folds", 3, "--eval-queries", 300,
            "--add-query-pairs", tmp_path / "export",
        )  # fmt: skip
        assert fitted.returncode == 0 and "unlabelled query pairs" in fitted.stdout, fitted.stderr
        gate = cli(
            "profile", "compare", world.profile_dir, profiles / "candidate", test_dir, "--traffic", tmp_path / "export"
        )
        # 4,000 labelled pairs already fit R well: 600 more pairs change little, and the gate passes it.
        assert gate.returncode == 0, gate.stdout + gate.stderr
        candidate_id = load_profile(profiles / "candidate").profile_id
        admin = {"Authorization": "Bearer adm1n"}
        reloaded = await running.client.post(
            "/v1/admin/reload-profile", json={"profile_dir": "candidate"}, headers=admin
        )
        assert reloaded.status_code == 200 and reloaded.json()["profile_id"] == candidate_id
        assert running.pipeline.profile.profile_id == candidate_id
    # The exported pairs also keep a hubness sidecar current: built from them, bound to the profile that
    # mapped them, and served.
    sidecar = tmp_path / "hubness"
    built = cli(
        "gallery", "hubness", world.gallery_dir, world.profile_dir, "--queries", tmp_path / "export", "--out", sidecar
    )
    assert built.returncode == 0 and "against 600 mapped traffic queries" in built.stdout, built.stdout + built.stderr
    loaded = load_hubness(
        sidecar, Gallery.load(world.gallery_dir).fingerprint, load_profile(world.profile_dir).profile_id
    )
    assert loaded.meta["queries_from"] == f"traffic {tmp_path / 'export'}" and loaded.meta["queries"] == 600
    hub_settings = Settings(
        index=IndexSettings(gallery_dir=world.gallery_dir, nprobe=8),
        compat=CompatSettings(profile_dir=world.profile_dir, hubness_dir=sidecar),
    )
    async with serving(hub_settings) as served:
        info = (await served.client.get("/v1/info")).json()
        assert info["hubness"]["profile_id"] == load_profile(world.profile_dir).profile_id
        assert (
            await served.search(queries=[{"text": "item-0000000042 caption-1"}], k=5, mode="slerp")
        ).status_code == 200
