"""Requests/s, p50 / p99 and the cache hit ratio of the last minutes, read from the service's own collectors.

No Prometheus is needed: every call of `RecentTraffic.summary` snapshots the cumulative counters of
this process (the search route's latency histogram, the cache events) and compares them with the
oldest snapshot still inside the window.  Nothing runs in the background, so the window the answer
covers is the span between two looks at the page (or since the app was built): it is reported as
`window_s`.  With several workers each answers for itself.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Histogram

from service import metrics

SEARCH_ROUTE = "/v1/search"
WINDOW_S = 300.0  # "the last minutes": five of them
_MIN_SPACING_S = 1.0  # snapshots closer than this add nothing but memory


@dataclass(frozen=True)
class Snapshot:
    """Cumulative values at one moment: the histogram's bucket counts (upper bound -> count) and cache events."""

    at: float
    buckets: tuple[tuple[float, float], ...]
    count: float
    hits: float
    misses: float


def _histogram_buckets(histogram: Histogram, route: str) -> tuple[tuple[tuple[float, float], ...], float]:
    """(upper bound, cumulative count) of `route`'s series, and its total count; zeros before its first request."""
    buckets: list[tuple[float, float]] = []
    count = 0.0
    for family in histogram.collect():
        for sample in family.samples:
            if sample.labels.get("route") != route:
                continue
            if sample.name.endswith("_bucket"):
                buckets.append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_count"):
                count = sample.value
    buckets.sort()
    return tuple(buckets), count


def counter_value(counter: Counter, **labels: str) -> float:
    """The current value of one labelled series of `counter` (0 when it has none)."""
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def take_snapshot(now: float | None = None) -> Snapshot:
    """The collectors' cumulative values now."""
    buckets, count = _histogram_buckets(metrics.REQUEST_DURATION, SEARCH_ROUTE)
    return Snapshot(
        at=time.monotonic() if now is None else now,
        buckets=buckets,
        count=count,
        hits=counter_value(metrics.CACHE_EVENTS_TOTAL, event="hit"),
        misses=counter_value(metrics.CACHE_EVENTS_TOTAL, event="miss"),
    )


def quantile(q: float, upper: list[float], counts: list[float]) -> float | None:
    """The q-quantile of a histogram's cumulative bucket counts, interpolated as PromQL's histogram_quantile.

    None without observations.  A quantile past the last finite bound is that bound (as PromQL does).
    """
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, cumulative in zip(upper, counts, strict=True):
        if cumulative >= rank:
            if math.isinf(bound):
                return lower_bound
            if cumulative == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (cumulative - lower_count)
        lower_bound, lower_count = bound, cumulative
    return lower_bound


class RecentTraffic:
    """Snapshots of the last WINDOW_S (and the newest one before it, the window's base)."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._snapshots: deque[Snapshot] = deque([take_snapshot()])
        self._lock = threading.Lock()

    def summary(self, now: float | None = None) -> dict[str, Any]:
        """Search requests/s, p50 / p99 (ms) and the cache hit ratio between the window's base and now."""
        current = take_snapshot(now)
        with self._lock:
            while len(self._snapshots) > 1 and self._snapshots[1].at <= current.at - self.window_s:
                self._snapshots.popleft()  # the second-oldest is old enough to be the base
            base = self._snapshots[0]
            if current.at - self._snapshots[-1].at >= _MIN_SPACING_S:
                self._snapshots.append(current)
        return describe_window(base, current)


def describe_window(base: Snapshot, current: Snapshot) -> dict[str, Any]:
    """What changed between two snapshots, as the health panel shows it."""
    span = max(current.at - base.at, 1e-9)
    before = dict(base.buckets)
    upper = [bound for bound, _ in current.buckets]
    counts = [value - before.get(bound, 0.0) for bound, value in current.buckets]
    requests = current.count - base.count
    lookups = (current.hits - base.hits) + (current.misses - base.misses)
    p50, p99 = quantile(0.5, upper, counts), quantile(0.99, upper, counts)
    return {
        "window_s": round(span, 1),
        "requests": int(requests),
        "requests_per_s": round(requests / span, 3),
        "p50_ms": None if p50 is None else round(p50 * 1000, 2),
        "p99_ms": None if p99 is None else round(p99 * 1000, 2),
        "cache_lookups": int(lookups),
        "cache_hit_ratio": None if lookups <= 0 else round((current.hits - base.hits) / lookups, 4),
    }
