"""The gallery interface the pipeline searches, and the checks every backend shares.

    GalleryBackend (protocol)
    ├── Gallery          index/gallery.py  a local FAISS IVF-PQ folder, memory-mapped read-only (the default)
    ├── AdoptedGallery   index/adopted.py  a FAISS index file the user built (IVF, HNSW, Flat), adopted untouched
    ├── PgvectorGallery  index/pgvector.py the user's PostgreSQL table (pgvector), searched where it is
    ├── QdrantGallery    index/qdrant.py   the user's Qdrant collection (a named vector), searched where it is
    └── MilvusGallery    index/milvus.py   an existing Milvus collection, searched read-only

`index/factory.py` opens the configured one.  Both rank unit old-model vectors by inner product, so the
compat path in front of them is the same.
Neither ever writes: a FAISS gallery is opened read-only, a Milvus collection is only described and
searched (its load state and index are the operator's, `nobackfill gallery build` sets them up).
`max_nprobe` is the request's nprobe bound: the IVF nlist where the index has lists, None where
nprobe means nothing to the index (a flat or graph index in Milvus), and any nprobe >= 1 is accepted.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from service.errors import GalleryUnavailable, InputError, NobackfillError

Queries = npt.NDArray[np.float32]
Ids = npt.NDArray[np.int64]
Hits = tuple[npt.NDArray[np.float32], Ids]
# What FAISS pads a short list's scores with (finite, so a JSON answer stays valid); ids pad with -1.
PAD_SCORE = np.float32(np.finfo(np.float32).min)
# Over-fetching for a backend without id filters grows the list this many times before giving up on a row.
_OVERFETCH_ROUNDS = 6
# Ids below this get a bitmap selector (at most 128 MiB of bits); sparse ids above it a hash set.
_BITMAP_MAX_IDS = 2**30

if TYPE_CHECKING:
    from service.settings import IndexSettings


@dataclass(frozen=True)
class InTable:
    """Moved rows marked in the gallery's own database (segment/pgvector_column.py), not listed by id.

    kind "column": the gallery table's column `name` is set on a moved row; kind "table": the side
    table `name` holds a row (id, embedding) per moved item; kind "vector": a moved point of the
    Qdrant gallery's collection has the named vector `name` (segment/qdrant_vector.py).
    """

    kind: str
    name: str


@dataclass(frozen=True, eq=False)
class Exclusion:
    """Gallery ids a search must skip (the items moved into the new-model segment), sorted.

    in_table: the moved items are instead marked in the gallery's own database; ids is then empty
    and only that database's gallery can skip them, in its own WHERE (segment/factory.py pairs the
    two, never another gallery).
    """

    ids: Ids = field(repr=False)
    in_table: InTable | None = None

    @cached_property
    def faiss_selector(self) -> Any:
        """A faiss IDSelectorNot over these ids (built once; the inner selector and its bits kept alive beside it).

        A bitmap over ids 0..max when that is small (one bit per id: 1.25 MB at 10^7), since its
        lookup is one shift and a mask; a hash set (IDSelectorBatch) for sparse, huge ids.  At 500,000
        moved ids the bitmap made a 10^6-item gallery's search twice as fast here (docs/backfill.md).
        """
        import faiss

        top = int(self.ids[-1]) + 1 if len(self.ids) else 0
        if len(self.ids) and self.ids[0] >= 0 and top <= _BITMAP_MAX_IDS:
            member = np.zeros(top, dtype=bool)
            member[self.ids] = True
            bits = np.packbits(member, bitorder="little")
            bitmap = faiss.IDSelectorBitmap(len(bits), faiss.swig_ptr(bits))
            return _Selector(faiss.IDSelectorNot(bitmap), bitmap, bits)
        kept = np.ascontiguousarray(self.ids)
        batch = faiss.IDSelectorBatch(len(kept), faiss.swig_ptr(kept))
        return _Selector(faiss.IDSelectorNot(batch), batch, kept)

    def drop(self, ids: Ids) -> npt.NDArray[np.bool_]:
        """Which of `ids` are excluded."""
        return sorted_member(ids, self.ids)


def sorted_member(ids: Ids, sorted_ids: Ids) -> npt.NDArray[np.bool_]:
    """Which of `ids` (any shape) are in the ascending array `sorted_ids`: one bisection each."""
    if not len(sorted_ids):
        return np.zeros(ids.shape, dtype=bool)
    pos = np.minimum(np.searchsorted(sorted_ids, ids), len(sorted_ids) - 1)
    return np.asarray(sorted_ids[pos] == ids)


@dataclass(frozen=True)
class _Selector:
    """faiss' IDSelectorNot does not own its inner selector: both live here."""

    outer: Any
    inner: Any
    data: np.ndarray  # what the inner selector was built from (a bitmap is read in place, not copied)


