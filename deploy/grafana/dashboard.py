"""Write deploy/grafana/dashboards/nobackfill.json, the provisioned Grafana dashboard, from the panels below.

    python3 deploy/grafana/dashboard.py          (standard library only; tests/system/test_deploy.py checks the
                                                   committed JSON is this script's output)

Rows of panels, laid out left to right on Grafana's 24-column grid.  Every expression reads metrics
the service exports (service/metrics.py); the test checks each against a running service's /metrics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards" / "nobackfill.json"
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}  # the uid provisioning/datasources gives it
RATE = "$__rate_interval"
SEARCH = 'route="/v1/search"'


def quantile(q: float, metric: str, by: str = "", where: str = "") -> str:
    """histogram_quantile of a histogram's buckets (those matching `where`), summed over instances (grouped `by`)."""
    labels = ", ".join(["le", *([by] if by else [])])
    selector = f"{{{where}}}" if where else ""
    return f"histogram_quantile({q}, sum by ({labels}) (rate({metric}_bucket{selector}[{RATE}])))"


def panel(
    title: str,
    targets: list[tuple[str, str]],
    unit: str,
    width: int = 12,
    description: str = "",
    kind: str = "timeseries",
    **extra: Any,
) -> dict[str, Any]:
    """One panel: (expression, legend) targets, a unit, a width; the position is set by `layout`."""
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": [
            {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
            for i, (expr, legend) in enumerate(targets)
        ],
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {},
        "gridPos": {"w": width, "h": 8},
        **extra,
    }


