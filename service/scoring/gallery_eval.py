"""`gallery eval`: how much IVF-PQ loses against exact search, and what each nprobe costs in latency.

Recall is measured on a sub-gallery: every entry whose id is a multiple of `step` (~`sample` entries)
is copied, codes unchanged, out of the memory-mapped index into an in-memory twin (same quantiser,
same PQ codebooks).  Exact search runs on the same entries' true vectors, re-embedded (synthetic
world) or re-read (the .npy files the gallery was built from).  Probing loss is the same as on the
full gallery; PQ ranking loss is somewhat smaller, since a sparser gallery has fewer near competitors.
Queries: caption-0 views of sub-gallery items through the old encoder (synthetic), or rows of the
source that are not in the sub-gallery (.npy).

Latency is measured on the full gallery: single queries on one thread (p50 / p95), and batches of
`batch` queries on all threads (ms per batch and per query).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt
import torch

from service.errors import ArtifactError
from service.index.gallery import Gallery
from service.index.sources import NpySource, Rows, Source, SyntheticSource

Ids = npt.NDArray[np.int64]


# PQ codes cap recall below 1 whatever the nprobe: the knee is where more probes stop adding recall.
RECALL_TOLERANCE = 0.01


@dataclass(frozen=True)
class ProbeResult:
    """Recall and latency at one nprobe."""

    nprobe: int
    recall_at_1: float
    recall_at_10: float
    ten_recall_at_10: float
    single_p50_ms: float
    single_p95_ms: float
    batch_ms: float
    batch_ms_per_query: float


@dataclass(frozen=True)
class EvalReport:
    """What `gallery eval` prints."""

    ntotal: int
    sub_gallery: int
    queries: int
    batch: int
    threads: int
    probes: list[ProbeResult]
    item_recall_exact: dict[str, float] = field(default_factory=dict)

    def recommended(self, tolerance: float = RECALL_TOLERANCE) -> ProbeResult:
        """The smallest nprobe whose recall@10 is within `tolerance` of the best: past it, probes buy latency only."""
        best = max(p.recall_at_10 for p in self.probes)
        return min((p for p in self.probes if p.recall_at_10 >= best - tolerance), key=lambda p: p.nprobe)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready copy, with the recommended nprobe."""
        return {**asdict(self), "recommended_nprobe": self.recommended().nprobe}


def source_of(gallery: Gallery, npy_override: Path | None = None) -> Source:
    """Re-open what the gallery was built from (synthetic world, or its .npy files / an override)."""
    src = gallery.meta.get("source", {})
    if npy_override is None and src.get("kind") == "synthetic":
        source: Source = SyntheticSource(gallery.ntotal)
        recorded = {key: src.get(key) for key in ("world", "model")}
        current = {key: source.describe()[key] for key in ("world", "model")}
        if recorded != current:
            raise ArtifactError("gallery was built from a different synthetic world than this code generates")
    else:
        path = npy_override or (Path(src["path"]) if src.get("kind") == "npy" and src.get("path") else None)
        if path is None or not path.exists():
            raise ArtifactError(f"source vectors of {gallery.folder} not found ({path}); pass --from-npy")
        ids = Path(src["ids"]) if src.get("ids") and npy_override is None else None
        source = NpySource(path, ids)
    if source.ntotal != gallery.ntotal or source.dim != gallery.dim:
        raise ArtifactError(
            f"source has {source.ntotal} x {source.dim} vectors, the gallery {gallery.ntotal} x {gallery.dim}"
        )
    return source


def _sub_index(gallery: Gallery, step: int) -> Any:
    """An in-memory twin of the gallery holding only the entries with id % step == 0."""
    path = gallery.folder / str(gallery.meta.get("index_file", "index.faiss"))
    twin = faiss.read_index(str(path), faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY)
    ivf = faiss.extract_index_ivf(twin)
    lists = faiss.ArrayInvertedLists(ivf.nlist, ivf.code_size)
    ivf.replace_invlists(lists, True)
    lists.this.disown()  # type: ignore[attr-defined]  # owned by the index now: no double free
    ivf.ntotal = 0
    # Keep the parent index referenced: the IVF view of a collected parent is a dangling pointer.
    parent = faiss.read_index(str(path), faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY)
    faiss.extract_index_ivf(parent).copy_subset_to(ivf, faiss.InvertedLists.SUBSET_TYPE_ID_MOD, step, 0)  # type: ignore[attr-defined]
    del parent
    twin.ntotal = ivf.ntotal
    return twin


def _exact_topk(queries: Rows, base: Rows, k: int) -> Ids:
    """Exact inner-product top-k positions in base, in blocks of queries."""
    b = torch.from_numpy(base)
    out = [
        torch.topk(torch.from_numpy(queries[i : i + 1024]) @ b.T, min(k, base.shape[0]), dim=1).indices.numpy()
        for i in range(0, queries.shape[0], 1024)
    ]
    return np.concatenate(out).astype(np.int64)


def _recalls(found: Ids, exact: Ids) -> tuple[float, float, float]:
    """(exact NN is ANN top-1, exact NN in ANN top-10, mean overlap of the two top-10 sets)."""
    top1 = float(np.mean(found[:, 0] == exact[:, 0]))
    in10 = float(np.mean((found[:, :10] == exact[:, :1]).any(axis=1)))
    overlap = float(
        np.mean([np.intersect1d(a[:10], b[:10]).size / b[:10].size for a, b in zip(found, exact, strict=True)])
    )
    return top1, in10, overlap


