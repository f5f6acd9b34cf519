"""The service's view of a segment: every published shard in memory, searchable, refreshed as shards appear.

A `Snapshot` is immutable: blocks of rows (each one faiss inner-product index), their gallery ids,
and the sorted set of moved ids (an index.base.Exclusion, which the old gallery's search skips).
`Segment.refresh()` reads the shards published since the last snapshot, drops rows whose id is
already in (an id moved by two writers at once keeps its first row), and swaps in a new snapshot in
one assignment; a search holds the snapshot it started with, so a refresh never disturbs it.
Shards are read through a ShardCatalog (segment/catalog.py), as every other reader reads them.  New
shards form a new block; past MAX_BLOCKS the two smallest neighbours are merged, so a search runs a
bounded number of scans: exact below Indexing.exact_rows rows, an HNSW graph above.  A damaged
shard (manifest, shape, values) is refused with one logged line, kept out, and not read again; the
others keep serving.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt

from service.encoders.identity import ModelIdentity
from service.errors import ArtifactError, InputError
from service.index.base import Exclusion, sorted_member
from service.segment.catalog import ShardCatalog
from service.segment.layout import (
    SEGMENT_JSON,
    GalleryRef,
    SegmentMeta,
    check_same,
    read_segment_meta,
)

MAX_BLOCKS = 8
log = logging.getLogger("nobackfill.segment")

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Indexing:
    """How a block is indexed: exact (flat) below exact_rows, an HNSW graph above it (searched at ef_search).

    A flat scan costs time in proportion to the rows (about 20 ms for 100,000 rows of 768 floats on
    one query here), so a segment growing towards the whole gallery would slow every hybrid search.
    Of the indexes measured on 100,000 synthetic new-space rows (docs/backfill.md), an HNSW graph of
    32 links per row searched at ef 32 was the fastest at the best recall (0.47 ms, recall@10 0.91
    against exact, where IVF-Flat with sqrt(n) lists at nprobe 16 took 1.4 ms for 0.71), it needs no
    training on the block's distribution, and it keeps each row, so a merge reads them back exactly.
    """

    exact_rows: int = 10_000
    ef_search: int = 32
    links: int = 32  # HNSW M: edges per row (more: better recall, slower build, more memory)

    def index_of(self, vectors: F32) -> Any:
        """A faiss inner-product index over `vectors` (copied in): flat, or an HNSW graph."""
        n, dim = vectors.shape
        data = np.ascontiguousarray(vectors, dtype=np.float32)
        if n < self.exact_rows:
            flat = faiss.IndexFlatIP(dim)
            flat.add(data)
            return flat
        graph = faiss.IndexHNSWFlat(dim, self.links, faiss.METRIC_INNER_PRODUCT)
        graph.hnsw.efConstruction = 40
        graph.add(data)
        graph.hnsw.efSearch = self.ef_search
        return graph


@dataclass(frozen=True)
class Block:
    """Rows searched together: one inner-product index (flat or HNSW) and the gallery id of each row, ascending."""

    index: Any
    ids: I64  # sorted, so an id's row is found by bisection

    @classmethod
    def of(cls, vectors: F32, ids: I64, indexing: Indexing | None = None) -> Block:
        """A block over these rows (copied into faiss in id order), indexed as `indexing` says."""
        order = np.argsort(ids, kind="stable")
        return cls((indexing or Indexing()).index_of(vectors[order]), ids[order])

    def vectors(self) -> F32:
        """The block's rows back out of faiss (for a merge)."""
        return np.asarray(self.index.reconstruct_n(0, self.index.ntotal), dtype=np.float32)

    def rows_of(self, ids: I64) -> tuple[npt.NDArray[np.bool_], F32]:
        """Which of `ids` this block holds, and their rows (in the order of the found ones)."""
        pos = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)
        found = self.ids[pos] == ids
        if not found.any():
            return found, np.zeros((0, self.index.d), dtype=np.float32)
        return found, np.asarray(self.index.reconstruct_batch(pos[found]), dtype=np.float32)