ROWS: list[tuple[str, list[dict[str, Any]]]] = [
    (
        "Requests",
        [
            panel(
                "Search requests by status",
                [(f"sum by (status) (rate(nobackfill_requests_total{{{SEARCH}}}[{RATE}]))", "{{status}}")],
                "reqps",
                description="Answers of /v1/search per second, by HTTP status.",
            ),
            panel(
                "Search error ratio (5xx)",
                [
                    (
                        f'sum(rate(nobackfill_requests_total{{{SEARCH}, status=~"5.."}}[{RATE}]))'
                        f" / sum(rate(nobackfill_requests_total{{{SEARCH}}}[{RATE}]))",
                        "5xx ratio",
                    )
                ],
                "percentunit",
                description="Alert NobackfillHighErrorRatio fires above 1% for 5 minutes.",
            ),
        ],
    ),
    (
        "",
        [
            panel(
                "Search latency p50 / p95 / p99",
                [
                    (
                        f"histogram_quantile({q}, sum by (le) "
                        f"(rate(nobackfill_request_duration_seconds_bucket{{{SEARCH}}}[{RATE}])))",
                        f"p{round(q * 100)}",
                    )
                    for q in (0.5, 0.95, 0.99)
                ],
                "s",
                description="Whole request, middleware to response. Objective: p99 under 250 ms.",
            ),
            panel(
                "Requests by route",
                [(f"sum by (route) (rate(nobackfill_requests_total[{RATE}]))", "{{route}}")],
                "reqps",
                description="Every route, probes and /metrics included.",
            ),
        ],
    ),
    (
        "Stages",
        [
            panel(
                f"Stage latency p{round(q * 100)}",
                [(quantile(q, "nobackfill_stage_duration_seconds", by="stage"), "{{stage}}")],
                "s",
                width=8,
                description="cache_lookup, old_encode, new_encode, queue_wait, transform, search.",
            )
            for q in (0.5, 0.95, 0.99)
        ],
    ),
    (
        "Cache",
        [
            panel(
                "Cache hit ratio",
                [
                    (
                        f'sum(rate(nobackfill_cache_events_total{{event="hit"}}[{RATE}]))'
                        f' / sum(rate(nobackfill_cache_events_total{{event=~"hit|miss"}}[{RATE}]))',
                        "hit ratio",
                    )
                ],
                "percentunit",
                width=8,
                description="Keys found over keys looked up (a failed or skipped lookup counts its keys as misses).",
            ),
            panel(
                "Cache events",
                [(f"sum by (event) (rate(nobackfill_cache_events_total[{RATE}]))", "{{event}}")],
                "ops",
                width=8,
                description="hit/miss/corrupt per key; error/write_error/skipped per operation.",
            ),
            panel(
                "Cache breaker open",
                [("max(nobackfill_cache_breaker_open)", "breaker open (any instance)")],
                "none",
                width=8,
                description="1 while Redis is skipped for a cooldown after errors (NobackfillCacheBreakerOpen).",
                fieldConfig={
                    "defaults": {"unit": "none", "min": 0, "max": 1, "custom": {"lineInterpolation": "stepAfter"}},
                    "overrides": [],
                },
            ),
        ],
    ),
    (
        "Load",
        [
            panel(
                "In-flight queries",
                [
                    ("sum(nobackfill_requests_in_flight)", "all instances"),
                    ("nobackfill_requests_in_flight", "{{instance}}"),
                ],
                "none",
                width=8,
                description="The HPA's custom metric (per pod) on Kubernetes.",
            ),
            panel(
                "Shed searches",
                [(f"sum(rate(nobackfill_shed_requests_total[{RATE}]))", "shed/s")],
                "reqps",
                width=8,
                description="Searches refused 503 before any work while the event loop ran late (NobackfillShedding).",
            ),
            panel(
                "Event loop lag",
                [("max(nobackfill_event_loop_lag_seconds)", "worst instance")],
                "s",
                width=8,
                description="Moving average of how late the loop wakes; shedding starts at API__SHED_LAG_MS.",
            ),
        ],
    ),
    (
        "Bounded waits",
        [
            panel(
                "Expected encoder queue wait",
                [("max by (encoder) (nobackfill_encoder_expected_wait_seconds)", "{{encoder}}")],
                "s",
                width=8,
                description="The wait a new call can expect in front of each encoder: the items queued at the "
                "measured cost per batch. Searches are refused 503 while it is over API__MAX_QUEUE_MS.",
            ),
            panel(
                "Admission refusals",
                [
                    (f"sum by (reason) (rate(nobackfill_admission_refusals_total[{RATE}]))", "{{reason}}"),
                    (f"sum(rate(nobackfill_shed_requests_total[{RATE}]))", "loop_lag"),
                ],
                "reqps",
                width=8,
                description="Searches answered 503 overloaded: expected queue time over API__MAX_QUEUE_MS, "
                "API__MAX_IN_FLIGHT reached, queued past their deadline (before being encoded), loop lag.",
            ),
            panel(
                "Split batches and poison inputs",
                [
                    (
                        f"sum by (encoder, cause) (rate(nobackfill_encoder_splits_total[{RATE}]))",
                        "{{encoder}} split: {{cause}}",
                    ),
                    (
                        f"sum by (encoder) (rate(nobackfill_poison_refusals_total[{RATE}]))",
                        "{{encoder}} poison refused",
                    ),
                ],
                "ops",
                width=8,
                description="Batches that raised or hung, split so each call ran alone; calls refused at once "
                "(422 poison_input) because an input of theirs hung the encoder alone lately.",
            ),
        ],
    ),
    (
        "Encoders",
        [
            panel(
                "Encoder batch size (mean, p95)",
                [
                    (
                        f"sum by (encoder) (rate(nobackfill_encoder_batch_size_sum[{RATE}]))"
                        f" / sum by (encoder) (rate(nobackfill_encoder_batch_size_count[{RATE}]))",
                        "{{encoder}} mean",
                    ),
                    (quantile(0.95, "nobackfill_encoder_batch_size", by="encoder"), "{{encoder}} p95"),
                ],
                "none",
                width=6,
                description="Items per encoder call after micro-batching.",
            ),
            panel(
                "Encoder queue depth",
                [("sum by (encoder) (nobackfill_encoder_queue_depth)", "{{encoder}}")],
                "none",
                width=6,
                description="Items waiting for a batch.",
            ),
            panel(
                "Encoder batch time p95",
                [(quantile(0.95, "nobackfill_encoder_batch_duration_seconds", by="encoder"), "{{encoder}}")],
                "s",
                width=6,
                description="One encoder call on its worker thread.",
            ),
            panel(
                "Encoder failures",
                [
                    (
                        f"sum by (encoder, reason) (rate(nobackfill_encoder_failures_total[{RATE}]))",
                        "{{encoder}} {{reason}}",
                    ),
                    (f"sum by (encoder) (rate(nobackfill_batcher_restarts_total[{RATE}]))", "{{encoder}} restarts"),
                    (
                        f"sum by (encoder) (rate(nobackfill_encoder_process_restarts_total[{RATE}]))",
                        "{{encoder}} process restarts",
                    ),
                ],
                "ops",
                width=6,
                description="Failed batches by reason (raised, bad_rows, timeout), batcher restarts, and encoder "
                "child processes replaced (isolation: process).",
            ),
        ],
    ),
    (
        "Compatibility",
        [
            panel(
                "Residual angle distribution",
                [(f"sum by (le) (increase(nobackfill_residual_angle_radians_bucket[{RATE}]))", "{{le}}")],
                "short",
                width=16,
                kind="heatmap",
                description="theta between the old query embedding and the mapped new one, per query (radians).",
                options={"calculate": False, "yAxis": {"unit": "short"}, "cellGap": 1},
            ),
            panel(
                "Residual angle mean",
                [
                    (
                        f"sum(rate(nobackfill_residual_angle_radians_sum[{RATE}]))"
                        f" / sum(rate(nobackfill_residual_angle_radians_count[{RATE}]))",
                        "mean theta",
                    ),
                    (
                        "sum(rate(nobackfill_residual_angle_radians_sum[7d]))"
                        " / sum(rate(nobackfill_residual_angle_radians_count[7d]))",
                        "weekly mean",
                    ),
                ],
                "short",
                width=8,
                description="NobackfillResidualAngleDrift fires when the hourly mean is 0.1 rad off the weekly one.",
            ),
        ],
    ),
    (
        "Traffic sampling and remote gallery",
        [
            panel(
                "Sampled query pairs",
                [(f"sum by (event) (rate(nobackfill_traffic_pairs_total[{RATE}]))", "{{event}}")],
                "ops",
                width=12,
                description="(old, new) query pairs sampled, stored, dropped (queue full) or failed (store error); "
                "zero unless NOBACKFILL_TRAFFIC__SAMPLE_RATE > 0 (docs/traffic-learning.md).",
            ),
            panel(
                "Remote gallery failures",
                [(f"sum by (call) (rate(nobackfill_gallery_failures_total[{RATE}]))", "{{call}}")],
                "ops",
                width=12,
                description="Milvus calls that failed (search: answered 503 gallery_unavailable; probe: /readyz); "
                "zero with the local FAISS gallery (docs/scale-out.md).",
            ),
        ],
    ),
    (
        "Migration (new-model segment)",
        [
            panel(
                "Backfill coverage",
                [("max(nobackfill_backfill_coverage_ratio)", "moved share")],
                "percentunit",
                width=6,
                description="Share of the gallery's items in the new-model segment; 1 means ready for the "
                "cut-over (docs/backfill.md). Zero without NOBACKFILL_INDEX__SEGMENT_DIR.",
            ),
            panel(
                "Hybrid results by source",
                [(f"sum by (source) (rate(nobackfill_hybrid_hits_total[{RATE}]))", "{{source}}")],
                "ops",
                width=6,
                description="Ids that hybrid search returned from the frozen gallery (old) or the segment.",
            ),
            panel(
                "Segment shards",
                [("max by (state) (nobackfill_segment_shards)", "{{state}}")],
                "short",
                width=6,
                description="Shards searched (loaded) and refused as damaged (each refusal is one log line).",
            ),
            panel(
                "Segment recall (sampled queries)",
                [
                    (
                        f"sum(rate(nobackfill_segment_recall_sum[{RATE}])) / "
                        f"sum(rate(nobackfill_segment_recall_count[{RATE}]))",
                        "mean",
                    ),
                    (quantile(0.1, "nobackfill_segment_recall"), "p10"),
                ],
                "percentunit",
                width=6,
                description="Recall@k of the segment's sealed indexes on one served search in "
                "NOBACKFILL_INDEX__SEGMENT_RECALL_EVERY, against an exact search of the same rows. Below 0.99: "
                "raise NOBACKFILL_INDEX__SEGMENT_EF_SEARCH (docs/backfill.md).",
            ),
        ],
    ),
    (
        "Re-rank cascade",
        [
            panel(
                "Cascade candidates by row source",
                [(f"sum by (source) (rate(nobackfill_cascade_candidates_total[{RATE}]))", "{{source}}")],
                "ops",
                width=6,
                description="Stage-1 candidates re-ranked with a new-model row from the segment, from rows "
                "encoded but not yet published (pending), or encoded on the request's path; kept: no row, so "
                "they keep their stage-1 place (docs/backfill.md).",
            ),
            panel(
                "Candidates encoded per query",
                [
                    (quantile(0.5, "nobackfill_cascade_encoded_per_query"), "p50"),
                    (quantile(0.99, "nobackfill_cascade_encoded_per_query"), "p99"),
                ],
                "short",
                width=6,
                description="The encode budget used: candidates encoded on the request's path per query (at most "
                "NOBACKFILL_CASCADE__ENCODE_BUDGET). It falls as the segment fills.",
            ),
            panel(
                "Cascade stage latency",
                [
                    (quantile(0.5, "nobackfill_stage_duration_seconds", where='stage="cascade"'), "p50"),
                    (quantile(0.99, "nobackfill_stage_duration_seconds", where='stage="cascade"'), "p99"),
                ],
                "s",
                width=6,
                description="The cascade stage: row lookups, encoding on the path (bounded by "
                "NOBACKFILL_CASCADE__ENCODE_TIMEOUT_S) and the re-rank.",
            ),
            panel(
                "Cascade failures, skips and segment writes",
                [
                    (
                        f"sum by (reason) (rate(nobackfill_cascade_encode_failures_total[{RATE}]))",
                        "not encoded: {{reason}}",
                    ),
                    (f"sum by (reason) (rate(nobackfill_cascade_skipped_total[{RATE}]))", "skipped: {{reason}}"),
                    (f"sum by (outcome) (rate(nobackfill_cascade_segment_rows_total[{RATE}]))", "rows: {{outcome}}"),
                    (f"sum(rate(nobackfill_segment_write_failures_total[{RATE}]))", "shard writes failed"),
                ],
                "ops",
                width=6,
                description="Candidates the cascade could not encode (they keep their stage-1 place), queries whose "
                "cascade was skipped (the new encoder down: stage 1 answered with the old model), and the rows it "
                "handed to the segment: published, already moved by another writer, or dropped.",
            ),
        ],
    ),
]


