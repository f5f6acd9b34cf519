"""The transform and search stage (on the pipeline's search pool): the head per row group, then one gallery search.

Rows whose encoder gave an all-zero row are answered by the other endpoint alone (fallback.py); the
result says so in `fallback` and nobackfill_zero_embedding_fallbacks_total counts it: never NaN,
never a 5xx.  `compare` searches the old rows too, in the same gallery call, and reports the overlap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from service import metrics
from service.compat.heads import transform
from service.compat.hubness import Corrected
from service.cpu_limit import usable_cpus
from service.errors import UnsupportedMode
from service.index.base import GalleryBackend
from service.query.fallback import Route, groups, routes
from service.query.hybrid import SegmentSearch
from service.query.job import QueryResult, SearchJob
from service.query.plan import Where
from service.rows import normalize_rows
from service.settings import IndexSettings
from service.vocabulary import Mode


def search_pool_size(settings: IndexSettings) -> int:
    """index.search_threads, else one per usable CPU (FAISS computes); a Milvus search mostly waits on the network."""
    if settings.search_threads is not None:
        return settings.search_threads
    cpus = usable_cpus()
    return min(32, cpus + 4) if settings.backend == "milvus" else cpus  # asyncio's own default for waiting threads


@dataclass
class _Transformed:
    """The gallery queries of a job, one row per query, with the weight and angle each row got."""

    batch: npt.NDArray[np.float32]
    alphas: list[float]
    thetas: list[float]  # NaN: the mode reads one endpoint only, so there is no angle


def transform_and_search(
    job: SearchJob, gallery: GalleryBackend, segment: SegmentSearch | None = None, hubness: Corrected | None = None
) -> list[QueryResult]:
    """Apply the head per row group, then one batched search: the gallery, or beside the segment (a search pool thread).

    `segment` is set whenever the pipeline has one; validation let hybrid and new through only then.
    """
    stages = job.plan
    if stages.where == Where.segment or stages.mapping is None:
        return _segment_only(job, _needed(segment))
    compare, head_mode = stages.compares, stages.mapping
    plan = routes(job, head_mode)
    with job.stage("transform"):
        rows = _transform(job, plan, head_mode)
    batch = np.concatenate([rows.batch, normalize_rows(job.old)]) if compare else rows.batch  # zero old: no results
    from_segment = None
    with job.stage("search"):
        if stages.where == Where.beside_segment:
            merged = _needed(segment).hybrid(job, batch, gallery)
            scores, ids, from_segment = merged.scores, merged.ids, merged.from_segment.sum(axis=1).tolist()
        elif hubness is not None and stages.mode == job.mapping.head:  # what `eval` scored as <head>+csls
            own = np.array([fallback is None for _, fallback in plan])
            scores, ids = hubness.search(gallery, batch, job.depth, job.nprobe, own, job.ef_search)
        else:
            scores, ids = gallery.search(batch, job.depth, job.nprobe, ef_search=job.ef_search)
    id_lists, score_lists = ids.tolist(), scores.tolist()
    results = []
    for i, ((row_mode, fallback), alpha, theta) in enumerate(zip(plan, rows.alphas, rows.thetas, strict=True)):
        found = fallback != "none"
        results.append(
            QueryResult(
                ids=id_lists[i] if found else [],
                scores=score_lists[i] if found else [],
                mode=stages.mode if stages.staged and not compare and fallback is None else row_mode,
                alpha=_as_fitted(alpha),
                cache=job.cache_status[i],
                theta=None if math.isnan(theta) else theta,
                fallback=fallback,
                segment_hits=from_segment[i] if from_segment is not None and found else None,
                score_scale=segment.scale(job, i)
                if segment is not None and from_segment and from_segment[i]
                else "old",
            )
        )
        if fallback is not None and not job.new_failed[i]:  # a failed new encoder is the cascade's count
            metrics.ZERO_EMBEDDING_FALLBACKS.labels(answered_by=fallback).inc()
    if compare:
        _add_old_side(job, results, id_lists[len(results) :], score_lists[len(results) :])
    return results


def _as_fitted(alpha: float) -> float:
    """An alpha as the profile states it: the float32 rows carry 0.6 as 0.6000000238..., and float32 holds 7 digits."""
    return float(f"{alpha:.7g}")


def _needed(segment: SegmentSearch | None) -> SegmentSearch:
    """The segment a hybrid or new request reads (validation admits them only when there is one)."""
    if segment is None:
        raise UnsupportedMode("hybrid and new need a new-model segment: NOBACKFILL_INDEX__SEGMENT_DIR")
    return segment


def _segment_only(job: SearchJob, segment: SegmentSearch) -> list[QueryResult]:
    """`new`: the new queries over the segment alone (what the service answers after the cut-over)."""
    usable = np.any(job.new != 0, axis=1).tolist()  # an all-zero new row (no known token) has no direction
    with job.stage("search"):
        merged = segment.new_only(job)
    results = []
    for i, ok in enumerate(usable):
        results.append(
            QueryResult(
                ids=merged.ids[i].tolist() if ok else [],
                scores=merged.scores[i].tolist() if ok else [],
                mode=Mode.new,
                alpha=None,
                cache=job.cache_status[i],
                fallback=None if ok else "none",
                segment_hits=int(merged.from_segment[i].sum()) if ok else None,
                score_scale="new",
            )
        )
    return results


def _transform(job: SearchJob, plan: list[Route], head_mode: str) -> _Transformed:
    """One transform call per (modality, mode, fallback) group; a row with no usable endpoint stays zero."""
    n = len(job.queries)
    batch = np.zeros((n, job.old_dim), dtype=np.float32)
    thetas = np.full(n, np.nan)
    alphas = np.zeros(n)
    for (modality, row_mode, fallback), rows in groups(job, plan).items():
        if fallback == "none":
            continue  # no usable endpoint: the row stays zero and gets no results
        reads = Mode(row_mode)
        out = transform(
            job.mapping,
            row_mode,
            job.old[rows] if reads.reads_old else None,
            job.new[rows] if reads.reads_new else None,
            modality,
            job.alpha if row_mode == head_mode else None,  # a fallback mode takes no weight
        )
        batch[rows] = out.queries
        alphas[rows] = out.row_alpha
        if reads.blends:  # theta needs both endpoints
            thetas[rows] = out.theta
            for theta in out.theta.tolist():
                metrics.RESIDUAL_ANGLE.observe(theta)
    return _Transformed(batch, alphas.tolist(), thetas.tolist())


def _add_old_side(
    job: SearchJob, results: list[QueryResult], old_ids: list[list[int]], old_scores: list[list[float]]
) -> None:
    """compare: each result's old-mode top-k beside it, and the share of ids both found."""
    old_found = np.any(job.old != 0, axis=1).tolist()
    for i, result in enumerate(results):
        result.compared = [result.mode, Mode.old]  # ids / scores, then old_ids / old_scores
        result.mode = Mode.compare
        result.old_ids = old_ids[i] if old_found[i] else []
        result.old_scores = old_scores[i] if old_found[i] else []
        kept = {x for x in result.ids if x >= 0}
        result.overlap = len(kept & {x for x in result.old_ids if x >= 0}) / job.k
