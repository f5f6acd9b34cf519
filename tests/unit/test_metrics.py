"""The metrics module: every documented collector renders, on the service's own registry."""

from __future__ import annotations

import prometheus_client
import pytest

from service import metrics

NAMES = [
    "nobackfill_requests_total",
    "nobackfill_request_duration_seconds",
    "nobackfill_stage_duration_seconds",
    "nobackfill_requests_in_flight",
    "nobackfill_encoder_batch_size",
    "nobackfill_encoder_batch_duration_seconds",
    "nobackfill_encoder_queue_depth",
    "nobackfill_cache_events_total",
    "nobackfill_cache_breaker_open",
    "nobackfill_residual_angle_radians",
    "nobackfill_build_info",
    "nobackfill_profile_info",
    "nobackfill_gallery_info",
]


def test_render_lists_every_metric_with_the_prometheus_content_type() -> None:
    metrics.REQUESTS.labels(route="/v1/search", mode="slerp", status="200").inc()
    metrics.REQUEST_DURATION.labels(route="/v1/search").observe(0.012)
    metrics.ENCODER_BATCH_SIZE.labels(encoder="old").observe(4)
    metrics.ENCODER_BATCH_DURATION.labels(encoder="old").observe(0.003)
    metrics.QUEUE_DEPTH.labels(encoder="new").set(0)
    metrics.RESIDUAL_ANGLE.observe(0.4)
    metrics.BUILD_INFO.info({"version": "test"})
    metrics.PROFILE_INFO.info({"profile_id": "p", "head": "slerp"})
    metrics.GALLERY_INFO.info({"fingerprint": "f", "ntotal": "1"})
    body, content_type = metrics.render()
    text = body.decode()
    assert content_type.startswith("text/plain")
    for name in NAMES:
        assert f"# TYPE {name.removesuffix('_total')}" in text, name
    assert 'nobackfill_requests_total{mode="slerp",route="/v1/search",status="200"}' in text


def test_stage_and_cache_event_series_exist_before_first_use() -> None:
    text = metrics.render()[0].decode()
    for stage in metrics.STAGES:
        assert f'nobackfill_stage_duration_seconds_count{{stage="{stage}"}}' in text
    for event in metrics.CACHE_EVENTS:
        assert f'nobackfill_cache_events_total{{event="{event}"}}' in text


def test_latency_buckets_span_a_tenth_of_a_millisecond_to_ten_seconds() -> None:
    assert metrics.LATENCY_BUCKETS_S[0] == 0.0001 and metrics.LATENCY_BUCKETS_S[-1] == 10.0
    text = metrics.render()[0].decode()
    assert 'nobackfill_stage_duration_seconds_bucket{le="0.0001",stage="search"}' in text


def test_cache_event_counts_and_rejects_unknown_events() -> None:
    before = metrics.REGISTRY.get_sample_value("nobackfill_cache_events_total", {"event": "hit"}) or 0.0
    metrics.cache_event("hit", 3)
    metrics.cache_event("hit", 0)
    after = metrics.REGISTRY.get_sample_value("nobackfill_cache_events_total", {"event": "hit"})
    assert after == before + 3
    with pytest.raises(ValueError, match="bogus"):
        metrics.cache_event("bogus")  # an unknown event must not create a new series


def test_service_metrics_stay_off_the_global_registry() -> None:
    global_text = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    assert "nobackfill_" not in global_text
