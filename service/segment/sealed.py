"""Sealed indexes: HNSW graphs built once over published shards, stored in the segment, loaded by every reader.

    SEGMENT/indexes/<name>/
        index.faiss     faiss IndexHNSWSQ, float16 (inner product), over the rows' coordinates in basis.npy
        basis.npy       float32 [d, r]: the rows' top r principal directions (uncentred)
        rows.npy        float32 [n, d]: the rows themselves, which re-rank the graph's candidates exactly
        ids.npy         int64 [n]: the gallery id of each row, ascending (the rows are in this order)
        index.json      format 3; the shards it covers, rows, directions, links, efConstruction, the efSearch
                        its seal measured (measured_width), the recall there and on what (its own
                        rows, or served queries: width_probes), dim, storage, writer, time
        manifest.json   size and sha256 of the others (service/manifest.py)
    SEGMENT/indexes/.<name>.tmp     being written (readers never look at it)

Format 1 (sealed before directions existed) has no basis or rows: its graph holds the whole rows and
its answer is the graph's.  Format 2 is format 3 with the coordinates in float32 (IndexHNSWFlat).
Readers serve both as they are.

Why the graph walks r principal directions and the rows re-rank: a graph search reads a few thousand
rows at random, and at 768 floats each that read is its cost.  Embeddings keep nearly all their
length in far fewer directions (the synthetic new model's rows: 99.5 % in 128 of 768), so the graph
over those coordinates reads a sixth of the bytes per step, which buys a wider search (ef) for the
same time, and the candidates' full rows (RERANK x k of them) put the answer in the exact order.
docs/backfill.md measures recall and time against the whole-row graph.

Why float16 coordinates: for the same reason, the bytes a step reads.  Half of them gives the same
candidates (recall@10 0.992 at 10^5 rows, as float32) in about 0.15 ms less a query; the re-rank
reads the float32 rows, so the scores are exact either way.  8-bit codes lost recall for no more speed.

Why stored, not built by each reader: a graph depends on the order its rows were added, so a service
that built its own blocks shard by shard as they arrived searched another structure than one that
read the finished segment at once (a cut-over, a restart), and the answers differed.  A sealed index
is one file every reader loads as it is, so every reader at the same disk state searches the same
structure: the approximate part is the same everywhere, and the rest (rows of shards no sealed index
covers yet: the growing part) is searched exactly, whose answers do not depend on any order.  It also
spares every start the build (about a quarter of a second per thousand rows of 768 floats on 2 cores).

Who seals: `backfill run` (each part of a parallel one) at its end once enough rows are uncovered,
and `nobackfill backfill index`; one at a time (SEGMENT/seal.lock).  A seal covers the intact shards
no sealed index covers, each id once (its first row in shard-name order, as a once-read segment keeps
it; ids a kept index holds already are left out).  Which sealed indexes a reader serves (the cover)
is a function of the folder alone: widest first (most shards), then in name order, each index whose
shards are all intact and none covered by one taken before.

Why a seal takes in smaller indexes: each index is one more graph search per query (hybrid at 50 %
moved searched two, 100,000 and 400,000 rows, in 2.25 ms where one graph of 500,000 takes about
1 ms).  So a seal rebuilds, with its new rows, every served index no larger than the rows gathered so
far (smallest first: size tiers, as an LSM tree compacts), and retires them once its own is published.
A segment then holds a few indexes, each larger than all the smaller ones together, and a row is
sealed again O(log n) times over a backfill.  The wider index wins the cover, so a reader that sees
both serves the new one; a retired one goes to a hidden name first (readers never look there), then
away, while readers that loaded it keep their copy (the graph in memory, the rows' open mapping).
"""

from __future__ import annotations

import fcntl
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from service.errors import ArtifactError, InputError
from service.index.base import sorted_member
from service.json_file import read_json_object
from service.manifest import verify_manifest, write_json_durably
from service.rows import F32, I64, principal_directions
from service.segment.catalog import ShardCatalog, ShardEntry, sorted_union
from service.segment.layout import fsync_path, publish_folder, read_segment_meta, save