@dataclass(frozen=True)
class Snapshot:
    """One immutable state of the segment: its blocks, the shards they hold and the moved ids."""

    dim: int
    blocks: tuple[Block, ...] = ()
    shards: tuple[str, ...] = ()
    moved: I64 = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # sorted
    exclusion: Exclusion | None = None  # what the old gallery's search skips; None while nothing has moved

    @property
    def count(self) -> int:
        """Moved items (distinct ids)."""
        return int(len(self.moved))

    def search(self, queries: F32, k: int) -> tuple[F32, I64]:
        """Top-k inner products over every block: (scores [b, k], ids [b, k]; -1 / -inf pad a short list)."""
        n = len(queries)
        if not self.blocks or k < 1:
            return np.full((n, max(k, 0)), -np.inf, dtype=np.float32), np.full((n, max(k, 0)), -1, dtype=np.int64)
        q = np.ascontiguousarray(queries, dtype=np.float32)
        parts_s, parts_i = [], []
        for block in self.blocks:
            kk = min(k, block.index.ntotal)
            scores, rows = block.index.search(q, kk)
            parts_s.append(scores)
            parts_i.append(block.ids[rows])
        scores = np.concatenate(parts_s, axis=1)
        ids = np.concatenate(parts_i, axis=1)
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        top_s = np.take_along_axis(scores, order, axis=1)
        top_i = np.take_along_axis(ids, order, axis=1)
        if top_s.shape[1] < k:  # fewer rows than k in the whole segment
            pad = k - top_s.shape[1]
            top_s = np.pad(top_s, ((0, 0), (0, pad)), constant_values=-np.inf)
            top_i = np.pad(top_i, ((0, 0), (0, pad)), constant_values=-1)
        return top_s.astype(np.float32), top_i.astype(np.int64)

    def contains(self, ids: I64) -> npt.NDArray[np.bool_]:
        """Which of `ids` have moved."""
        return sorted_member(ids, self.moved)

    def rows_of(self, ids: I64) -> tuple[npt.NDArray[np.bool_], F32]:
        """Which of `ids` have moved, and the new-model row of each (zero where not moved): what the cascade reads."""
        found = np.zeros(len(ids), dtype=bool)
        rows = np.zeros((len(ids), self.dim), dtype=np.float32)
        for block in self.blocks:  # an id is in one block at most (refresh keeps its first row)
            hit, vectors = block.rows_of(ids)
            rows[hit] = vectors
            found |= hit
        return found, rows


def _merge_smallest(blocks: list[Block], indexing: Indexing) -> list[Block]:
    """Merge the adjacent pair with the fewest rows into one block."""
    sizes = [blocks[i].index.ntotal + blocks[i + 1].index.ntotal for i in range(len(blocks) - 1)]
    i = int(np.argmin(sizes))
    a, b = blocks[i], blocks[i + 1]
    merged = Block.of(np.concatenate([a.vectors(), b.vectors()]), np.concatenate([a.ids, b.ids]), indexing)
    return [*blocks[:i], merged, *blocks[i + 2 :]]


