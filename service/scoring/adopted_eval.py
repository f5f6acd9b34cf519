"""`gallery eval` of an adopted index: its recall against exact search, and its latency, per search width.

A built gallery is measured on a sub-gallery cut out of its IVF lists (gallery_eval.py); an adopted
index may be a graph, which cannot be cut, so it is measured whole.  The queries are `queries` of its
own rows, each leaving itself out: the truth for a row is its exact top 10 among all the other rows
(inner product on the rows as stored, index/adopted_rows.py), the index's answer its top 11 less the
row itself.  A row is an easier query than a caption is (it lies on the data), so read the figures as
an upper bound of what queries get, and compare widths by them.

The width is the index's own: nprobe for an IVF index (what NOBACKFILL_INDEX__NPROBE and a request's
nprobe set), efSearch for an HNSW one (NOBACKFILL_INDEX__ADOPTED_EF_SEARCH; one below 11 is measured
at 11, the rows each query asks for); a Flat index is exact and has one row.  Latency is the served
call's (AdoptedGallery.search, labels mapped to gallery ids): single queries on one thread, and
batches of `batch` on all threads.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import faiss
import numpy as np

from service.errors import InputError
from service.index.adopted import AdoptedGallery
from service.index.adopted_rows import AdoptedRows
from service.index.sources import sample_positions
from service.rows import F32, I64

K = 10
CHUNK = 65_536  # rows scored at a time for the exact truth
RECALL_TOLERANCE = 0.01  # as gallery_eval's: past the knee more width buys latency only
# What each family's width is called, and the setting that serves it.
PARAMETERS = {
    "ivf": ("nprobe", "NOBACKFILL_INDEX__NPROBE"),
    "hnsw": ("efSearch", "NOBACKFILL_INDEX__ADOPTED_EF_SEARCH"),
}


@dataclass(frozen=True)
class WidthResult:
    """Recall and latency at one width (None: a Flat index, exact)."""

    width: int | None
    recall_at_1: float
    recall_at_10: float
    ten_recall_at_10: float
    single_p50_ms: float
    single_p95_ms: float
    batch_ms: float
    batch_ms_per_query: float


@dataclass(frozen=True)
class AdoptedEvalReport:
    """What `gallery eval` prints for an adopted index."""

    index_type: str
    parameter: str | None  # nprobe, efSearch, or None (exact)
    served_width: int | None  # what the service searches at now (the file's efSearch or the setting; nprobe's)
    ntotal: int
    queries: int
    rows_from: str
    batch: int
    threads: int
    widths: list[WidthResult]

    def recommended(self, tolerance: float = RECALL_TOLERANCE) -> WidthResult:
        """The narrowest width whose 10-recall@10 is within `tolerance` of the best measured."""
        best = max(w.ten_recall_at_10 for w in self.widths)
        return min((w for w in self.widths if w.ten_recall_at_10 >= best - tolerance), key=lambda w: w.width or 0)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready copy, with the recommended width."""
        return {**asdict(self), "recommended_width": self.recommended().width}


def evaluate_adopted(
    gallery: AdoptedGallery,
    rows: AdoptedRows,
    widths: tuple[int, ...],
    *,
    queries: int = 200,
    batch: int = 256,
    served_width: int | None = None,
    seed: int = 0,
) -> AdoptedEvalReport:
    """Recall against exact search and latency, per width the index family takes (widths: nprobes or efSearches)."""
    family = gallery.kind["family"]
    parameter = PARAMETERS[family][0] if family in PARAMETERS else None
    if rows.ntotal < 2:
        raise InputError(f"gallery {gallery.folder}: {rows.ntotal} row(s): a row's neighbours need other rows")
    picked = sample_positions(rows.ntotal, min(queries, rows.ntotal - 1), seed)
    q = np.ascontiguousarray(rows.rows(picked), dtype=np.float32)
    own = rows.ids(0, rows.ntotal)[picked]
    truth = _exact_others(q, rows, own)
    swept: list[int | None] = [None]  # a Flat index: exact, nothing to sweep
    if family == "hnsw":  # a walk is at least as wide as the rows asked (the row itself and its K)
        swept = [*sorted({max(w, K + 1) for w in widths})]
    elif family == "ivf":
        swept = [*sorted({w for w in widths if 1 <= w <= (gallery.max_nprobe or w)})]
    results = []
    for width in swept:
        found = _others(gallery, q, own, width)
        p50, p95, batch_ms = _latency(gallery, q, width, batch)
        results.append(WidthResult(width, *_recalls(found, truth), p50, p95, batch_ms, batch_ms / batch))
    return AdoptedEvalReport(
        index_type=str(gallery.kind["type"]),
        parameter=parameter,
        served_width=served_width,
        ntotal=rows.ntotal,
        queries=len(picked),
        rows_from=rows.origin,
        batch=batch,
        threads=faiss.omp_get_max_threads(),
        widths=results,
    )


