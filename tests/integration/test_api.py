"""The HTTP API through the real stack (httpx ASGI transport) on a real FAISS gallery and profile."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
from PIL import Image

from service import metrics
from service.compat.heads import transform
from service.settings import CacheSettings
from tests.support.app import Running, serving
from tests.support.servers import PrivateRedis
from tests.support.world import CAPTION, World, make_settings


@pytest.fixture
async def service(world: World) -> AsyncIterator[Running]:
    """The service with the in-process cache."""
    async with serving(make_settings(world)) as running:
        yield running


def count_calls(service: Running, role: str) -> list[int]:
    """Count the items the old or new encoder is asked to encode from now on."""
    batcher = service.pipeline.old if role == "old" else service.pipeline.new
    encoder = batcher.encoder
    seen: list[int] = []
    original: Callable[..., Any] = encoder.encode

    def counting(batch: list[str], *args: Any, **kwargs: Any) -> Any:
        seen.append(len(batch))
        return original(batch, *args, **kwargs)

    encoder.encode = counting  # type: ignore[method-assign]
    return seen


def hold_calls(service: Running, role: str) -> threading.Event:
    """Make the old or new encoder's calls wait until the returned event is set."""
    batcher = service.pipeline.old if role == "old" else service.pipeline.new
    encoder = batcher.encoder
    release = threading.Event()
    original: Callable[..., Any] = encoder.encode

    def held(batch: list[str], *args: Any, **kwargs: Any) -> Any:
        release.wait(timeout=30)
        return original(batch, *args, **kwargs)

    encoder.encode = held  # type: ignore[method-assign]
    return release


@pytest.mark.parametrize("mode", ["old", "aligned", "slerp", "nlerp", "adaptive"])
async def test_each_mode_returns_k_results(service: Running, mode: str) -> None:
    response = await service.search(queries=[{"text": CAPTION.format(7)}, {"text": CAPTION.format(8)}], k=7, mode=mode)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert len(results) == 2
    for result in results:
        assert result["mode"] == mode
        assert len(result["ids"]) == 7 and len(result["scores"]) == 7
        assert result["scores"] == sorted(result["scores"], reverse=True)


async def test_slerp_finds_the_captioned_item_more_often_than_old(service: Running) -> None:
    queries = [{"text": CAPTION.format(i)} for i in range(0, 4000, 100)]
    hits = {}
    for mode in ("old", "slerp"):
        response = await service.search(queries=queries, k=10, mode=mode)
        assert response.status_code == 200
        hits[mode] = sum(i * 100 in r["ids"] for i, r in enumerate(response.json()["results"]))
    assert hits["slerp"] > hits["old"] > 0


async def test_compare_mode_reports_both_lists_and_overlap(service: Running) -> None:
    response = await service.search(queries=[{"text": CAPTION.format(3)}], k=10, mode="compare")
    assert response.status_code == 200
    result = response.json()["results"][0]
    assert len(result["old_ids"]) == 10 and len(result["ids"]) == 10
    expected = len(set(result["ids"]) & set(result["old_ids"])) / 10
    assert result["overlap"] == pytest.approx(expected)
    # It says what it did: mode compare, the head's ids beside old's, and both named.
    info = (await service.client.get("/v1/info")).json()
    assert result["mode"] == "compare" and result["compared"] == [info["profile"]["head"], "old"]
    assert "compare" in info["modes"]
    fitted = info["profile"]["alphas"]["text"]
    assert result["alpha"] == fitted and len(repr(result["alpha"])) <= 9, result["alpha"]  # not 0.6000000238418579
    unknown = await service.search(queries=[{"text": CAPTION.format(3)}], mode="slerpy")
    assert response.status_code == 200 and "compare" in unknown.json()["error"]["message"]


async def test_explicit_alpha_zero_equals_old_mode(service: Running) -> None:
    query = [{"text": CAPTION.format(11)}]
    old = (await service.search(queries=query, mode="old")).json()["results"][0]
    alpha0 = (await service.search(queries=query, mode="slerp", alpha=0.0)).json()["results"][0]
    assert alpha0["ids"] == old["ids"]
    assert alpha0["alpha"] == 0.0


async def test_second_identical_query_is_a_cache_hit_without_the_old_encoder(service: Running) -> None:
    old_calls = count_calls(service, "old")
    query = [{"text": "item-0000000123 caption-4"}]
    first = (await service.search(queries=query)).json()["results"][0]
    assert first["cache"] == "miss" and old_calls == [1]
    await service.pipeline.drain()
    second = (await service.search(queries=query)).json()["results"][0]
    assert second["cache"] == "hit"
    assert old_calls == [1], "a cache hit must not touch the old encoder"
    assert second["ids"] == first["ids"]


