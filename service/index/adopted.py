"""A FAISS index file the user built, adopted as the frozen gallery without being rewritten, and served.

    nobackfill gallery adopt INDEX_FILE --out GALLERY_DIR --model-id ID [--ids IDS.npy] [--metric ip|l2]

The folder holds the user's index as `index.faiss`, a hard link to their file when it lies on the
same filesystem (no byte is copied or rewritten; and if they later replace their file by a rename,
ours still names the bytes that were adopted, which a symlink would not), a copy otherwise (said in
one line).  `gallery.json` records what was adopted (kind "adopted", the index's type, metric, dim,
count, its sha256) and the old model's id; `manifest.json` signs the folder as for a built gallery,
and every start checks the index against the sha256 as it does a built one.

What is served: IVF (Flat, PQ, SQ, ...), HNSW and Flat indexes, each with or without IndexIDMap /
IDMap2, by inner product or by L2.  A request's nprobe reaches an IVF index (bounded by its nlist);
an HNSW index searches at index.adopted_ef_search, or unset at the efSearch stored in the file (at
least k either way).  The labels the index returns are the gallery ids, or, with `--ids`, positions
into IDS.npy (one int64 id per row the index holds, in the order they were added).  An L2 index must
hold unit rows, as the head's queries are: its squared distance d then ranks as the cosine, reported
as 1 - d / 2, so hybrid's merge and the calibration read one scale.  Moved items (hybrid search) are
left out with a faiss id selector, which every one of these index types honours.

`gallery eval GALLERY_DIR` measures an adopted index against exact search per nprobe or efSearch
(scoring/adopted_eval.py), and `NOBACKFILL_INDEX__ADOPTED_EF_SEARCH` sets an HNSW index's width without
touching the file.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt

import service
from service.atomic_dir import readable_by_others, staging
from service.errors import ArtifactError, InputError
from service.index.artifact import INDEX_NAME, META_NAME, read_checked_meta, write_meta
from service.index.base import Exclusion, checked_queries, cosine_of_l2
from service.manifest import sha256_of
from service.rows import F32, I64

KIND = "adopted"
IDS_NAME = "ids.npy"
METRICS = {faiss.METRIC_INNER_PRODUCT: "ip", faiss.METRIC_L2: "l2"}
_UNIT_SAMPLE = 256  # rows whose norm an L2 index is checked on
_UNIT_TOLERANCE = 0.02  # a PQ code's reconstruction is a little off the row it encodes


def describe_index(index: Any) -> dict[str, Any]:
    """What kind of index this is: its family (ivf, hnsw, flat), whether it maps ids, nlist and metric."""
    inner = inner_index(index)
    id_map = isinstance(faiss.downcast_index(index), faiss.IndexIDMap)  # IDMap2 is one too
    family, nlist = None, 0
    try:
        nlist = int(faiss.extract_index_ivf(inner).nlist)
        family = "ivf"
    except RuntimeError:
        if isinstance(inner, faiss.IndexHNSW):
            family = "hnsw"
        elif isinstance(inner, faiss.IndexFlat):
            family = "flat"
    return {
        "family": family,
        "type": type(inner).__name__,
        "id_map": id_map,
        "nlist": nlist,
        "metric": METRICS.get(index.metric_type, str(index.metric_type)),
    }


def adopt(
    index_file: Path,
    out: Path,
    model_id: str,
    backend: str | None = None,
    ids_file: Path | None = None,
    metric: str | None = None,
    items: Path | None = None,
) -> dict[str, Any]:
    """Wrap `index_file` in the gallery folder `out` (see the module docstring); returns gallery.json's content.

    items: the item store behind the gallery (for the cascade and the backfill): every id the index
    serves must be one of its items, and its identity is recorded as a built gallery records it.
    """
    if out.exists():
        raise InputError(f"{out}: exists; adopt into a new folder")
    if not index_file.is_file():
        raise InputError(f"{index_file}: no such file")
    index = _read(index_file, InputError)
    kind = describe_index(index)
    if kind["family"] is None:
        raise InputError(
            f"{index_file}: a faiss index of type {kind['type']}; nobackfill serves IVF, HNSW and Flat indexes "
            "(with or without IndexIDMap / IDMap2)"
        )
    if kind["metric"] not in ("ip", "l2"):
        raise InputError(f"{index_file}: metric {kind['metric']}; the head's queries rank by inner product or L2")
    if metric is not None and metric != kind["metric"]:
        raise InputError(f"{index_file} ranks by {kind['metric']}, not by {metric} as --metric says")
    if kind["metric"] == "l2":
        _refuse_non_unit_rows(index, index_file)
    ids = _checked_ids(ids_file, int(index.ntotal)) if ids_file is not None else None
    items_identity = _checked_items(items, served_ids(index, ids), index_file) if items is not None else None
    try:
        # published whole by one rename, as every artifact folder is
        with staging(out, marker=META_NAME) as tmp:
            how = _link_or_copy(index_file, tmp / INDEX_NAME)
            if ids is not None:
                np.save(tmp / IDS_NAME, ids, allow_pickle=False)
            meta = {
                "format_version": 1,
                "kind": KIND,
                "source": {"adopted": str(index_file.resolve()), "how": how},
                "index": kind,
                "d": int(index.d),
                "ntotal": int(index.ntotal),
                "nlist": kind["nlist"],
                "M": None,
                "nbits": None,
                "labels": "positions into ids.npy" if ids is not None else "gallery ids",
                **({"items": items_identity} if items_identity is not None else {}),
                "old_model": {"backend": backend, "model_id": model_id, "fingerprint": None, "dim": int(index.d)},
                "sha256": sha256_of(tmp / INDEX_NAME),
                "index_bytes": (tmp / INDEX_NAME).stat().st_size,
                "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "nobackfill_version": service.__version__,
            }
            write_meta(tmp, meta)
            readable_by_others(tmp, keep=(INDEX_NAME,))  # the service may run as another user; the index is theirs
    except OSError as exc:
        raise InputError(f"cannot write {out}: {exc.strerror or exc}") from exc
    return meta


def _read(path: Path, error: type[InputError] | type[ArtifactError]) -> Any:
    """faiss.read_index, memory-mapped where the index type allows it; one line naming the file otherwise."""
    try:
        return faiss.read_index(str(path), faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY)
    except RuntimeError:
        pass  # this index type cannot be memory-mapped: read it into memory
    try:
        return faiss.read_index(str(path))
    except RuntimeError as exc:
        raise error(f"{path}: faiss cannot read it ({str(exc).strip().splitlines()[0]})") from exc


def _refuse_non_unit_rows(index: Any, where: Path) -> None:
    """An L2 index of rows that are not unit would rank the head's unit queries otherwise than by cosine."""
    n = min(_UNIT_SAMPLE, int(index.ntotal))
    if n == 0:
        return
    inner = inner_index(index)
    try:
        faiss.extract_index_ivf(inner).make_direct_map()  # in memory only: the file is never written
    except RuntimeError:
        pass  # not an IVF index: rows are read back directly
    try:
        rows = inner.reconstruct_n(0, n)
    except RuntimeError:
        rows = None
    if rows is None:
        return  # cannot read rows back: the docs say an L2 index must hold unit rows
    norms = np.linalg.norm(rows, axis=1)
    if not np.allclose(norms, 1.0, atol=_UNIT_TOLERANCE):
        raise InputError(
            f"{where}: an L2 index of rows of norm {float(norms.min()):.3g}..{float(norms.max()):.3g}; by L2 the "
            "head's unit queries rank only unit rows by cosine (re-add the rows normalised, or use inner product)"
        )