def _exact_others(q: F32, rows: AdoptedRows, own: I64) -> I64:
    """Each query row's exact top K gallery ids among all the other rows (by inner product), scanned in chunks."""
    best_scores = np.full((len(q), K + 1), -np.inf, dtype=np.float32)
    best_ids = np.full((len(q), K + 1), -1, dtype=np.int64)
    for start in range(0, rows.ntotal, CHUNK):
        stop = min(start + CHUNK, rows.ntotal)
        scores, positions = faiss.knn(q, rows.rows(np.arange(start, stop)), min(K + 1, stop - start),
                                      metric=faiss.METRIC_INNER_PRODUCT)  # fmt: skip
        scores = np.concatenate([best_scores, scores], axis=1)
        ids = np.concatenate([best_ids, rows.ids(start, stop)[positions]], axis=1)
        order = np.argsort(-scores, axis=1, kind="stable")[:, : K + 1]
        best_scores, best_ids = np.take_along_axis(scores, order, axis=1), np.take_along_axis(ids, order, axis=1)
    return _without_own(best_ids, own)


def _searched(gallery: AdoptedGallery, q: F32, k: int, width: int | None) -> I64:
    """The served call's top k gallery ids at this width (an IVF index's nprobe, an HNSW one's efSearch)."""
    if gallery.kind["family"] == "hnsw":
        return gallery.search(q, k, nprobe=1, ef_search=width)[1]
    return gallery.search(q, k, nprobe=width or 1)[1]


def _others(gallery: AdoptedGallery, q: F32, own: I64, width: int | None) -> I64:
    """The index's top K gallery ids for each query row, the row itself left out, at this width."""
    return _without_own(_searched(gallery, q, K + 1, width), own)


def _without_own(ids: I64, own: I64) -> I64:
    """Each row's first K ids other than its own (-1 padded)."""
    out = np.full((len(ids), K), -1, dtype=np.int64)
    for i, row in enumerate(ids):
        others = row[row != own[i]][:K]
        out[i, : len(others)] = others
    return out


def _recalls(found: I64, truth: I64) -> tuple[float, float, float]:
    """(exact nearest is the index's top 1, exact nearest in its top 10, mean overlap of the two top-10 sets)."""
    top1 = float(np.mean(found[:, 0] == truth[:, 0]))
    in10 = float(np.mean((found == truth[:, :1]).any(axis=1)))
    overlap = float(np.mean([np.intersect1d(a[a >= 0], b).size / K for a, b in zip(found, truth, strict=True)]))
    return top1, in10, overlap


def _latency(gallery: AdoptedGallery, q: F32, width: int | None, batch: int) -> tuple[float, float, float]:
    """(single-query p50 and p95 ms on one thread, ms per batch of `batch` on all threads) of the served call."""

    def search(rows: F32) -> None:
        _searched(gallery, rows, K, width)

    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        for row in q[:10]:
            search(row[None, :])
        times = []
        for row in q:
            started = time.perf_counter()
            search(row[None, :])
            times.append(time.perf_counter() - started)
    finally:
        faiss.omp_set_num_threads(threads)
    block = np.resize(q, (batch, q.shape[1]))
    search(block)
    batch_times = []
    for _ in range(3):
        started = time.perf_counter()
        search(block)
        batch_times.append(time.perf_counter() - started)
    ms = np.asarray(times) * 1000
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 95)), float(np.median(batch_times) * 1000)


def format_adopted_report(report: AdoptedEvalReport) -> str:
    """The report as a plain-text table, and the width to serve."""
    name = report.parameter or "search"
    lines = [
        f"adopted {report.index_type} of {report.ntotal:,} rows: recall vs exact search on {report.queries} of its "
        f"own rows (each leaving itself out; read from {report.rows_from}); latency of the served call",
        f"{name:>8}  {'recall@1':>8}  {'recall@10':>9}  {'10-r@10':>7}  "
        f"{'1-thread p50 ms':>15}  {'p95 ms':>7}  {f'batch-{report.batch} ms':>13}  {'ms/query':>8}",
    ]
    for w in report.widths:
        width = "exact" if w.width is None else str(w.width)
        if w.width is not None and w.width == report.served_width:
            width += "*"
        lines.append(
            f"{width:>8}  {w.recall_at_1:>8.3f}  {w.recall_at_10:>9.3f}  {w.ten_recall_at_10:>7.3f}  "
            f"{w.single_p50_ms:>15.3f}  {w.single_p95_ms:>7.3f}  {w.batch_ms:>13.1f}  {w.batch_ms_per_query:>8.3f}"
        )
    lines.append(
        "recall@1: the index's top 1 is the exact nearest; recall@10: the exact nearest in its top 10; "
        f"10-r@10: overlap of the two top-10 sets; batch on {report.threads} thread(s)"
        + ("; * what the service searches at now" if report.served_width is not None else "")
    )
    if report.parameter is None:
        lines.append("a Flat index is exact: nothing to tune")
        return "\n".join(lines)
    pick = report.recommended()
    setting = PARAMETERS["ivf" if report.parameter == "nprobe" else "hnsw"][1]
    lines.append(
        f"recommended: {setting}={pick.width} (the narrowest {report.parameter} measured whose 10-r@10, "
        f"{pick.ten_recall_at_10:.3f}, is within {RECALL_TOLERANCE} of the best; "
        f"1-thread p50 {pick.single_p50_ms:.3f} ms)"
    )
    return "\n".join(lines)
