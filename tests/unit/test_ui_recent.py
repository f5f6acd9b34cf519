"""The health panel's last-minutes figures: histogram quantiles and the window between two snapshots."""

from __future__ import annotations

import math

import pytest

from service.api.ui.recent import Snapshot, describe_window, quantile


def test_quantile_interpolates_inside_the_bucket_as_promql_does() -> None:
    upper = [0.01, 0.1, 1.0, math.inf]
    # 10 below 10 ms, 80 between 10 and 100 ms, 10 between 0.1 and 1 s.
    counts = [10.0, 90.0, 100.0, 100.0]
    assert quantile(0.5, upper, counts) == pytest.approx(0.01 + 0.09 * 40 / 80)
    assert quantile(0.99, upper, counts) == pytest.approx(0.1 + 0.9 * 9 / 10)
    assert quantile(0.05, upper, counts) == pytest.approx(0.005)
    assert quantile(0.5, upper, [0.0, 0.0, 0.0, 0.0]) is None
    assert quantile(0.99, upper, [0.0, 0.0, 0.0, 5.0]) == 1.0  # past the last finite bound: that bound


def test_the_window_counts_only_what_happened_since_its_base() -> None:
    buckets = ((0.01, 100.0), (0.1, 100.0), (math.inf, 100.0))
    base = Snapshot(at=10.0, buckets=buckets, count=100.0, hits=50.0, misses=50.0)
    later = ((0.01, 100.0), (0.1, 120.0), (math.inf, 120.0))
    current = Snapshot(at=30.0, buckets=later, count=120.0, hits=65.0, misses=55.0)
    window = describe_window(base, current)
    assert window["requests"] == 20 and window["requests_per_s"] == 1.0 and window["window_s"] == 20.0
    assert 10 < window["p50_ms"] < window["p99_ms"] <= 100  # all 20 in the 10-100 ms bucket
    assert window["cache_hit_ratio"] == 0.75