INDEXES = "indexes"
SEAL_LOCK = "seal.lock"
INDEX_FILE = "index.faiss"
IDS_FILE = "ids.npy"
INDEX_JSON = "index.json"
BASIS_FILE = "basis.npy"
ROWS_FILE = "rows.npy"
FORMAT = 3
STORAGE = "float16"  # the graph's coordinates (faiss ScalarQuantizer QT_fp16)
LINKS = 32  # HNSW M: edges per row (docs/backfill.md measured 16, 32 and their recall)
EF_CONSTRUCTION = 40
KEPT_LENGTH = 0.995  # the share of the rows' squared length the graph's directions keep
DIRECTION_STEP = 16  # the direction count is rounded up to a multiple of this (at most d)
BASIS_SAMPLE = 20_000  # rows the directions are read from
RERANK = 2  # candidates the graph returns per answer row, re-ranked by the full rows
# The recall@10 of exact a seal chooses its index's efSearch for, over its own rows as probes (0.997 of them: the
# width that gives queries 0.99, measured_width says why).
RECALL_TARGET = 0.997
# Given served queries (a traffic export's new-model rows), the width is measured on them instead, for the
# recall@10 they are to get: no margin for easier probes is needed.
QUERY_RECALL_TARGET = 0.99
WIDTHS = (128, 192, 256, 384, 512, 768, 1024)  # the efSearch values a seal tries, narrowest first
PROBES = 400  # rows of the index itself (or served queries) a seal asks to measure them (4,000 neighbours)
LEGACY_EF_SEARCH = 128  # the efSearch of an index sealed before seals measured one (the former fixed default)
OWN_ROWS = "its own rows"  # what a width was measured on without served queries (index.json's width_probes)


@dataclass(frozen=True)
class SealedMeta:
    """What index.json says: the name, the shards it covers and its row count."""

    name: str
    shards: frozenset[str]
    rows: int
    ef_search: int = LEGACY_EF_SEARCH  # the width its seal measured to find RECALL_TARGET of exact
    width_probes: str = OWN_ROWS  # what the width was measured on (served queries: measured_width)


@dataclass(frozen=True)
class Sealed:
    """A loaded sealed index: what searches it (a faiss graph, or a ProjectedGraph) and each row's gallery id."""

    meta: SealedMeta
    index: Any
    ids: I64

    @property
    def ef_search(self) -> int:
        """The width its graph searches at when a call names none."""
        graph = self.index.graph if isinstance(self.index, ProjectedGraph) else self.index
        return int(graph.hnsw.efSearch)


@dataclass(frozen=True)
class ProjectedGraph:
    """A format-2 sealed index as a segment block searches it (the faiss calls reader.Block makes): the graph over
    the rows' principal coordinates proposes RERANK x k rows, their full rows' inner products order them."""

    graph: Any  # faiss IndexHNSWSQ (format 3) or IndexHNSWFlat (format 2) over rows @ basis
    basis: F32  # [d, r]
    rows: F32  # [n, d], memory-mapped

    @property
    def ntotal(self) -> int:
        return int(self.graph.ntotal)

    @property
    def d(self) -> int:
        return int(self.rows.shape[1])

    def search(self, queries: F32, k: int, ef_search: int | None = None) -> tuple[F32, I64]:
        """Top-k inner products of queries [b, d] with the rows: (scores, row numbers; -inf / -1 pad); the graph
        walked at ef_search candidates (None: the efSearch it was loaded with)."""
        q = np.ascontiguousarray(queries, dtype=np.float32)
        wanted = min(self.ntotal, RERANK * k)
        coords = np.ascontiguousarray(q @ self.basis)
        _, found = self.graph.search(coords, wanted, params=graph_width(ef_search, wanted))
        listed = found >= 0
        exact = np.einsum("bcd,bd->bc", self.rows[np.where(listed, found, 0)], q)
        exact = np.where(listed, exact, -np.inf).astype(np.float32)
        order = np.argsort(-exact, axis=1, kind="stable")[:, :k]
        scores = np.take_along_axis(exact, order, axis=1)
        rows = np.where(np.isfinite(scores), np.take_along_axis(found, order, axis=1), -1)
        return scores, rows.astype(np.int64)

    def reconstruct_batch(self, positions: I64) -> F32:
        """The full rows at these positions (the cascade reads moved items' rows back)."""
        return np.asarray(self.rows[positions], dtype=np.float32)

    def reconstruct_n(self, first: int, count: int) -> F32:
        """`count` full rows from `first`."""
        return np.asarray(self.rows[first : first + count], dtype=np.float32)


