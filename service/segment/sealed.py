"""Sealed indexes: HNSW graphs built once over published shards, stored in the segment, loaded by every reader.

    SEGMENT/indexes/<name>/
        index.faiss     faiss IndexHNSWFlat (inner product) over the rows, in ascending gallery-id order
        ids.npy         int64 [n]: the gallery id of each row, ascending
        index.json      the shards it covers, rows, links, efConstruction, dim, writer, time
        manifest.json   size and sha256 of the three (service/manifest.py)
    SEGMENT/indexes/.<name>.tmp     being written (readers never look at it)

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
it; ids a covering index holds already are left out).  Which sealed indexes a reader serves (the
cover) is a function of the folder alone: in name order, each index whose shards are all intact and
none covered by one taken before.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from service.errors import ArtifactError
from service.index.base import sorted_member
from service.json_file import read_json_object
from service.manifest import verify_manifest, write_json_durably
from service.rows import I64
from service.segment.catalog import ShardCatalog
from service.segment.layout import fsync_path, publish_folder, save

INDEXES = "indexes"
SEAL_LOCK = "seal.lock"
INDEX_FILE = "index.faiss"
IDS_FILE = "ids.npy"
INDEX_JSON = "index.json"
LINKS = 32  # HNSW M: edges per row (docs/backfill.md measured 16, 32 and their recall)
EF_CONSTRUCTION = 40


@dataclass(frozen=True)
class SealedMeta:
    """What index.json says: the name, the shards it covers and its row count."""

    name: str
    shards: frozenset[str]
    rows: int


@dataclass(frozen=True)
class Sealed:
    """A loaded sealed index: the faiss graph and the gallery id of each of its rows (ascending)."""

    meta: SealedMeta
    index: Any
    ids: I64


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
    return SealedMeta(name, frozenset(shards), rows)


def choose_cover(metas: list[SealedMeta], intact: set[str]) -> list[SealedMeta]:
    """The sealed indexes a reader serves: in name order, each whose shards are all intact and not yet covered."""
    taken: list[SealedMeta] = []
    covered: set[str] = set()
    for meta in sorted(metas, key=lambda m: m.name):
        if meta.shards <= intact and not meta.shards & covered:
            taken.append(meta)
            covered |= meta.shards
    return taken


def load_sealed(folder: Path, meta: SealedMeta, dim: int, ef_search: int) -> Sealed:
    """Read and check one sealed index (manifest, ids, dim, count); ArtifactError in one line naming it."""
    path = folder / INDEXES / meta.name
    if verify_manifest(path) is None:
        raise ArtifactError(f"sealed index {path}: manifest.json is missing")
    try:
        ids = np.load(path / IDS_FILE, allow_pickle=False)
        index = faiss.read_index(str(path / INDEX_FILE))
    except (OSError, ValueError, RuntimeError) as exc:
        raise ArtifactError(f"sealed index {path}: unreadable ({exc})") from exc
    if ids.dtype != np.int64 or ids.ndim != 1 or len(ids) != meta.rows or index.ntotal != meta.rows:
        raise ArtifactError(f"sealed index {path}: {meta.rows} rows named, {len(ids)} ids and {index.ntotal} rows held")
    if index.d != dim or not isinstance(index, faiss.IndexHNSWFlat) or np.any(np.diff(ids) <= 0):
        raise ArtifactError(f"sealed index {path}: not an HNSW index of dim {dim} over ascending ids")
    index.hnsw.efSearch = ef_search
    return Sealed(meta, index, ids)


@dataclass(frozen=True)
class SealReport:
    """What a seal did: the index's name (None when nothing was sealed), rows and shards covered, seconds."""

    name: str | None
    rows: int
    shards: int
    seconds: float


def seal(folder: Path, min_rows: int = 1, writer: str = "backfill") -> SealReport:
    """Build one sealed index over the intact shards no sealed index covers, when they hold >= min_rows new ids.

    One seal at a time per segment (it waits for SEGMENT/seal.lock), so two never cover the same shards:
    parts of a parallel backfill that end together seal one after the other, the later one what is left.
    """
    import time

    started = time.perf_counter()
    with _seal_lock(folder):
        return _seal(folder, min_rows, writer, started)


@contextmanager
def _seal_lock(folder: Path) -> Iterator[None]:
    """An exclusive flock on SEGMENT/seal.lock, waited for (a seal takes seconds to minutes); released on exit."""
    with (folder / SEAL_LOCK).open("a", encoding="utf-8") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _seal(folder: Path, min_rows: int, writer: str, started: float) -> SealReport:
    """seal()'s work, under the seal lock."""
    import time

    catalog = ShardCatalog.of(folder)
    catalog.scan()
    cover = choose_cover(_readable_metas(folder), {e.name for e in catalog.intact})
    covered_shards = set().union(*(m.shards for m in cover)) if cover else set()
    covered_ids = _covered_ids(folder, cover)
    fresh = [e for e in catalog.intact if e.name not in covered_shards]
    ids_parts, row_parts = [], []
    seen = covered_ids
    for entry in fresh:  # name order: an id in two shards keeps the first row, as a once-read segment does
        assert entry.vectors is not None
        ids, first = np.unique(entry.ids, return_index=True)
        keep = ~sorted_member(ids, seen)
        ids_parts.append(ids[keep])
        row_parts.append(np.asarray(entry.vectors[first[keep]], dtype=np.float32))
        seen = np.union1d(seen, ids[keep])
    rows = sum(len(p) for p in ids_parts)
    if not fresh or rows < max(min_rows, 1):
        return SealReport(None, rows, len(fresh), time.perf_counter() - started)
    ids = np.concatenate(ids_parts)
    vectors = np.concatenate(row_parts)
    order = np.argsort(ids, kind="stable")
    ids, vectors = ids[order], np.ascontiguousarray(vectors[order])
    graph = faiss.IndexHNSWFlat(vectors.shape[1], LINKS, faiss.METRIC_INNER_PRODUCT)
    graph.hnsw.efConstruction = EF_CONSTRUCTION
    graph.add(vectors)
    name = _publish(folder, graph, ids, [e.name for e in fresh], writer)
    return SealReport(name, int(len(ids)), len(fresh), time.perf_counter() - started)


def _readable_metas(folder: Path) -> list[SealedMeta]:
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


def _publish(folder: Path, graph: Any, ids: I64, shards: list[str], writer: str) -> str:
    """Write a sealed index hidden, manifest last, then one rename (layout.publish_folder); returns its name."""

    def fill(tmp: Path) -> None:
        faiss.write_index(graph, str(tmp / INDEX_FILE))
        fsync_path(tmp / INDEX_FILE)  # faiss does not: the index is renamed into place only once on disk
        save(tmp / IDS_FILE, ids)
        document = {
            "format_version": 1,
            "rows": int(len(ids)),
            "shards": shards,
            "links": LINKS,
            "ef_construction": EF_CONSTRUCTION,
            "dim": int(graph.d),
            "writer": writer,
            "created_at": datetime.now(UTC).isoformat(timespec="milliseconds"),
        }
        write_json_durably(tmp / INDEX_JSON, document)

    return publish_folder(folder / INDEXES, fill, "a sealed index")
