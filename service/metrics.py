"""Every Prometheus collector of the service, declared in one place on a private registry.

The registry is module-level and not prometheus-client's global default, so importing the service
never clashes with other libraries' collectors, and tests read values with
`REGISTRY.get_sample_value(...)`. All app instances in one process share these collectors.
Names carry the `nobackfill_` prefix and their unit; every label has a small, fixed set of values:

    nobackfill_requests_total{route, mode, status}        counter    route = route template, never a raw path
    nobackfill_request_duration_seconds{route}            histogram  whole request, middleware to response
    nobackfill_stage_duration_seconds{stage}              histogram  cache_lookup|old_encode|new_encode|
                                                                     queue_wait|transform|search|cascade
    nobackfill_requests_in_flight                         gauge      queries being served (a request of N counts N)
    nobackfill_encoder_batch_size{encoder}                histogram  encoder = old|new (the batcher's name)
    nobackfill_encoder_batch_duration_seconds{encoder}    histogram  one encoder.encode call on its worker
    nobackfill_encoder_queue_depth{encoder}               gauge      items waiting for a batch
    nobackfill_encoder_failures_total{encoder, reason}    counter    raised|bad_rows|timeout, per failed batch
                                                                     (timeout: also per entry left waiting)
    nobackfill_encoder_process_restarts_total{encoder}    counter    an encoder's child process died or was killed
                                                                     and was replaced (isolation: process)
    nobackfill_batcher_restarts_total{encoder}            counter    the collector task died and was restarted
    nobackfill_encoder_splits_total{encoder, cause}       counter    raised|timeout: batches of several calls split
                                                                     so that each call runs alone
    nobackfill_poison_refusals_total{encoder}             counter    calls refused at once (422 poison_input): an
                                                                     input that hung the encoder alone lately
    nobackfill_encoder_expected_wait_seconds{encoder}     gauge      the wait a new call can expect in the queue
                                                                     (admission compares it with api.max_queue_ms)
    nobackfill_admission_refusals_total{reason}           counter    queue_time|in_flight: searches answered 503
                                                                     overloaded at admission; deadline: encoder
                                                                     calls still queued past their request's deadline
    nobackfill_cache_events_total{event}                  counter    hit|miss|corrupt|error|write_error|skipped
    nobackfill_cache_breaker_open                         gauge      1 while Redis is skipped (cooling down)
    nobackfill_residual_angle_radians                     histogram  theta between u and v, per query
    nobackfill_zero_embedding_fallbacks_total{answered_by} counter   old|new|none: an encoder gave an all-zero
                                                                     row, the other endpoint answered alone
    nobackfill_event_loop_lag_seconds                     gauge      how late the event loop wakes (moving average)
    nobackfill_shed_requests_total                        counter    searches refused 503 while the loop lagged
    nobackfill_traffic_pairs_total{event}                 counter    sampled|stored|dropped|failed (old, new) query
                                                                     pairs of the traffic sampler (service/traffic/)
    nobackfill_gallery_failures_total{call}               counter    search|probe calls to a Milvus gallery that failed
    nobackfill_hits_total{event}                          counter    counted|dropped|failed returned ids of sampled
                                                                     result lists (backfill --order hot reads them)
    nobackfill_hybrid_hits_total{source}                  counter    old|segment: where hybrid results came from
    nobackfill_backfill_coverage_ratio                    gauge      share of the gallery in the new-model segment
    nobackfill_segment_shards{state}                      gauge      loaded|refused shards of the segment
    nobackfill_cascade_candidates_total{source}           counter    segment|pending|encoded|kept: where a
                                                                     re-ranked candidate's new row came from,
                                                                     or kept (its stage-1 place)
    nobackfill_cascade_encode_failures_total{reason}      counter    missing_item|encoder_failed|timeout|zero_row
    nobackfill_cascade_encoded_per_query                  histogram  candidates encoded on the path per query
    nobackfill_cascade_skipped_total{reason}              counter    new_encoder (down: stage 1 answered alone)
    nobackfill_cascade_segment_rows_total{outcome}        counter    published|already_moved|dropped rows the
                                                                     cascade wrote into the segment
    nobackfill_segment_write_failures_total               counter    cascade shard writes that failed (retried)
    nobackfill_build_info / _profile_info / _gallery_info info

Cache events: `hit` and `miss` count keys (a lookup that failed or was skipped returns misses, so
its keys count as misses too; so do `corrupt` values: wrong size, NaN/inf or zero, read as misses);
`error`, `write_error` and `skipped` count operations.
Several uvicorn workers (`nobackfill serve --workers N`) use prometheus-client's multiprocess mode:
`serve` points PROMETHEUS_MULTIPROC_DIR at a fresh folder before the workers start, each worker
writes its samples there, and /metrics on any worker adds them up (gauges: the sum over live
workers, the breaker: the max).  Info metrics have no multiprocess form, so they live on
INFO_REGISTRY and /metrics shows the answering worker's (every worker loads the same artifacts).
"""

