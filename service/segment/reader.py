"""The service's view of a segment: every published shard in memory, searchable, refreshed as shards appear.

A `Snapshot` is immutable: blocks of rows (each one faiss inner-product index), their gallery ids,
and the sorted set of moved ids (an index.base.Exclusion, which the old gallery's search skips).
`Segment.refresh()` reads the shards and sealed indexes published since the last snapshot and swaps
in a new snapshot in one assignment; a search holds the snapshot it started with, so a refresh never
disturbs it.  Shards are read through a ShardCatalog (segment/catalog.py), as every other reader
reads them.  The blocks: first the sealed HNSW indexes the folder's cover names (segment/sealed.py),
then exact flat blocks over the rows they do not cover (an id moved by two writers at once keeps
its first row); new shards form a new exact block, and past MAX_BLOCKS the two smallest are merged,
so a search runs a bounded number of scans.  Which rows are approximate and which exact depends on
the folder alone, never on the order of loading.  A damaged shard or sealed index (manifest, shape,
values) is refused with one logged line, kept out, and not read again; the rest keeps serving.
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
from service.rows import F32, I64
from service.segment.catalog import ShardCatalog, ShardEntry, sorted_union
from service.segment.layout import (
    SEGMENT_JSON,
    GalleryRef,
    SegmentMeta,
    check_same,
    create_segment,
    read_segment_meta,
    write_shard,
)
from service.segment.sealed import (
    INDEXES,
    ProjectedGraph,
    Sealed,
    SealedMeta,
    choose_cover,
    load_sealed,
    read_meta,
    sealed_names,
    search_graph,
)

MAX_BLOCKS = 8
log = logging.getLogger("nobackfill.segment")


@dataclass(frozen=True)
class Indexing:
    """How the segment is searched: its sealed indexes at ef_search, the rows they do not cover exactly.

    exact: every row searched exactly, the sealed indexes left unread (what the exactness tests and an
    operator who wants the re-indexed answer to the last digit use; its cost grows with the rows,
    about 20 ms a query over 100,000 rows of 768 floats here).
    """

    exact: bool = False
    ef_search: int | None = None  # index.segment_ef_search; None: each sealed index's own, measured by its seal


@dataclass(frozen=True)
class Block:
    """Rows searched together: one inner-product index (flat or HNSW) and the gallery id of each row, ascending."""

    index: Any
    ids: I64  # sorted, so an id's row is found by bisection

    @classmethod
    def of(cls, vectors: F32, ids: I64) -> Block:
        """An exact (flat inner-product) block over these rows, copied into faiss in id order."""
        order = np.argsort(ids, kind="stable")
        flat = faiss.IndexFlatIP(vectors.shape[1])
        flat.add(np.ascontiguousarray(vectors[order], dtype=np.float32))
        return cls(flat, ids[order])

    def search(self, queries: F32, k: int, ef_search: int | None, exact: bool = False) -> tuple[F32, I64]:
        """The index's top-k (row numbers), a graph at ef_search when one is given; exact: every row scored (a
        sealed graph's rows read whole: what recall_sample.py compares the served answers with)."""
        if exact and not isinstance(self.index, faiss.IndexFlat):
            rows = self.index.rows if isinstance(self.index, ProjectedGraph) else self.vectors()
            found_exact: tuple[F32, I64] = faiss.knn(queries, rows, k, metric=faiss.METRIC_INNER_PRODUCT)
            return found_exact
        if isinstance(self.index, faiss.IndexFlat):  # exact: no width to set
            found: tuple[F32, I64] = self.index.search(queries, k)
            return found
        return search_graph(self.index, queries, k, ef_search)

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
    sealed_blocks: int = 0  # the first this many blocks are sealed indexes (approximate), the rest exact

    @property
    def count(self) -> int:
        """Moved items (distinct ids)."""
        return int(len(self.moved))

    def search(self, queries: F32, k: int, ef_search: int | None = None, exact: bool = False) -> tuple[F32, I64]:
        """Top-k inner products over every block: (scores [b, k], ids [b, k]; -1 / -inf pad a short list).

        ef_search: the sealed graphs' width for this call (None: Indexing.ef_search); exact blocks ignore it.
        exact: every row of every block scored, the sealed graphs' too (slow: for measuring them).
        """
        n = len(queries)
        if not self.blocks or k < 1:
            return np.full((n, max(k, 0)), -np.inf, dtype=np.float32), np.full((n, max(k, 0)), -1, dtype=np.int64)
        q = np.ascontiguousarray(queries, dtype=np.float32)
        parts_s, parts_i = [], []
        for block in self.blocks:
            kk = min(k, block.index.ntotal)
            scores, rows = block.search(q, kk, ef_search, exact)
            missing = rows < 0  # a graph search may find fewer than kk rows: faiss pads with -1
            parts_s.append(np.where(missing, -np.inf, scores))
            parts_i.append(np.where(missing, -1, block.ids[np.maximum(rows, 0)]))
        if len(parts_s) == 1 and parts_s[0].shape[1] == k:  # one block: faiss's list is the answer, sorted
            return parts_s[0].astype(np.float32), parts_i[0].astype(np.int64)
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