def excluding_by_overfetch(
    search: Any, queries: Queries, k: int, nprobe: int, exclusion: Exclusion, max_fetch: int | None = None
) -> Hits:
    """search(queries, k', nprobe) with the excluded ids filtered out, fetching more until k remain (or none are left).

    For backends without a native id filter (Milvus, a GPU index): exact as long as the list can grow.
    max_fetch: the backend's own bound on one search's list (Milvus's topk); a row whose k unexcluded hits
    lie beyond it comes back short (hybrid fills it from the segment).
    """
    scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
    ids = np.full((len(queries), k), -1, dtype=np.int64)
    todo = np.arange(len(queries))
    fetch = 2 * k if max_fetch is None else max(k, min(2 * k, max_fetch))
    for _ in range(_OVERFETCH_ROUNDS):
        if not len(todo):
            break
        got_s, got_i = search(queries[todo], fetch, nprobe)
        keep = (got_i >= 0) & ~exclusion.drop(got_i)
        short = []
        for row, q in enumerate(todo.tolist()):
            picked = np.flatnonzero(keep[row])[:k]
            ids[q, : len(picked)] = got_i[row, picked]
            scores[q, : len(picked)] = got_s[row, picked]
            if len(picked) < k and got_i[row, -1] >= 0:  # the list was full: more may lie beyond it
                short.append(q)
        todo = np.array(short, dtype=np.int64)
        if max_fetch is not None and fetch >= max_fetch:
            break
        fetch = fetch * 4 if max_fetch is None else min(fetch * 4, max(k, max_fetch))
    return scores, ids


class GalleryBackend(Protocol):
    """A loaded, read-only gallery of unit old-model vectors ranked by inner product."""

    backend: str
    dim: int
    ntotal: int
    fingerprint: str
    # What the artifact records: "old_model" (identity block) or "old_model_id"; artifact_check reads it.
    meta: dict[str, Any]

    @property
    def max_nprobe(self) -> int | None:
        """The largest nprobe a search takes (the IVF nlist), or None when the index has no nprobe."""
        ...

    def search(
        self,
        queries: npt.ArrayLike,
        k: int,
        nprobe: int,
        exclude: Exclusion | None = None,
        ef_search: int | None = None,
    ) -> Hits:
        """Top-k inner products of queries [b, d], skipping `exclude`'s ids: (scores [b, k], ids [b, k]; -1 pads).

        nprobe: an IVF index's lists.  ef_search: this call's width where the gallery walks an HNSW graph (an
        adopted HNSW index, a pgvector HNSW index, a Qdrant collection, a Milvus HNSW collection), at least k;
        None: the gallery's own setting.  Each backend ignores the one its index does not take."""
        ...

    def describe(self) -> dict[str, Any]:
        """What /v1/info reports about this gallery (JSON-ready)."""
        ...

    def problem(self) -> str | None:
        """Why the gallery cannot serve now (the last search or probe failed), or None."""
        ...

    def probe(self) -> str | None:
        """Check the gallery answers now (bounded by its timeout), remember and return the problem or None."""
        ...

    def close(self) -> None:
        """Release connections; searching afterwards is an error."""
        ...


def described(gallery: GalleryBackend, where: dict[str, Any], index: dict[str, Any]) -> dict[str, Any]:
    """A gallery's /v1/info block, one layout for all backends: backend, where it is, size, width, index, fingerprint.

    A FAISS folder has no address but its fingerprint: it passes that as `where`, and the key keeps that place.
    """
    return {
        "backend": gallery.backend,
        **where,
        "ntotal": gallery.ntotal,
        "dim": gallery.dim,
        **index,
        "fingerprint": gallery.fingerprint,
    }


