"""The gallery interface the pipeline searches, and the checks every backend shares.

    GalleryBackend (protocol)
    ├── Gallery        index/gallery.py  a local FAISS IVF-PQ folder, memory-mapped read-only (the default)
    └── MilvusGallery  index/milvus.py   an existing Milvus collection, searched read-only

`index/factory.py` opens the configured one.  Both rank unit old-model vectors by inner product, so the
compat path in front of them is the same.
Neither ever writes: a FAISS gallery is opened read-only, a Milvus collection is only described and
searched (its load state and index are the operator's, `nobackfill gallery build` sets them up).
`max_nprobe` is the request's nprobe bound: the IVF nlist where the index has lists, None where
nprobe means nothing to the index (a flat or graph index in Milvus), and any nprobe >= 1 is accepted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from service.errors import InputError

Queries = npt.NDArray[np.float32]

if TYPE_CHECKING:
    from service.settings import IndexSettings


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
        self, queries: npt.ArrayLike, k: int, nprobe: int
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        """Top-k inner products of queries [b, d]: (scores [b, k] float32, ids [b, k] int64; -1 pads a short list)."""
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


def setting_line(index: IndexSettings) -> str:
    """The environment variables that chose the gallery, as the user would set them."""
    if index.backend == "milvus":
        return (
            f"NOBACKFILL_INDEX__BACKEND=milvus NOBACKFILL_INDEX__MILVUS_URI={index.milvus_uri} "
            f"NOBACKFILL_INDEX__MILVUS_COLLECTION={index.milvus_collection}"
        )
    return f"NOBACKFILL_INDEX__GALLERY_DIR={index.gallery_dir}"