def search_graph(index: Any, queries: F32, k: int, ef_search: int | None) -> tuple[F32, I64]:
    """A sealed index's top-k (scores, row numbers), walked at ef_search (None: its loaded efSearch): a
    ProjectedGraph (formats 2 and 3) or a faiss HNSW graph over whole rows (format 1).  Either way the scores
    are exact inner products (format 1 holds the rows in float32; the others re-rank by them)."""
    if isinstance(index, ProjectedGraph):
        return index.search(queries, k, ef_search)
    found: tuple[F32, I64] = index.search(queries, k, params=graph_width(ef_search, k))
    return found


def graph_width(ef_search: int | None, k: int) -> Any:
    """faiss's per-call parameters for an HNSW search of k at ef_search (None: the index's own efSearch).  Per
    call, so concurrent requests at different widths never share a setting on the index.  At least k: faiss
    widens its own efSearch to k, but not one given per call, and returns a short list under it."""
    if ef_search is None:
        return None
    params = faiss.SearchParametersHNSW()  # type: ignore[attr-defined]
    params.efSearch = max(ef_search, k)
    return params


def directions(rows: F32) -> F32:
    """The basis [d, r] of the sample's top principal directions (uncentred: those that keep most of the rows'
    inner products) that keep KEPT_LENGTH of its squared length, r a multiple of DIRECTION_STEP (at most d)."""
    sample = rows[np.linspace(0, len(rows) - 1, min(len(rows), BASIS_SAMPLE)).astype(np.int64)]
    kept, basis = principal_directions(sample)
    needed = int(np.searchsorted(kept, KEPT_LENGTH) + 1)
    rank = min(len(sample), basis.shape[1], -(-needed // DIRECTION_STEP) * DIRECTION_STEP)
    return np.ascontiguousarray(basis[:, :rank])


def sealed_names(folder: Path) -> list[str]:
    """Names of the published sealed indexes, oldest first."""
    try:
        return sorted(p.name for p in (folder / INDEXES).iterdir() if p.is_dir() and not p.name.startswith("."))
    except FileNotFoundError:
        return []


def read_meta(folder: Path, name: str) -> SealedMeta:
    """index.json of one sealed index; ArtifactError in one line when it is unreadable."""
    path = folder / INDEXES / name / INDEX_JSON
    data = read_json_object(path, f"sealed index {path.parent}: {INDEX_JSON}")
    shards, rows = data.get("shards"), data.get("rows")
    if not isinstance(shards, list) or not all(isinstance(s, str) for s in shards) or not isinstance(rows, int):
        raise ArtifactError(f"sealed index {path.parent}: {INDEX_JSON} must list its shards and rows")
    ef_search = data.get("ef_search", LEGACY_EF_SEARCH)
    if not isinstance(ef_search, int) or isinstance(ef_search, bool) or ef_search < 1:
        raise ArtifactError(f"sealed index {path.parent}: {INDEX_JSON}'s ef_search must be a positive integer")
    probes = data.get("width_probes")  # absent before seals could measure on served queries
    return SealedMeta(name, frozenset(shards), rows, ef_search, probes if isinstance(probes, str) else OWN_ROWS)


def choose_cover(metas: list[SealedMeta], intact: set[str]) -> list[SealedMeta]:
    """The sealed indexes a reader serves: widest first (a merged index before those it took in), then in name
    order, each whose shards are all intact and not yet covered."""
    taken: list[SealedMeta] = []
    covered: set[str] = set()
    for meta in sorted(metas, key=lambda m: (-len(m.shards), m.name)):
        if meta.shards <= intact and not meta.shards & covered:
            taken.append(meta)
            covered |= meta.shards
    return taken


def load_sealed(folder: Path, meta: SealedMeta, dim: int, ef_search: int | None) -> Sealed:
    """Read and check one sealed index (manifest, ids, dim, count); ArtifactError in one line naming it.  It
    searches at ef_search when a request names no width (None: the width its seal measured)."""
    path = folder / INDEXES / meta.name
    if verify_manifest(path) is None:
        raise ArtifactError(f"sealed index {path}: manifest.json is missing")
    projected = (path / BASIS_FILE).is_file()  # format 2; format 1's graph holds the whole rows
    try:
        ids = np.load(path / IDS_FILE, allow_pickle=False)
        graph = faiss.read_index(str(path / INDEX_FILE))
        basis = np.load(path / BASIS_FILE, allow_pickle=False) if projected else None
        rows = np.load(path / ROWS_FILE, mmap_mode="r", allow_pickle=False) if projected else None
    except (OSError, ValueError, RuntimeError) as exc:
        raise ArtifactError(f"sealed index {path}: unreadable ({exc})") from exc
    if ids.dtype != np.int64 or ids.ndim != 1 or len(ids) != meta.rows or graph.ntotal != meta.rows:
        raise ArtifactError(f"sealed index {path}: {meta.rows} rows named, {len(ids)} ids and {graph.ntotal} rows held")
    width = dim if basis is None else basis.shape[1]
    kinds = (faiss.IndexHNSWFlat,) if basis is None else (faiss.IndexHNSWFlat, faiss.IndexHNSWSQ)
    if graph.d != width or not isinstance(graph, kinds) or np.any(np.diff(ids) <= 0):
        raise ArtifactError(f"sealed index {path}: not an HNSW index of dim {width} over ascending ids")
    graph.hnsw.efSearch = meta.ef_search if ef_search is None else ef_search
    if basis is None or rows is None:
        return Sealed(meta, graph, ids)
    if basis.dtype != np.float32 or basis.shape[0] != dim or rows.dtype != np.float32 or rows.shape != (meta.rows, dim):
        raise ArtifactError(f"sealed index {path}: basis {basis.shape} and rows {rows.shape} do not fit dim {dim}")
    return Sealed(meta, ProjectedGraph(graph, basis, rows), ids)


@dataclass(frozen=True)
class SealReport:
    """What a seal did: the index's name (None when nothing was sealed), rows and shards covered, seconds, and
    how many smaller indexes it took in (rebuilt into it and retired)."""

    name: str | None
    rows: int
    shards: int
    seconds: float
    absorbed: int = 0
    ef_search: int | None = None  # the width measured for it, and the recall found there (measured_width)
    recall: float | None = None
    probes: str = OWN_ROWS  # what the width was measured on


def seal(
    folder: Path,
    min_rows: int = 1,
    writer: str = "backfill",
    whole_rows: bool = False,
    storage: str = STORAGE,
    queries: F32 | None = None,
    queries_kind: str = "served",
) -> SealReport:
    """Build one sealed index over the intact shards no sealed index covers, when they hold >= min_rows new ids.

    storage: the graph's coordinates, "float16" (format 3) or "float32" (format 2, what seals wrote before).
    whole_rows: format 1, the graph over the whole rows and no re-rank (what seals wrote before; benches and
    tests compare against it).
    queries: served new-model queries [n, d] to measure the index's width on (measured_width); None: its own rows.
    queries_kind: what they are, in the seal's report and index.json ("served": a traffic export's; "support").

    One seal at a time per segment (it waits for SEGMENT/seal.lock), so two never cover the same shards:
    parts of a parallel backfill that end together seal one after the other, the later one what is left.
    """
    import time

    started = time.perf_counter()
    if queries is not None:
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        dim = read_segment_meta(folder).model.dim
        if queries.ndim != 2 or queries.shape[1] != dim or not len(queries):
            raise InputError(
                f"segment {folder}: {queries.shape[-1]}-d queries, but the segment's rows are {dim}-d (a width is "
                "measured on queries of the segment's model)"
            )
    with _seal_lock(folder):
        return _seal(folder, min_rows, writer, started, whole_rows, storage, queries, queries_kind)


@contextmanager
def _seal_lock(folder: Path) -> Iterator[None]:
    """An exclusive flock on SEGMENT/seal.lock, waited for (a seal takes seconds to minutes); released on exit."""
    with (folder / SEAL_LOCK).open("a", encoding="utf-8") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _seal(
    folder: Path,
    min_rows: int,
    writer: str,
    started: float,
    whole_rows: bool,
    storage: str,
    queries: F32 | None,
    queries_kind: str,
) -> SealReport:
    """seal()'s work, under the seal lock."""
    import time

    catalog = ShardCatalog.of(folder)
    catalog.scan()
    metas = readable_metas(folder)
    cover = choose_cover(metas, {e.name for e in catalog.intact})
    fresh = _uncovered(catalog, cover)
    picked = _first_rows(fresh, _covered_ids(folder, cover))
    new_rows = sum(len(held) for _, held, _ in picked)
    if not fresh or new_rows < max(min_rows, 1):
        return SealReport(None, new_rows, len(fresh), time.perf_counter() - started)
    absorbed = _absorbed(cover, new_rows)
    if absorbed:  # their shards join the fresh ones (name order), each id once over them all
        kept = [m for m in cover if m not in absorbed]
        picked = _first_rows(_uncovered(catalog, kept), _covered_ids(folder, kept))
    ids = np.concatenate([held for _, held, _ in picked])
    vectors = _picked_rows(picked)
    order = np.argsort(ids, kind="stable")
    ids, vectors = ids[order], np.ascontiguousarray(vectors[order])
    basis = None if whole_rows else directions(vectors)
    walked = vectors if basis is None else np.ascontiguousarray(vectors @ basis)  # what the graph's steps read
    graph = _empty_graph(walked.shape[1], float16=basis is not None and storage == STORAGE)
    graph.hnsw.efConstruction = EF_CONSTRUCTION
    graph.add(walked)
    searched = graph if basis is None else ProjectedGraph(graph, basis, vectors)
    width, recall = measured_width(searched, vectors, queries=queries)
    probes = OWN_ROWS if queries is None else f"{min(PROBES, len(queries))} {queries_kind} queries"
    shards = [e.name for e, _, _ in picked]
    name = _publish(folder, graph, basis, vectors, ids, shards, writer, (width, recall, probes))
    _retire_superseded(folder, metas, set(shards))
    seconds = time.perf_counter() - started
    return SealReport(name, int(len(ids)), len(picked), seconds, len(absorbed), width, recall, probes)


def measured_width(index: Any, rows: F32, k: int = 10, queries: F32 | None = None) -> tuple[int, float]:
    """The narrowest efSearch of WIDTHS at which `index` (over `rows`, row numbers) finds RECALL_TARGET of the
    exact top k, and the recall there (the widest width and its recall when none does).

    Given `queries` (served new-model queries: a traffic export's, or a support set's), PROBES of them are
    asked instead and the target is QUERY_RECALL_TARGET: what the queries users send get is measured, not
    read from easier probes through a margin.

    Why measured, not fixed: the recall a given width finds falls as a graph grows (synthetic rows: 0.99 at
    ef 128 over 10^5 rows, 0.957 over 5 x 10^5, docs/backfill.md), so a fixed default kept the documented
    recall at one size only.  The queries are PROBES of the index's own rows, each leaving itself out (its
    top k among the others).  They are easier than queries, the more so the larger the graph: over the
    synthetic rows, caption queries miss about as many of their neighbours as the probes at 10^5 rows and
    twice as many at 5 x 10^5 and 10^6 (captions / probes at ef 384 over 10^6 rows: 0.988 / 0.994; at 512:
    0.993 / 0.996).  So the target is 0.997 of the probes, which leaves queries that miss twice as many at
    0.994.  That is a margin read on one data set; the traffic's own recall is measured where it is served
    (recall_sample.py).  A found row counts when it scores at least the k-th exact score, so tied rows
    count alike.
    """
    if queries is not None:
        return _width_for_queries(index, rows, queries, k)
    n = len(rows)
    if n <= k + 1:
        return WIDTHS[0], 1.0
    picked = np.random.default_rng(0).choice(n, min(PROBES, n), replace=False)
    queries = np.ascontiguousarray(rows[picked], dtype=np.float32)
    exact, order = faiss.knn(queries, rows, k + 1, metric=faiss.METRIC_INNER_PRODUCT)
    # The k-th exact score among the others: the (k+1)-th overall, or the k-th when the query's own row is
    # not among the first k + 1 (a duplicate row outranked it).
    own = (order == picked[:, None]).any(axis=1)
    bar = np.where(own, exact[:, k], exact[:, k - 1]) - 1e-6
    return _narrowest_width(index, queries, k, bar, RECALL_TARGET, own_rows=picked)


def _width_for_queries(index: Any, rows: F32, queries: F32, k: int) -> tuple[int, float]:
    """measured_width over PROBES of these queries, for QUERY_RECALL_TARGET of each one's exact top k."""
    k = min(k, len(rows))
    asked = queries[np.random.default_rng(0).choice(len(queries), min(PROBES, len(queries)), replace=False)]
    asked = np.ascontiguousarray(asked, dtype=np.float32)
    exact, _ = faiss.knn(asked, rows, k, metric=faiss.METRIC_INNER_PRODUCT)
    return _narrowest_width(index, asked, k, exact[:, k - 1] - 1e-6, QUERY_RECALL_TARGET)


def _narrowest_width(
    index: Any, asked: F32, k: int, bar: np.ndarray, target: float, own_rows: I64 | None = None
) -> tuple[int, float]:
    """The narrowest of WIDTHS at which `index` finds `target` of each asked row's exact top k, and the recall there
    (the widest and its recall when none does).  A found row counts when it scores at least the row's `bar` (its
    exact k-th, so tied rows count alike); with `own_rows` (the index's own rows asking) the asker's own row is
    searched past and never counts."""
    recall = 0.0
    for width in WIDTHS:
        scores, found = search_graph(index, asked, k if own_rows is None else k + 1, width)
        counted = found >= 0 if own_rows is None else (found >= 0) & (found != own_rows[:, None])
        recall = float(np.minimum(((scores >= bar[:, None]) & counted).sum(axis=1), k).mean() / k)
        if recall >= target:
            return width, recall
    return WIDTHS[-1], recall


def _empty_graph(width: int, float16: bool) -> Any:
    """The HNSW graph a seal fills: float16 coordinates (format 3), float32 (format 2 and format 1's whole rows)."""
    if float16:
        fp16: Any = faiss.ScalarQuantizer.QT_fp16  # an int to SWIG; faiss's stubs type the argument as the class
        return faiss.IndexHNSWSQ(width, fp16, LINKS, faiss.METRIC_INNER_PRODUCT)
    return faiss.IndexHNSWFlat(width, LINKS, faiss.METRIC_INNER_PRODUCT)


def _uncovered(catalog: ShardCatalog, cover: list[SealedMeta]) -> list[ShardEntry]:
    """The intact shards (name order) none of `cover` holds."""
    covered = set().union(*(m.shards for m in cover)) if cover else set()
    return [e for e in catalog.intact if e.name not in covered]


def _first_rows(entries: list[ShardEntry], seen: I64) -> list[tuple[ShardEntry, I64, I64]]:
    """Per shard (name order): the ids it holds that neither `seen` nor an earlier shard does, and the position of
    each one's first row in it: each id once, as a once-read segment keeps it."""
    picked = []
    for entry in entries:
        ids, first = np.unique(entry.ids, return_index=True)
        keep = ~sorted_member(ids, seen)
        picked.append((entry, ids[keep], first[keep]))
        seen = sorted_union(seen, ids[keep])
    return picked


def _picked_rows(picked: list[tuple[ShardEntry, I64, I64]]) -> F32:
    """The rows _first_rows picked, in its order."""
    parts = []
    for entry, _, at in picked:
        assert entry.vectors is not None  # an intact entry carries its rows
        parts.append(np.asarray(entry.vectors[at], dtype=np.float32))
    return np.concatenate(parts)


def _absorbed(cover: list[SealedMeta], fresh_rows: int) -> list[SealedMeta]:
    """The served indexes a seal of `fresh_rows` new rows takes in: smallest first, each while it is no larger
    than the rows gathered so far (size tiers; the module's docstring says why)."""
    taken, gathered = [], fresh_rows
    for meta in sorted(cover, key=lambda m: (m.rows, m.name)):
        if meta.rows > gathered:
            break
        taken.append(meta)
        gathered += meta.rows
    return taken


def _retire_superseded(folder: Path, metas: list[SealedMeta], shards: set[str]) -> None:
    """Remove the indexes (of those read before the seal) whose shards the one just published holds, as the cover
    prefers it: each renamed to a hidden name first, which no reader lists, then deleted.  An unreadable index is
    not among them: it is the operator's to look at (backfill repair), not a seal's to delete."""
    for meta in metas:
        if meta.shards <= shards:
            hidden = folder / INDEXES / f".{meta.name}.retired"
            (folder / INDEXES / meta.name).rename(hidden)
            shutil.rmtree(hidden, ignore_errors=True)


def readable_metas(folder: Path) -> list[SealedMeta]:
    """index.json of every sealed index that has a readable one (a damaged one covers nothing)."""
    metas = []
    for name in sealed_names(folder):
        try:
            metas.append(read_meta(folder, name))
        except ArtifactError:
            continue
    return metas


def _covered_ids(folder: Path, cover: list[SealedMeta]) -> I64:
    """Sorted ids held by the covering indexes (read from their ids.npy)."""
    parts = [np.load(folder / INDEXES / m.name / IDS_FILE, allow_pickle=False) for m in cover]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)


def _publish(
    folder: Path,
    graph: Any,
    basis: F32 | None,
    rows: F32,
    ids: I64,
    shards: list[str],
    writer: str,
    measured: tuple[int, float, str],
) -> str:
    """Write a sealed index hidden, manifest last, then one rename (layout.publish_folder); returns its name.
    measured: the efSearch its readers search at by default, the recall its seal found there, and on what."""

    float16 = isinstance(graph, faiss.IndexHNSWSQ)

    def fill(tmp: Path) -> None:
        faiss.write_index(graph, str(tmp / INDEX_FILE))
        fsync_path(tmp / INDEX_FILE)  # faiss does not: the index is renamed into place only once on disk
        if basis is not None:  # formats 2 and 3: the graph walks the basis's coordinates, the rows re-rank
            save(tmp / BASIS_FILE, basis)
            save(tmp / ROWS_FILE, rows)
        save(tmp / IDS_FILE, ids)
        document = {
            "format_version": 1 if basis is None else FORMAT if float16 else 2,
            "rows": int(len(ids)),
            "shards": shards,
            "directions": int(rows.shape[1] if basis is None else basis.shape[1]),
            "links": LINKS,
            "ef_construction": EF_CONSTRUCTION,
            "ef_search": measured[0],
            "recall_at_ef_search": round(measured[1], 4),  # recall@10 of exact, PROBES asking
            "width_probes": measured[2],  # its own rows, or served queries (measured_width)
            "dim": int(graph.d),
            "storage": STORAGE if float16 else "float32",
            "writer": writer,
            "created_at": datetime.now(UTC).isoformat(timespec="milliseconds"),
        }
        write_json_durably(tmp / INDEX_JSON, document)

    return publish_folder(folder / INDEXES, fill, "a sealed index")