def checked_queries(queries: npt.ArrayLike, dim: int, k: int, nprobe: int, max_nprobe: int | None) -> Queries:
    """Queries as contiguous float32 [b, dim]; InputError for another shape, k < 1 or nprobe out of bounds."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    if q.ndim != 2 or q.shape[1] != dim:
        raise InputError(f"queries must have shape [b, {dim}], got {list(q.shape)}")
    if k < 1:
        raise InputError(f"k must be >= 1, got {k}")
    check_nprobe(nprobe, max_nprobe)
    return q


def check_nprobe(nprobe: int, max_nprobe: int | None) -> None:
    """InputError unless 1 <= nprobe <= max_nprobe (the gallery's nlist; None: any nprobe >= 1)."""
    if nprobe < 1 or (max_nprobe is not None and nprobe > max_nprobe):
        bound = f"in 1..{max_nprobe} (the gallery's nlist)" if max_nprobe is not None else ">= 1"
        raise InputError(f"nprobe must be {bound}, got {nprobe}")


def cosine_of_l2(squared: npt.NDArray[np.floating[Any]]) -> npt.NDArray[np.float32]:
    """The cosine of two unit rows from their squared L2 distance (|a - b|^2 = 2 - 2 cos): a store that ranks by
    L2 reports its scores on the scale the others (and hybrid's merge) read."""
    return (1.0 - np.asarray(squared, dtype=np.float64) / 2.0).astype(np.float32)


def first_line(exc: BaseException) -> str:
    """An exception's first line (its class name when it says nothing), for a one-line message about a store."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@contextmanager
def store_errors(message: str) -> Iterator[None]:
    """Run the block; a store client's own error becomes one GalleryUnavailable (503) line, `message: <its first line>`.

    A store's client (qdrant-client, pymilvus, their transports) raises its own classes, which no caller can
    list, for a server that is down or slow: any Exception but the service's own (a NobackfillError, which
    passes as it is, e.g. an ArtifactError for another model's rows) is such an outage.
    """
    try:
        yield
    except NobackfillError:
        raise
    except Exception as exc:  # the client's transport and server errors alike
        raise GalleryUnavailable(f"{message}: {first_line(exc)}") from exc


class ServerHealth:
    """problem() and probe() of a gallery in a server (pgvector, Qdrant): the last call's failure, until one answers.

    A subclass names its `server` and gives `_ping` (one cheap call); its searches call `_failed(exc)` when
    the server does not answer and `_answered()` when it does.
    """

    server: str  # in the problem line: "PostgreSQL", "Qdrant"
    _problem: str | None = None

    def _ping(self) -> None:
        """One cheap call that raises when the server does not answer."""
        raise NotImplementedError

    def _failed(self, exc: BaseException) -> str:
        """Remember the failure (/readyz says it until a call answers); its line."""
        self._problem = f"{self.server} does not answer: {first_line(exc)}"
        return self._problem

    def _answered(self) -> None:
        """A call answered: ready again."""
        self._problem = None

    def problem(self) -> str | None:
        """The last search's or probe's failure, until one succeeds."""
        return self._problem

    def probe(self) -> str | None:
        """Ask the server (for /readyz): None when it answers, else the problem."""
        try:
            self._ping()
        except Exception as exc:  # any error of the client or driver: not ready
            return self._failed(exc)
        self._answered()
        return None


def setting_line(index: IndexSettings) -> str:
    """The environment variables that chose the gallery, as the user would set them."""
    if index.backend == "qdrant":
        where = (
            f"NOBACKFILL_INDEX__QDRANT_URL={index.qdrant_url}"
            if index.qdrant_url
            else f"NOBACKFILL_INDEX__QDRANT_PATH={index.qdrant_path}"
        )
        return f"NOBACKFILL_INDEX__BACKEND=qdrant {where} NOBACKFILL_INDEX__QDRANT_COLLECTION={index.qdrant_collection}"
    if index.backend == "pgvector":
        return (
            f"NOBACKFILL_INDEX__BACKEND=pgvector NOBACKFILL_INDEX__PGVECTOR_TABLE={index.pgvector_table} "
            f"NOBACKFILL_INDEX__PGVECTOR_COLUMN={index.pgvector_column}"
        )
    if index.backend == "milvus":
        return (
            f"NOBACKFILL_INDEX__BACKEND=milvus NOBACKFILL_INDEX__MILVUS_URI={index.milvus_uri} "
            f"NOBACKFILL_INDEX__MILVUS_COLLECTION={index.milvus_collection}"
        )
    return f"NOBACKFILL_INDEX__GALLERY_DIR={index.gallery_dir}"