def _exact_blocks(entries: list[ShardEntry], served: I64) -> tuple[list[Block], I64]:
    """One exact block over these shards' rows less the ids already `served` (an id keeps its first row),
    and the served ids with the new ones (sorted).

    `served` is kept by the caller from refresh to refresh, so a refresh's cost follows its new rows,
    not every row served (sorting them all again took 0.5-0.8 s a refresh beside 500,000 sealed rows).
    """
    ids_parts, vec_parts = [], []
    for entry in entries:
        assert entry.vectors is not None  # an intact entry carries its rows
        ids, first = np.unique(entry.ids, return_index=True)  # an id twice in one shard: its first row
        new = ~sorted_member(ids, served)
        if new.any():
            ids_parts.append(ids[new])
            vec_parts.append(np.asarray(entry.vectors[first[new]], dtype=np.float32))
            served = sorted_union(served, ids[new])
    if not ids_parts:
        return [], served
    return [Block.of(np.concatenate(vec_parts), np.concatenate(ids_parts))], served


def _merge_smallest(blocks: list[Block]) -> list[Block]:
    """Merge the adjacent pair of exact blocks with the fewest rows into one."""
    sizes = [blocks[i].index.ntotal + blocks[i + 1].index.ntotal for i in range(len(blocks) - 1)]
    i = int(np.argmin(sizes))
    a, b = blocks[i], blocks[i + 1]
    merged = Block.of(np.concatenate([a.vectors(), b.vectors()]), np.concatenate([a.ids, b.ids]))
    return [*blocks[:i], merged, *blocks[i + 2 :]]