def served_ids(index: Any, ids: I64 | None) -> I64:
    """Every gallery id the index answers with: --ids, its id map, its inverted lists' ids, or its positions."""
    if ids is not None:
        return ids
    outer: Any = faiss.downcast_index(index)
    if isinstance(outer, faiss.IndexIDMap):
        return faiss.vector_to_array(outer.id_map).astype(np.int64)
    try:
        lists: Any = faiss.extract_index_ivf(outer).invlists
    except RuntimeError:
        return np.arange(int(index.ntotal), dtype=np.int64)  # Flat, HNSW: labels are positions
    parts = [
        faiss.rev_swig_ptr(lists.get_ids(i), lists.list_size(i)).copy()
        for i in range(lists.nlist)
        if lists.list_size(i)
    ]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def _checked_items(items: Path, ids: I64, where: Path) -> dict[str, Any]:
    """--items: the item store must hold exactly the index's ids; its identity, as gallery.json records it."""
    from service.items.store import ItemStore

    store = ItemStore.open(items)
    try:
        known = store.ids()
        missing = ids[~np.isin(ids, known)]
        if len(missing) or store.count != len(ids):
            first = f" (the smallest: id {int(missing.min())})" if len(missing) else ""
            raise InputError(
                f"{where} serves {len(ids):,} ids, item store {items} holds {store.count:,} items; "
                f"{len(missing):,} of the index's ids are not in it{first}"
            )
        return store.identity.as_dict()
    finally:
        store.close()