async def test_results_equal_the_offline_path(service: Running) -> None:
    """The HTTP answer is exactly transform() + gallery.search() on the same embeddings."""
    pipeline = service.pipeline
    texts = [CAPTION.format(i) for i in (1, 2, 3)]
    old = pipeline.old.encoder.encode(texts, "text")
    new = pipeline.new.encoder.encode(texts, "text")
    expected = transform(pipeline.profile, "slerp", old, new, "text")
    scores, ids = pipeline.gallery.search(expected.queries, 10, 16)
    by_text = (await service.search(queries=[{"text": t} for t in texts], k=10, nprobe=16)).json()["results"]
    by_vectors = (
        await service.search(
            queries=[{"old_embedding": o.tolist(), "new_embedding": n.tolist()} for o, n in zip(old, new, strict=True)],
            k=10,
            nprobe=16,
        )
    ).json()["results"]
    for row, text_result, vector_result in zip(range(3), by_text, by_vectors, strict=True):
        assert text_result["ids"] == ids[row].tolist()
        assert vector_result["ids"] == ids[row].tolist()
        np.testing.assert_allclose(text_result["scores"], scores[row], rtol=1e-5, atol=1e-6)


async def test_image_query_is_served(service: Running) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buffer, format="PNG")
    payload = base64.b64encode(buffer.getvalue()).decode()
    # The session's profile was fitted on text queries only: image queries need an explicit alpha.
    refused = await service.search(queries=[{"image_b64": payload}], k=3)
    assert refused.status_code == 400 and "image" in refused.json()["error"]["message"]
    response = await service.search(queries=[{"image_b64": payload}], k=3, alpha=0.5)
    assert response.status_code == 200, response.text
    assert len(response.json()["results"][0]["ids"]) == 3


async def test_debug_reports_theta_and_stage_timings(service: Running) -> None:
    result = (await service.search(queries=[{"text": CAPTION.format(5)}], debug=True)).json()["results"][0]
    assert 0.0 < result["theta"] < np.pi
    assert {"new_encode", "transform", "search"} <= set(result["timings_ms"])


BAD_REQUESTS: list[tuple[str, dict[str, Any], int]] = [
    ("empty query list", {"queries": []}, 400),
    ("too many queries", {"queries": [{"text": "x"}] * 65}, 413),
    ("text over the limit", {"queries": [{"text": "x" * 5000}]}, 400),
    ("invalid base64", {"queries": [{"image_b64": "not base64!!"}]}, 400),
    ("not an image", {"queries": [{"image_b64": base64.b64encode(b"plain text").decode()}]}, 400),
    ("wrong old dim", {"queries": [{"old_embedding": [0.1] * 3, "new_embedding": [0.1] * 768}]}, 400),
    ("k zero", {"queries": [{"text": "x"}], "k": 0}, 400),
    ("k too large", {"queries": [{"text": "x"}], "k": 1001}, 400),
    ("nprobe zero", {"queries": [{"text": "x"}], "nprobe": 0}, 400),
    ("nprobe over nlist", {"queries": [{"text": "x"}], "nprobe": 65}, 400),
    ("unknown mode", {"queries": [{"text": "x"}], "mode": "teleport"}, 400),
    ("mode the profile lacks", {"queries": [{"text": "x"}], "mode": "adapter"}, 400),
    ("alpha above 1", {"queries": [{"text": "x"}], "alpha": 1.5}, 400),
    ("alpha below 0", {"queries": [{"text": "x"}], "alpha": -0.1}, 400),
    ("query with two kinds", {"queries": [{"text": "x", "image_b64": "AAAA"}]}, 422),
    ("unknown field", {"queries": [{"text": "x"}], "colour": "red"}, 422),
]


@pytest.mark.parametrize(("case", "body", "status"), BAD_REQUESTS, ids=[case for case, _, _ in BAD_REQUESTS])
async def test_bad_input_gets_a_clear_4xx_and_the_service_is_unharmed(
    service: Running, case: str, body: dict[str, Any], status: int
) -> None:
    response = await service.client.post("/v1/search", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] and error["message"], case
    healthy = await service.search(queries=[{"text": CAPTION.format(1)}])
    assert healthy.status_code == 200