from __future__ import annotations

import math
import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
    multiprocess,
)

from service.vocabulary import Role

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Read once: prometheus-client picks file-backed values at import when this is set.
MULTIPROCESS = bool(os.environ.get(MULTIPROC_ENV))
REGISTRY = CollectorRegistry(auto_describe=True)
INFO_REGISTRY = CollectorRegistry(auto_describe=True)

# 0.1 ms to 10 s: a cache hit is sub-millisecond, a cold encoder batch on CPU can take seconds.
LATENCY_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# Residual angle between two unit vectors lies in [0, pi]; finer steps where real upgrades land.
ANGLE_BUCKETS_RAD = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.2, 1.4, math.pi / 2, 2.0, 2.5, math.pi)

STAGES = ("cache_lookup", "old_encode", "new_encode", "queue_wait", "transform", "search", "cascade")
CACHE_EVENTS = ("hit", "miss", "corrupt", "error", "write_error", "skipped")

REQUESTS = Counter(
    "nobackfill_requests_total",
    "HTTP requests by route template, query mode and status code.",
    ["route", "mode", "status"],
    registry=REGISTRY,
)
REQUEST_DURATION = Histogram(
    "nobackfill_request_duration_seconds",
    "Whole-request latency by route template.",
    ["route"],
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
STAGE_DURATION = Histogram(
    "nobackfill_stage_duration_seconds",
    "Latency of one stage of the query path.",
    ["stage"],
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
IN_FLIGHT = Gauge(
    "nobackfill_requests_in_flight",
    "Queries (not requests) being served right now: a request of N queries counts N, as api.max_in_flight does.",
    multiprocess_mode="livesum",
    registry=REGISTRY,
)
ENCODER_BATCH_SIZE = Histogram(
    "nobackfill_encoder_batch_size",
    "Items per encoder call, after micro-batching.",
    ["encoder"],
    buckets=BATCH_SIZE_BUCKETS,
    registry=REGISTRY,
)
ENCODER_BATCH_DURATION = Histogram(
    "nobackfill_encoder_batch_duration_seconds",
    "Time of one encoder call on the encoder's worker thread.",
    ["encoder"],
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
QUEUE_DEPTH = Gauge(
    "nobackfill_encoder_queue_depth",
    "Items waiting in an encoder's micro-batcher.",
    ["encoder"],
    multiprocess_mode="livesum",
    registry=REGISTRY,
)
ENCODER_FAILURE_REASONS = ("raised", "bad_rows", "timeout")
ENCODER_FAILURES = Counter(
    "nobackfill_encoder_failures_total",
    "Encoder batches that failed: the model raised, returned unusable rows, or timed out.",
    ["encoder", "reason"],
    registry=REGISTRY,
)
ENCODER_PROCESS_RESTARTS = Counter(
    "nobackfill_encoder_process_restarts_total",
    "Encoder child processes (isolation: process) that died or were killed at the timeout, and were replaced.",
    ["encoder"],
    registry=REGISTRY,
)
BATCHER_RESTARTS = Counter(
    "nobackfill_batcher_restarts_total",
    "Times a micro-batcher's collector task died and was restarted.",
    ["encoder"],
    registry=REGISTRY,
)
SPLIT_CAUSES = ("raised", "timeout")
ENCODER_SPLITS = Counter(
    "nobackfill_encoder_splits_total",
    "Encoder batches of several calls that raised or hung and were split, each call re-run alone.",
    ["encoder", "cause"],
    registry=REGISTRY,
)
ENCODER_THREADS_REPLACED = Counter(
    "nobackfill_encoder_threads_replaced_total",
    "Hung encoder calls left on their own thread while a fresh thread took their replica's place.",
    ["encoder"],
    registry=REGISTRY,
)
POISON_REFUSALS = Counter(
    "nobackfill_poison_refusals_total",
    "Calls refused without running (422 poison_input): an input of theirs hung the encoder alone lately.",
    ["encoder"],
    registry=REGISTRY,
)
EXPECTED_WAIT = Gauge(
    "nobackfill_encoder_expected_wait_seconds",
    "Seconds a new call can expect to queue for an encoder: the items ahead at its measured cost per batch.",
    ["encoder"],
    multiprocess_mode="livemax",
    registry=REGISTRY,
)
ADMISSION_REASONS = ("queue_time", "in_flight", "deadline")
ADMISSION_REFUSALS = Counter(
    "nobackfill_admission_refusals_total",
    "503 overloaded by admission: searches whose expected queue time is over api.max_queue_ms or that would "
    "pass api.max_in_flight; deadline: encoder calls still queued past their search's deadline (never encoded).",
    ["reason"],
    registry=REGISTRY,
)
CACHE_EVENTS_TOTAL = Counter(
    "nobackfill_cache_events_total",
    "Old-embedding cache: hit/miss/corrupt per key; error/write_error/skipped per operation.",
    ["event"],
    registry=REGISTRY,
)
CACHE_BREAKER_OPEN = Gauge(
    "nobackfill_cache_breaker_open",
    "1 while the Redis circuit breaker is open and lookups skip Redis, else 0.",
    multiprocess_mode="livemax",
    registry=REGISTRY,
)
RESIDUAL_ANGLE = Histogram(
    "nobackfill_residual_angle_radians",
    "Angle theta between the old query embedding and the mapped new one.",
    buckets=ANGLE_BUCKETS_RAD,
    registry=REGISTRY,
)
ZERO_EMBEDDING_FALLBACKS = Counter(
    "nobackfill_zero_embedding_fallbacks_total",
    "Queries answered by one endpoint alone (or by nothing) because an encoder gave an all-zero row.",
    ["answered_by"],
    registry=REGISTRY,
)
EVENT_LOOP_LAG = Gauge(
    "nobackfill_event_loop_lag_seconds",
    "How late the event loop wakes a timer (a moving average): the queue no counter sees.",
    multiprocess_mode="livemax",
    registry=REGISTRY,
)
SHED_REQUESTS = Counter(
    "nobackfill_shed_requests_total",
    "Searches refused with 503 before any work because the event loop ran late.",
    registry=REGISTRY,
)
TRAFFIC_EVENTS = ("sampled", "stored", "dropped", "failed")
TRAFFIC_PAIRS = Counter(
    "nobackfill_traffic_pairs_total",
    "Traffic sampler pairs: sampled, stored, dropped (queue full / over the bound), failed (store error).",
    ["event"],
    registry=REGISTRY,
)
GALLERY_FAILURES = Counter(
    "nobackfill_gallery_failures_total",
    "Calls to a remote gallery (Milvus) that failed: unreachable, past index.milvus_timeout_s, or refused.",
    ["call"],  # search (answered 503 gallery_unavailable) or probe (/readyz)
    registry=REGISTRY,
)
HIT_EVENTS = ("counted", "dropped", "failed")
HITS = Counter(
    "nobackfill_hits_total",
    "Returned gallery ids of the sampled result lists: counted (stored), dropped (queue full), failed (store error).",
    ["event"],
    registry=REGISTRY,
)
HYBRID_HITS = Counter(
    "nobackfill_hybrid_hits_total",
    "Results returned by hybrid search, by where they came from: old (the frozen gallery) or segment.",
    ["source"],
    registry=REGISTRY,
)
BACKFILL_COVERAGE = Gauge(
    "nobackfill_backfill_coverage_ratio",
    "Share of the gallery's items in the new-model segment (0 without a segment).",
    multiprocess_mode="max",
    registry=REGISTRY,
)
SEGMENT_RECALL = Histogram(
    "nobackfill_segment_recall",
    "Recall@k of the segment's sealed indexes on sampled served queries, against an exact search of the same rows "
    "(one in index.segment_recall_every).",
    buckets=(0.5, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 1.0),
    registry=REGISTRY,
)
SEGMENT_SHARDS = Gauge(
    "nobackfill_segment_shards",
    "Shards of the new-model segment: loaded (searched) or refused (damaged).",
    ["state"],
    multiprocess_mode="max",
    registry=REGISTRY,
)
CASCADE_SOURCES = ("segment", "pending", "encoded", "kept")
CASCADE_CANDIDATES = Counter(
    "nobackfill_cascade_candidates_total",
    "Cascade candidates by where their new-model row came from (segment, pending: encoded but not yet "
    "published, encoded: on the request's path), or kept: no row, so its stage-1 place.",
    ["source"],
    registry=REGISTRY,
)
CASCADE_FAILURE_REASONS = ("missing_item", "encoder_failed", "timeout", "zero_row")
CASCADE_ENCODE_FAILURES = Counter(
    "nobackfill_cascade_encode_failures_total",
    "Candidates the cascade could not encode (they keep their stage-1 place): no item in the store, the "
    "encoder failed, no row within cascade.encode_timeout_s, or an all-zero row.",
    ["reason"],
    registry=REGISTRY,
)
CASCADE_ENCODED = Histogram(
    "nobackfill_cascade_encoded_per_query",
    "Candidates encoded on the request's path, per query (at most cascade.encode_budget).",
    buckets=(0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
    registry=REGISTRY,
)
CASCADE_SKIPPED = Counter(
    "nobackfill_cascade_skipped_total",
    "Queries whose cascade was skipped: new_encoder (the new encoder is down; stage 1 answered alone).",
    ["reason"],
    registry=REGISTRY,
)
CASCADE_SEGMENT_ROWS = Counter(
    "nobackfill_cascade_segment_rows_total",
    "Rows the cascade encoded and handed to the segment: published, already_moved (another writer was "
    "first), dropped (more pending than cascade.max_pending).",
    ["outcome"],
    registry=REGISTRY,
)
SEGMENT_WRITE_FAILURES = Counter(
    "nobackfill_segment_write_failures_total",
    "Shard writes of the cascade's rows that failed (the rows stay pending and are retried).",
    registry=REGISTRY,
)
BUILD_INFO = Info("nobackfill_build", "Service version and build.", registry=INFO_REGISTRY)
PROFILE_INFO = Info("nobackfill_profile", "The compat profile being served.", registry=INFO_REGISTRY)
GALLERY_INFO = Info("nobackfill_gallery", "The frozen gallery being searched.", registry=INFO_REGISTRY)

# Label children created up front so dashboards see zeros instead of missing series.
for _stage in STAGES:
    STAGE_DURATION.labels(stage=_stage)
for _event in CACHE_EVENTS:
    CACHE_EVENTS_TOTAL.labels(event=_event)
for _event in TRAFFIC_EVENTS:
    TRAFFIC_PAIRS.labels(event=_event)
for _call in ("search", "probe"):
    GALLERY_FAILURES.labels(call=_call)
for _event in HIT_EVENTS:
    HITS.labels(event=_event)
for _source in ("old", "segment"):
    HYBRID_HITS.labels(source=_source)
for _state in ("loaded", "refused"):
    SEGMENT_SHARDS.labels(state=_state)
for _source in CASCADE_SOURCES:
    CASCADE_CANDIDATES.labels(source=_source)
for _reason in CASCADE_FAILURE_REASONS:
    CASCADE_ENCODE_FAILURES.labels(reason=_reason)
CASCADE_SKIPPED.labels(reason="new_encoder")
for _outcome in ("published", "already_moved", "dropped"):
    CASCADE_SEGMENT_ROWS.labels(outcome=_outcome)
# The encoder alerts (deploy/prometheus/alerts.yml) take increase() of these: a series that first
# appears at 1 shows no increase, so the first failure or restart would pass unseen.
for _reason in ADMISSION_REASONS:
    ADMISSION_REFUSALS.labels(reason=_reason)
for _encoder in Role:
    ENCODER_PROCESS_RESTARTS.labels(encoder=_encoder)
    POISON_REFUSALS.labels(encoder=_encoder)
    EXPECTED_WAIT.labels(encoder=_encoder)
    for _cause in SPLIT_CAUSES:
        ENCODER_SPLITS.labels(encoder=_encoder, cause=_cause)
    ENCODER_THREADS_REPLACED.labels(encoder=_encoder)
    for _reason in ENCODER_FAILURE_REASONS:
        ENCODER_FAILURES.labels(encoder=_encoder, reason=_reason)


def cache_event(event: str, amount: int = 1) -> None:
    """Count `amount` cache events of one kind (see CACHE_EVENTS)."""
    if event not in CACHE_EVENTS:  # a free-form label value would make the series unbounded
        raise ValueError(f"unknown cache event {event!r}")
    if amount:
        CACHE_EVENTS_TOTAL.labels(event=event).inc(amount)


def count_traffic(event: str, amount: int = 1) -> None:
    """Count `amount` traffic pairs of one kind (see TRAFFIC_EVENTS)."""
    if event not in TRAFFIC_EVENTS:  # a free-form label value would make the series unbounded
        raise ValueError(f"unknown traffic event {event!r}")
    if amount:
        TRAFFIC_PAIRS.labels(event=event).inc(amount)


def render() -> tuple[bytes, str]:
    """Every metric in Prometheus text format, with its content type, for the /metrics route."""
    registry = REGISTRY
    if MULTIPROCESS:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return generate_latest(registry) + generate_latest(INFO_REGISTRY), CONTENT_TYPE_LATEST


def worker_exited(pid: int) -> None:
    """Drop a stopped worker's live gauges from the multiprocess totals (no-op with one process)."""
    if MULTIPROCESS:
        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