def _checked_ids(path: Path, ntotal: int) -> I64:
    """--ids: one distinct int64 gallery id per row of the index."""
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: cannot read ids ({exc})") from exc
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or len(ids) != ntotal:
        raise InputError(
            f"{path}: expected {ntotal:,} integer ids (one per row of the index), got {ids.dtype} {ids.shape}"
        )
    checked: I64 = ids.astype(np.int64)
    if len(np.unique(checked)) != len(checked):
        raise InputError(f"{path}: an id appears twice; each row of the index is one gallery item")
    return checked


def _link_or_copy(source: Path, target: Path) -> str:
    """A hard link to the user's file (nothing rewritten), or a copy when it lies on another filesystem."""
    try:
        os.link(source, target)
        return "hard link"
    except OSError:
        shutil.copyfile(source, target)
        return "copy (another filesystem: a hard link cannot cross it)"


class AdoptedGallery:
    """An adopted index folder, read-only (index/base.py's GalleryBackend)."""

    backend = "faiss"

    def __init__(self, folder: Path, meta: dict[str, Any], index: Any, ids: I64 | None, ef_search: int | None) -> None:
        self.folder = folder
        self.meta = meta
        self._index = index
        self._ids = ids  # labels are positions into this (None: labels are the gallery ids)
        self._order = None if ids is None else np.argsort(ids, kind="stable")  # to find a label by id
        self._sorted_ids = (
            None if ids is None or self._order is None else ids[self._order]
        )  # sorted once, not per snapshot
        self.kind: dict[str, Any] = meta["index"]
        self.dim = int(index.d)
        self.ntotal = int(index.ntotal)
        self.fingerprint = str(meta["sha256"])
        self.ef_search = ef_search  # an HNSW index's width: index.adopted_ef_search, else the file's own
        self._excluded: tuple[Exclusion, Any] | None = None  # the last exclusion, as labels (a snapshot's)

    @property
    def max_nprobe(self) -> int | None:
        """An IVF index takes nprobe up to its nlist; HNSW and Flat take none."""
        return int(self.kind["nlist"]) if self.kind["family"] == "ivf" else None

    @property
    def index(self) -> Any:
        """The user's faiss index as loaded (read-only; offline commands read its rows back)."""
        return self._index

    def ids_of_inner(self, labels: I64) -> I64:
        """The gallery ids of the inner index's labels (through an IDMap's id map, then --ids' positions)."""
        cast: Any = faiss.downcast_index(self._index)
        if isinstance(cast, faiss.IndexIDMap):
            labels = faiss.vector_to_array(cast.id_map).astype(np.int64)[labels]
        return labels if self._ids is None else self._ids[labels]

    @classmethod
    def load(cls, folder: Path, verify: str = "sha256", ef_search: int | None = None) -> AdoptedGallery:
        """Open an adopted folder: manifest, index size and sha256 as for a built gallery; ArtifactError in one line.
        ef_search: an HNSW index's search width (None: the efSearch stored in the file)."""
        from service.index.gallery import verified_index

        meta = read_checked_meta(folder)
        if meta.get("kind") != KIND:
            raise ArtifactError(f"gallery {folder}: not an adopted index ({META_NAME} says kind {meta.get('kind')!r})")
        path = verified_index(folder, meta, verify)
        index = _read(path, ArtifactError)
        found = describe_index(index)
        if found != meta["index"] or index.d != meta["d"] or index.ntotal != meta["ntotal"]:
            raise ArtifactError(f"gallery {folder}: {INDEX_NAME} is not the index {META_NAME} describes")
        ids = None
        if (folder / IDS_NAME).is_file():
            ids = np.load(folder / IDS_NAME, allow_pickle=False)
            if ids.dtype != np.int64 or ids.shape != (index.ntotal,):
                raise ArtifactError(f"gallery {folder}: {IDS_NAME} is not {index.ntotal:,} int64 ids")
        graph: Any = inner_index(index)
        ef = (ef_search or int(graph.hnsw.efSearch)) if found["family"] == "hnsw" else None
        return cls(folder, meta, index, ids, ef)

    def search(
        self,
        queries: npt.ArrayLike,
        k: int,
        nprobe: int,
        exclude: Exclusion | None = None,
        ef_search: int | None = None,
    ) -> tuple[F32, I64]:
        """Top-k by the index's own metric as cosines, skipping `exclude`'s ids: (scores, ids; -1 pads).
        ef_search: an HNSW index's width for this call (None: the gallery's); `gallery eval` sweeps it."""
        q = checked_queries(queries, self.dim, k, nprobe, self.max_nprobe)
        if q.shape[0] == 0:
            return np.zeros((0, k), dtype=np.float32), np.zeros((0, k), dtype=np.int64)
        params = self._params(nprobe, k, ef_search)
        if exclude is not None and len(exclude.ids):
            params.sel = self._selector(exclude)
        scores, labels = self._index.search(q, k, params=params)
        labels = np.asarray(labels, dtype=np.int64)
        found = labels >= 0
        ids = labels if self._ids is None else np.where(found, self._ids[np.maximum(labels, 0)], -1)
        scores = np.asarray(scores, dtype=np.float32)
        if self.kind["metric"] == "l2":  # faiss gives the squared distance
            scores = np.where(found, cosine_of_l2(scores), scores).astype(np.float32)
        return scores, ids

    def _params(self, nprobe: int, k: int, ef_search: int | None = None) -> Any:
        """The call's own search parameters (nothing set on the shared index, so threads never race).

        An HNSW width is raised to k, as faiss raises its own efSearch but not a per-call one: a walk
        narrower than the rows asked for returns a worse list than one as wide."""
        if self.kind["family"] == "ivf":
            params = faiss.SearchParametersIVF()
            params.nprobe = nprobe
            return params
        if self.kind["family"] == "hnsw":
            params = faiss.SearchParametersHNSW()  # type: ignore[attr-defined]  # faiss >= 1.7.3, not in its stubs
            params.efSearch = max(ef_search or self.ef_search or 16, k)
            return params
        return faiss.SearchParameters()

    def _selector(self, exclude: Exclusion) -> Any:
        """The faiss selector that skips the excluded gallery ids, in the index's own labels."""
        if self._order is None or self._sorted_ids is None:
            return exclude.faiss_selector.outer
        cached = self._excluded
        if cached is None or cached[0] is not exclude:  # a new snapshot: its moved ids as labels, once
            by_id = self._sorted_ids
            pos = np.minimum(np.searchsorted(by_id, exclude.ids), len(by_id) - 1)
            hit = by_id[pos] == exclude.ids
            cached = (exclude, Exclusion(np.sort(self._order[pos[hit]]).astype(np.int64)))
            self._excluded = cached
        return cached[1].faiss_selector.outer

    def describe(self) -> dict[str, Any]:
        """What /v1/info reports: the adopted index's kind, size and fingerprint."""
        return {
            "backend": self.backend,
            "kind": KIND,
            "index": self.kind,
            "fingerprint": self.fingerprint,
            "ntotal": self.ntotal,
            "dim": self.dim,
            "labels": self.meta.get("labels"),
            "ef_search": self.ef_search,  # an HNSW index's width (None otherwise)
        }

    def problem(self) -> str | None:
        """A loaded local file has nothing to go wrong at run time."""
        return None

    def probe(self) -> str | None:
        """Nothing to probe: the index is in this process."""
        return None

    def close(self) -> None:
        """Nothing to release."""


def inner_index(index: Any) -> Any:
    """The index inside an IndexIDMap / IDMap2 wrapper (itself otherwise)."""
    cast: Any = faiss.downcast_index(index)
    return faiss.downcast_index(cast.index) if isinstance(cast, faiss.IndexIDMap) else cast


def is_adopted(folder: Path) -> bool:
    """Whether the gallery folder holds an adopted index (its gallery.json says kind "adopted")."""
    try:
        return bool(json.loads((folder / META_NAME).read_text(encoding="utf-8")).get("kind") == KIND)
    except (OSError, ValueError, AttributeError):
        return False
