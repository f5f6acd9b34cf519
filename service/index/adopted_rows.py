"""The rows an adopted index holds, read back for the offline commands that need them (`gallery eval`,
`gallery hubness`); serving never reads them.

A Flat, IVF-Flat or HNSW-Flat index stores its rows whole, so they are read from it.  A PQ or SQ index
keeps codes only: a reconstruction is the code's approximation, not the row, and measuring the index
against its own approximations would flatter it.  Those indexes take the rows from the user's .npy
instead (`--from-npy`): float [ntotal, d] in the order the index added them, which is the order of
its inner labels: positions for a Flat or HNSW index or inside an IDMap, and for an IVF index that
holds its own ids (add_with_ids) the ascending order of those ids.

Rows come back as stored (not normalised): the exact ranking an index is measured against is its own
metric's on its own rows.  An L2 index holds unit rows (`gallery adopt` checks), where inner product
ranks as L2 does, so inner product is exact for every adopted index.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import faiss
import numpy as np

from service.errors import InputError
from service.index.adopted import AdoptedGallery, inner_index
from service.rows import F32, I64

# Index types that keep each row whole, in float32.
WHOLE_ROWS = ("IndexFlat", "IndexFlatIP", "IndexFlatL2", "IndexIVFFlat", "IndexHNSWFlat")


class AdoptedRows:
    """An adopted index's rows in the order of its inner labels, with each one's gallery id (a Source)."""

    def __init__(self, gallery: AdoptedGallery, from_npy: Path | None = None) -> None:
        self.ntotal = gallery.ntotal
        self.dim = gallery.dim
        self.model_id = str(gallery.meta.get("old_model", {}).get("model_id", "unknown"))
        inner = inner_index(gallery.index)
        found: Any = faiss.try_extract_index_ivf(inner)
        ivf = None if found is None else faiss.downcast_index(found)  # IndexIVFFlat, not the base proxy
        # Each position's inner label: 0..n-1 for a Flat or HNSW index, an IVF index's listed labels ascending.
        labels, listed = (np.arange(self.ntotal, dtype=np.int64), None) if ivf is None else _listed(ivf)
        self._reconstruct: Any = None
        if from_npy is not None:
            self._rows: Any = _checked_npy(from_npy, gallery)
            self.origin = str(from_npy)
        elif gallery.kind["type"] not in WHOLE_ROWS:
            raise InputError(
                f"gallery {gallery.folder}: a {gallery.kind['type']} keeps codes, not rows; pass --from-npy "
                f"ROWS.npy (float [{self.ntotal:,}, {self.dim}], in the order the index added them)"
            )
        elif listed is not None:
            self._rows = listed  # read out of the lists, in label order
            self.origin = "the index's own rows"
        else:
            self._rows, self._reconstruct = None, inner
            self.origin = "the index's own rows"
        self._ids = gallery.ids_of_inner(labels)

    def describe(self) -> dict[str, Any]:
        """Where the rows were read from."""
        return {"kind": "adopted", "rows": self.origin}

    def rows(self, positions: I64) -> F32:
        """The rows at these positions (0..ntotal-1), as stored."""
        positions = np.asarray(positions, dtype=np.int64)
        if self._reconstruct is None:
            return np.ascontiguousarray(self._rows[positions], dtype=np.float32)
        if len(positions) and positions[-1] - positions[0] == len(positions) - 1 and np.all(np.diff(positions) == 1):
            return np.asarray(self._reconstruct.reconstruct_n(int(positions[0]), len(positions)), dtype=np.float32)
        return np.asarray(self._reconstruct.reconstruct_batch(positions), dtype=np.float32)

    def ids(self, start: int, stop: int) -> I64:
        """The gallery ids of positions start..stop-1."""
        return self._ids[start:stop]


def _listed(ivf: Any) -> tuple[I64, F32 | None]:
    """An IVF index's labels, ascending, and (IVF-Flat) its rows in the same order, read out of its lists."""
    lists = ivf.invlists
    flat = isinstance(ivf, faiss.IndexIVFFlat)
    labels, rows = [], []
    for number in range(ivf.nlist):
        size = lists.list_size(number)
        if size == 0:
            continue
        ids = lists.get_ids(number)
        labels.append(faiss.rev_swig_ptr(ids, size).astype(np.int64))  # copies
        lists.release_ids(number, ids)
        if flat:
            codes = lists.get_codes(number)
            rows.append(faiss.rev_swig_ptr(codes, size * ivf.code_size).view(np.float32).reshape(size, ivf.d).copy())
            lists.release_codes(number, codes)
    found = np.concatenate(labels) if labels else np.zeros(0, dtype=np.int64)
    order = np.argsort(found, kind="stable")
    return found[order], (np.concatenate(rows)[order] if flat and rows else None)


def _checked_npy(path: Path, gallery: AdoptedGallery) -> Any:
    """The .npy memory-mapped, refused in one line unless it is float [ntotal, d]."""
    try:
        rows = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise InputError(f"--from-npy {path}: not a readable .npy file ({exc})") from exc
    if rows.dtype.kind != "f" or rows.shape != (gallery.ntotal, gallery.dim):
        raise InputError(
            f"--from-npy {path}: {rows.dtype} {list(rows.shape)}, but the adopted index holds "
            f"{gallery.ntotal:,} rows of {gallery.dim} floats (in the order it added them)"
        )
    return rows