def _latency(gallery: Gallery, queries: Rows, nprobe: int, batch: int) -> tuple[float, float, float]:
    """(single-query p50 ms and p95 ms on one thread, ms per batch of `batch` on all threads)."""
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        for q in queries[:10]:
            gallery.search(q[None, :], 10, nprobe)
        times = []
        for q in queries:
            start = time.perf_counter()
            gallery.search(q[None, :], 10, nprobe)
            times.append(time.perf_counter() - start)
    finally:
        faiss.omp_set_num_threads(threads)
    block = np.resize(queries, (batch, queries.shape[1]))
    gallery.search(block, 10, nprobe)
    batch_times = []
    for _ in range(3):
        start = time.perf_counter()
        gallery.search(block, 10, nprobe)
        batch_times.append(time.perf_counter() - start)
    ms = np.asarray(times) * 1000
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 95)), float(np.median(batch_times) * 1000)


def _queries(source: Source, sub_ids: Ids, n: int, step: int, rng: np.random.Generator) -> tuple[Rows, Ids | None]:
    """Evaluation queries, and for the synthetic world the item each query belongs to."""
    if isinstance(source, SyntheticSource):
        items = rng.choice(sub_ids, size=min(n, sub_ids.size), replace=False).astype(np.int64)
        return source.encoder.encode_items(items, 0), items
    candidates = np.arange(step // 2, source.ntotal, step, dtype=np.int64) if step > 1 else np.arange(source.ntotal)
    picked = np.sort(rng.choice(candidates, size=min(n, candidates.size), replace=False)).astype(np.int64)
    return source.rows(picked), None


def evaluate_gallery(
    gallery: Gallery,
    source: Source,
    *,
    queries: int = 200,
    nprobes: tuple[int, ...] = (1, 4, 8, 16, 32, 64),
    sample: int = 100_000,
    batch: int = 256,
    seed: int = 0,
) -> EvalReport:
    """Recall vs exact search on a sub-gallery and latency on the full gallery, per nprobe."""
    rng = np.random.default_rng(seed)
    step = max(1, gallery.ntotal // max(1, sample))
    twin = _sub_index(gallery, step)
    all_ids = source.ids(0, source.ntotal)
    sub_ids = all_ids[all_ids % step == 0]
    positions = source.positions_of(sub_ids) if isinstance(source, NpySource) else sub_ids
    base = source.rows(positions)
    q, items = _queries(source, sub_ids, queries, step, rng)
    exact_pos = _exact_topk(q, base, 10)
    exact_ids = sub_ids[exact_pos]
    probes = []
    for nprobe in sorted({p for p in nprobes if 1 <= p <= gallery.nlist}):
        params = faiss.SearchParametersIVF()
        params.nprobe = nprobe
        _, found = twin.search(q, 10, params=params)
        r1, r10, overlap = _recalls(found, exact_ids)
        p50, p95, batch_ms = _latency(gallery, q, nprobe, batch)
        probes.append(ProbeResult(nprobe, r1, r10, overlap, p50, p95, batch_ms, batch_ms / batch))
    item_exact = {}
    if items is not None:
        item_exact = {
            "item@1": float(np.mean(exact_ids[:, 0] == items)),
            "item@10": float(np.mean((exact_ids == items[:, None]).any(axis=1))),
        }
    return EvalReport(
        ntotal=gallery.ntotal,
        sub_gallery=int(twin.ntotal),
        queries=int(q.shape[0]),
        batch=batch,
        threads=faiss.omp_get_max_threads(),
        probes=probes,
        item_recall_exact=item_exact,
    )


def format_report(report: EvalReport) -> str:
    """The report as a plain-text table."""
    lines = [
        f"recall vs exact search: {report.queries} queries on a {report.sub_gallery:,}-entry sub-gallery "
        f"of {report.ntotal:,}; latency on the full gallery",
        f"{'nprobe':>6}  {'recall@1':>8}  {'recall@10':>9}  {'10-r@10':>7}  "
        f"{'1-thread p50 ms':>15}  {'p95 ms':>7}  {f'batch-{report.batch} ms':>13}  {'ms/query':>8}",
    ]
    for p in report.probes:
        lines.append(
            f"{p.nprobe:>6}  {p.recall_at_1:>8.3f}  {p.recall_at_10:>9.3f}  {p.ten_recall_at_10:>7.3f}  "
            f"{p.single_p50_ms:>15.3f}  {p.single_p95_ms:>7.3f}  {p.batch_ms:>13.1f}  {p.batch_ms_per_query:>8.3f}"
        )
    lines.append(
        "recall@1: ANN top-1 is the exact nearest; recall@10: exact nearest in ANN top-10; "
        f"10-r@10: overlap of the top-10 sets; batch on {report.threads} thread(s)"
    )
    if report.item_recall_exact:
        pairs = ", ".join(f"{k} {v:.3f}" for k, v in report.item_recall_exact.items())
        lines.append(f"synthetic captions finding their own item, exact search on the sub-gallery: {pairs}")
    pick = report.recommended()
    lines.append(
        f"recommended: NOBACKFILL_INDEX__NPROBE={pick.nprobe} (the smallest nprobe measured whose recall@10, "
        f"{pick.recall_at_10:.3f}, is within {RECALL_TOLERANCE} of the best; 1-thread p50 {pick.single_p50_ms:.3f} ms)"
    )
    return "\n".join(lines)