class Segment:
    """A segment folder as the service serves it (segment/base.py's SegmentStore): the snapshot, its refresh."""

    backend = "folder"

    def __init__(
        self, folder: Path, meta: SegmentMeta, *, created: bool = True, indexing: Indexing | None = None
    ) -> None:
        self.folder = folder
        self.meta = meta
        self.indexing = indexing or Indexing()
        self.created = created  # False: no segment.json yet; each refresh looks for it
        self.snapshot = Snapshot(meta.dim)
        self._catalog = ShardCatalog(folder, meta.dim)  # each shard checked once, as every other reader checks it
        self._metas: dict[str, SealedMeta] = {}  # sealed indexes seen, by name
        self._sealed: dict[str, Sealed] = {}  # the ones loaded (served while in the cover)
        self.refused_indexes: dict[str, str] = {}  # sealed index name -> why it is not served
        self._growing: list[Block] = []  # exact blocks over the rows no served sealed index covers
        self._served: I64 = np.zeros(0, dtype=np.int64)  # every id the blocks hold, sorted (an id keeps its first row)
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
    def where(self) -> str:
        """The folder."""
        return str(self.folder)

    @property
    def model(self) -> ModelIdentity:
        """The new model (segment.json's, or the one expected before it exists)."""
        return self.meta.model

    @property
    def dim(self) -> int:
        """The new model's width."""
        return self.meta.dim

    @property
    def gallery_items(self) -> int:
        """Items of the gallery beside it."""
        return self.meta.gallery.ntotal

    @property
    def parts(self) -> int:
        """Intact shards served."""
        return len(self.snapshot.shards)

    @property
    def refused(self) -> dict[str, str]:
        """Shard name -> why it was refused (its items stay on the old gallery)."""
        return self._catalog.refused

    @property
    def coverage(self) -> float:
        """Share of the gallery's items that have moved."""
        return self.snapshot.count / self.meta.gallery.ntotal

    def refresh(self) -> list[str]:
        """Load the shards and sealed indexes published since the last refresh, swap in the new snapshot.

        Returns the names of the shards newly served.  The sealed indexes served (the cover) are a
        function of the folder alone (sealed.choose_cover), and the rows they do not cover are searched
        exactly, so the answers do not depend on the order in which shards were loaded.
        """
        with self._refresh_lock:  # one refresh at a time; searches never wait on it
            if not self.created and not self._found_meta():
                return []
            current = self.snapshot
            fresh = self._catalog.scan()
            for entry in fresh:
                if entry.refused is not None:
                    log.error("segment %s: shard refused, the rest keeps serving: %s", self.folder, entry.refused)
            cover_changed = False if self.indexing.exact else self._update_cover()
            loaded = [e.name for e in fresh if e.intact]
            if not loaded and not cover_changed:
                return []
            covered = self._covered_shards()
            if cover_changed:  # rows moved between the exact part and the sealed part: rebuild the exact part
                sealed_ids = [s.ids for s in self._sealed.values()]  # (the old exact blocks' rows go back in)
                served = np.unique(np.concatenate(sealed_ids)) if sealed_ids else np.zeros(0, dtype=np.int64)
                exact, self._served = _exact_blocks([e for e in self._catalog.intact if e.name not in covered], served)
                self._growing = exact
            else:
                landed = [e for e in fresh if e.intact and e.name not in covered]
                exact, self._served = _exact_blocks(landed, self._served)
                self._growing += exact
            while len(self._growing) > MAX_BLOCKS:
                self._growing = _merge_smallest(self._growing)
            sealed = tuple(Block(s.index, s.ids) for s in self._sealed.values())
            moved = self._catalog.moved()
            exclusion = current.exclusion if np.array_equal(moved, current.moved) else Exclusion(moved)
            shards = tuple(e.name for e in self._catalog.intact)
            self.snapshot = Snapshot(current.dim, (*sealed, *self._growing), shards, moved, exclusion, len(sealed))
            return loaded

    def write(self, ids: I64, rows: F32, writer: str) -> None:
        """One shard of these rows (layout.write_shard), creating the segment first when the folder holds none."""
        create_segment(self.folder, self.meta.model, self.meta.gallery)  # no-op once it exists
        write_shard(self.folder, ids, rows, self.meta.model, writer)

    def close(self) -> None:
        """Nothing to release: the shards are memory-mapped read-only."""

    def _update_cover(self) -> bool:
        """Read new sealed indexes, choose the cover, load what it adds; whether the served indexes changed."""
        listed = sealed_names(self.folder)
        self._metas = {name: meta for name, meta in self._metas.items() if name in listed}  # retired: gone
        for name in listed:
            if name in self._metas or name in self.refused_indexes:
                continue
            try:
                self._metas[name] = read_meta(self.folder, name)
            except ArtifactError as exc:
                self._refuse_index(name, exc.message)
        before = set(self._sealed)
        intact = {e.name for e in self._catalog.intact}
        while True:  # an index that fails to load is refused, and the cover chosen again without it
            cover = choose_cover(list(self._metas.values()), intact)
            missing = [m for m in cover if m.name not in self._sealed]
            if not missing:
                break
            for meta in missing:
                try:
                    self._sealed[meta.name] = load_sealed(self.folder, meta, self.meta.dim, self.indexing.ef_search)
                except ArtifactError as exc:
                    del self._metas[meta.name]
                    self._refuse_index(meta.name, exc.message)
        wanted = {m.name for m in cover}
        self._sealed = {name: self._sealed[name] for name in sorted(wanted)}
        return set(self._sealed) != before

    def _refuse_index(self, name: str, why: str) -> None:
        """A sealed index that is not served: its shards stay in the exact part."""
        if not (self.folder / INDEXES / name).is_dir():  # retired by a seal that took it in meanwhile: no damage
            self._metas.pop(name, None)
            return
        self.refused_indexes[name] = why
        log.error("segment %s: sealed index refused, its rows are searched exactly: %s", self.folder, why)

    def _covered_shards(self) -> set[str]:
        """The shards the served sealed indexes hold."""
        return set().union(*(s.meta.shards for s in self._sealed.values())) if self._sealed else set()

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
            "sealed_indexes": snap.sealed_blocks,
            "sealed_rows": sum(block.index.ntotal for block in snap.blocks[: snap.sealed_blocks]),
            "exact": self.indexing.exact,
            "ef_search": self.indexing.ef_search,  # None: each sealed index's own; a request's overrides it
            # What each served sealed index searches at when a request names no width (name: efSearch).
            "sealed_ef_search": {name: s.ef_search for name, s in self._sealed.items()},
            "refused_shards": dict(self.refused),
            "refused_indexes": dict(self.refused_indexes),
        }


def check_served(meta: SegmentMeta, model: ModelIdentity, gallery: GalleryRef, folder: Path) -> None:
    """layout.check_same for a segment the service opens: another model or gallery is an ArtifactError line."""
    try:
        check_same(meta, model, gallery, folder)
    except InputError as exc:
        raise ArtifactError(exc.message) from exc