async def test_nan_embedding_is_refused(service: Running) -> None:
    body = (
        b'{"queries": [{"old_embedding": [NaN' + b", 0.1" * 511 + b'], "new_embedding": [' + b"0.1, " * 767 + b"0.1]}]}"
    )
    response = await service.client.post("/v1/search", content=body, headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500
    assert "error" in response.json()


async def test_info_health_ready_metrics(service: Running) -> None:
    info = (await service.client.get("/v1/info")).json()
    assert info["gallery"]["ntotal"] == 20_000 and info["gallery"]["dim"] == 512
    assert info["profile"]["alphas"]["text"] is not None
    assert (await service.client.get("/healthz")).status_code == 200
    ready = await service.client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["cache"]["kind"] == "memory"
    await service.search(queries=[{"text": CAPTION.format(9)}])
    exposition = (await service.client.get("/metrics")).text
    for name in (
        "nobackfill_requests_total",
        "nobackfill_stage_duration_seconds",
        "nobackfill_residual_angle_radians",
    ):
        assert name in exposition


async def test_request_metrics_label_route_mode_and_status(service: Running) -> None:
    def count(route: str, mode: str, status: str) -> float:
        labels = {"route": route, "mode": mode, "status": status}
        return metrics.REGISTRY.get_sample_value("nobackfill_requests_total", labels) or 0.0

    before = (count("/v1/search", "old", "200"), count("/v1/search", "slerp", "400"), count("unmatched", "-", "404"))
    assert (await service.search(queries=[{"text": CAPTION.format(3)}], mode="old")).status_code == 200
    assert (await service.search(queries=[], mode="slerp")).status_code == 400
    assert (await service.client.get("/no/such/route")).status_code == 404
    after = (count("/v1/search", "old", "200"), count("/v1/search", "slerp", "400"), count("unmatched", "-", "404"))
    assert [a - b for a, b in zip(after, before, strict=True)] == [1.0, 1.0, 1.0]


async def test_api_key_guards_search_and_admin(world: World) -> None:
    settings = make_settings(world, api={"api_key": "s3cret", "admin_key": "adm1n"})
    async with serving(settings) as running:
        assert (await running.search(queries=[{"text": "x"}])).status_code == 401
        assert (await running.client.post("/v1/admin/reload-profile")).status_code == 401
        ok = await running.client.post(
            "/v1/search", json={"queries": [{"text": "x"}]}, headers={"Authorization": "Bearer s3cret"}
        )
        assert ok.status_code == 200
        assert (await running.client.get("/healthz")).status_code == 200


async def test_reload_keeps_the_old_profile_on_failure(tmp_path: Any, world: World) -> None:
    settings = make_settings(world, api={"admin_key": "adm1n", "profiles_root": str(tmp_path)})
    admin = {"Authorization": "Bearer adm1n"}
    async with serving(settings) as running:
        before = running.pipeline.profile.profile_id
        missing = {"profile_dir": str(tmp_path / "none")}
        refused = await running.client.post("/v1/admin/reload-profile", json=missing, headers=admin)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "bad_artifact"
        assert running.pipeline.profile.profile_id == before
        outside = await running.client.post(
            "/v1/admin/reload-profile", json={"profile_dir": str(world.profile_dir)}, headers=admin
        )
        assert outside.status_code == 400 and "profiles root" in outside.json()["error"]["message"]
        assert running.pipeline.profile.profile_id == before
        reloaded = await running.client.post("/v1/admin/reload-profile", headers=admin)
        assert reloaded.status_code == 200 and reloaded.json()["profile_id"] == before


async def test_overload_gets_503_with_retry_after(world: World) -> None:
    # Two queries held in the old encoder: two more would be 4 in flight, over the limit of 3.
    async with serving(make_settings(world, api={"max_in_flight": 3, "max_queries": 2})) as running:
        release = hold_calls(running, "old")
        try:
            first = asyncio.create_task(running.search(queries=[{"text": "a"}, {"text": "b"}]))
            for _ in range(3000):
                if running.pipeline.in_flight == 2:
                    break
                await asyncio.sleep(0.01)
            assert running.pipeline.in_flight == 2
            response = await running.search(queries=[{"text": "c"}, {"text": "d"}])
            assert response.status_code == 503 and response.json()["error"]["code"] == "overloaded"
            assert response.headers["retry-after"].isdigit()
        finally:
            release.set()
        assert (await first).status_code == 200
        assert (await running.search(queries=[{"text": "c"}, {"text": "d"}])).status_code == 200


@pytest.mark.redis
async def test_redis_cache_hit_then_outage_still_answers(world: World, private_redis: PrivateRedis) -> None:
    settings = make_settings(world, cache=CacheSettings(redis_url=private_redis.url, namespace="api-test"))
    async with serving(settings) as running:
        query = [{"text": CAPTION.format(77)}]
        assert (await running.search(queries=query)).json()["results"][0]["cache"] == "miss"
        await running.pipeline.drain()
        result = (await running.search(queries=query)).json()["results"][0]
        assert result["cache"] == "hit"
        private_redis.stop()
        for _ in range(5):
            during = await running.search(queries=query)
            assert during.status_code == 200
            assert during.json()["results"][0]["cache"] == "miss"
            assert during.json()["results"][0]["ids"] == result["ids"]
        ready = await running.client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["cache"]["ping"] is False