def layout(rows: list[tuple[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Panels with ids and grid positions: a row header (when titled), then its panels left to right."""
    out: list[dict[str, Any]] = []
    y = 0
    for title, panels in rows:
        if title:
            out.append(
                {
                    "type": "row",
                    "title": title,
                    "collapsed": False,
                    "panels": [],
                    "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
                }
            )
            y += 1
        x = 0
        for item in panels:
            item = json.loads(json.dumps(item))
            item["gridPos"].update(x=x, y=y)
            if item["type"] == "heatmap":  # Grafana reads bucket series as a heatmap only in this format
                for target in item["targets"]:
                    target["format"] = "heatmap"
            out.append(item)
            x += item["gridPos"]["w"]
        assert x <= 24, f"row {title!r} is {x} columns wide"
        y += max(p["gridPos"]["h"] for p in panels)
    for number, item in enumerate(out, start=1):
        item["id"] = number
    return out


def dashboard() -> dict[str, Any]:
    """The whole dashboard document."""
    return {
        "uid": "nobackfill",
        "title": "nobackfill",
        "description": "nobackfill: traffic, latency per stage, cache, load, encoders, residual angle.",
        "tags": ["nobackfill"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "graphTooltip": 1,
        "templating": {"list": []},
        "annotations": {"list": []},
        "links": [],
        "panels": layout(ROWS),
    }


def render() -> str:
    """The JSON text written to OUT."""
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)