class Segment:
    """A segment folder opened read-only by the service: the current snapshot and how to refresh it."""

    def __init__(
        self, folder: Path, meta: SegmentMeta, *, created: bool = True, indexing: Indexing | None = None
    ) -> None:
        self.folder = folder
        self.meta = meta
        self.indexing = indexing or Indexing()
        self.created = created  # False: no segment.json yet; each refresh looks for it
        self.snapshot = Snapshot(meta.dim)
        self._catalog = ShardCatalog(folder, meta.dim)  # each shard checked once, as every other reader checks it
        self._refresh_lock = threading.Lock()

    @classmethod
    def open(cls, folder: Path | str, indexing: Indexing | None = None) -> Segment:
        """Read segment.json and every shard now; ArtifactError in one line when the folder is no segment."""
        folder = Path(folder)
        segment = cls(folder, read_segment_meta(folder), indexing=indexing)
        segment.refresh()
        return segment

    @classmethod
    def beside(
        cls, folder: Path | str, model: ModelIdentity, gallery: GalleryRef, indexing: Indexing | None = None
    ) -> Segment:
        """The service's segment for this new model and gallery; a folder not created yet serves as empty.

        A segment of another model or gallery is refused in one line (ArtifactError).
        """
        segment = cls(Path(folder), SegmentMeta(model, gallery, ""), created=False, indexing=indexing)
        segment.refresh()
        return segment

    @property
    def refused(self) -> dict[str, str]:
        """Shard name -> why it was refused (its items stay on the old gallery)."""
        return self._catalog.refused

    @property
    def coverage(self) -> float:
        """Share of the gallery's items that have moved."""
        return self.snapshot.count / self.meta.gallery.ntotal

    def refresh(self) -> list[str]:
        """Load the shards published since the last refresh and swap in the new snapshot; returns their names."""
        with self._refresh_lock:  # one refresh at a time; searches never wait on it
            if not self.created and not self._found_meta():
                return []
            current = self.snapshot
            fresh = self._catalog.scan()
            if not fresh:
                return []
            ids_parts, vec_parts, loaded = [], [], []
            moved = current.moved
            for entry in fresh:
                if entry.refused is not None:
                    log.error("segment %s: shard refused, the rest keeps serving: %s", self.folder, entry.refused)
                    continue
                ids, keep = np.unique(entry.ids, return_index=True)  # an id twice in one shard: its first row
                new = ~sorted_member(ids, moved)
                ids = ids[new]
                loaded.append(entry.name)
                if len(ids):
                    assert entry.vectors is not None  # an intact entry carries its rows
                    ids_parts.append(ids)
                    vec_parts.append(np.asarray(entry.vectors[keep[new]], dtype=np.float32))
                    moved = np.union1d(moved, ids)
            blocks = list(current.blocks)
            if ids_parts:
                blocks.append(Block.of(np.concatenate(vec_parts), np.concatenate(ids_parts), self.indexing))
                while len(blocks) > MAX_BLOCKS:
                    blocks = _merge_smallest(blocks, self.indexing)
            exclusion = current.exclusion if len(moved) == len(current.moved) else Exclusion(moved)
            self.snapshot = Snapshot(current.dim, tuple(blocks), (*current.shards, *loaded), moved, exclusion)
            return loaded

    def _found_meta(self) -> bool:
        """Whether segment.json has appeared (checked against the expected model and gallery)."""
        if not (self.folder / SEGMENT_JSON).is_file():
            return False
        found = read_segment_meta(self.folder)
        check_served(found, self.meta.model, self.meta.gallery, self.folder)
        self.meta, self.created = found, True
        log.info("segment %s: found (%s)", self.folder, found.model.model_id)
        return True

    def describe(self) -> dict[str, Any]:
        """What /v1/info reports: the model, the coverage and the shards."""
        snap = self.snapshot
        return {
            "path": str(self.folder),
            "created": self.created,
            "model": self.meta.model.as_dict(),
            "moved": snap.count,
            "gallery_items": self.meta.gallery.ntotal,
            "coverage": round(self.coverage, 6),
            "shards": len(snap.shards),
            "blocks": len(snap.blocks),
            "graph_blocks": sum(1 for block in snap.blocks if block.index.ntotal >= self.indexing.exact_rows),
            "refused_shards": dict(self.refused),
        }


def check_served(meta: SegmentMeta, model: ModelIdentity, gallery: GalleryRef, folder: Path) -> None:
    """layout.check_same for a segment the service opens: another model or gallery is an ArtifactError line."""
    try:
        check_same(meta, model, gallery, folder)
    except InputError as exc:
        raise ArtifactError(exc.message) from exc
