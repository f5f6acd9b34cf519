"""`Gallery`: a built gallery folder, memory-mapped read-only, fingerprint-checked, searchable from many threads.

Loading first checks every file but the index against `manifest.json` (gallery.json included, byte
for byte; the index by size), then verifies `index.faiss` against `gallery.json` before faiss reads
a byte of it:
- `verify="sha256"` (default): size, then the full sha256 (8 MiB blocks, a progress bar on a terminal
  for big files; ~1-2 s per GB, and it warms the page cache the memory-mapped search reads anyway);
- `verify="size"`: size, and the sha256 of the first and last MiB (the faiss header, quantiser and
  the end of the lists).  Catches truncation, a swapped index and damage at either end, not a
  same-sized corruption in the middle; for fast restarts of a file that was verified before.
The index is opened with IO_FLAG_MMAP | IO_FLAG_READ_ONLY: inverted lists stay in the page cache
(shared between processes), nothing is ever written.  nprobe travels with each call
(SearchParametersIVF), so concurrent searches with different nprobe never race.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Literal

import faiss
import numpy as np
import numpy.typing as npt

from service.errors import ArtifactError, InputError
from service.index import graph_quantizer
from service.index.artifact import INDEX_NAME, edges_sha256, read_checked_meta
from service.index.base import Exclusion, checked_queries, described, excluding_by_overfetch
from service.manifest import sha256_of

Verify = Literal["sha256", "size"]
Coarse = Literal["auto", "flat", "hnsw"]


class Gallery:
    """A loaded, read-only IVF-PQ gallery (the local backend of index/base.py's GalleryBackend)."""

    backend = "faiss"

    def __init__(
        self,
        folder: Path,
        meta: dict[str, Any],
        index: Any,
        nlist: int,
        gpu_resources: Any = None,
        graph: Any = None,
        graph_ef: int = 128,
    ) -> None:
        self.folder = folder
        self.meta = meta
        self._index = index
        self.dim: int = int(index.d)
        self.ntotal: int = int(index.ntotal)
        self.nlist: int = nlist
        self.fingerprint: str = str(meta["sha256"])
        self.on_gpu = gpu_resources is not None
        self._gpu_resources = gpu_resources  # must outlive the GPU index
        # GPU indexes take nprobe as state, not as a per-call parameter: serialise those calls.
        self._gpu_lock = threading.Lock()
        self._graph = graph  # the HNSW coarse quantizer (graph_quantizer.py); must outlive the index
        self.graph_ef = graph_ef

    @property
    def coarse(self) -> str:
        """How the nprobe lists are chosen: "hnsw" (graph over the centroids) or "flat" (exact scan)."""
        return "hnsw" if self._graph is not None else "flat"

    @property
    def max_nprobe(self) -> int:
        """A search probes at most every list."""
        return self.nlist

    def describe(self) -> dict[str, Any]:
        """What /v1/info reports: fingerprint, size, dim, nlist, coarse quantizer."""
        return described(self, {"fingerprint": self.fingerprint}, {"nlist": self.nlist, "coarse": self.coarse})

    def problem(self) -> str | None:
        """A loaded local file has nothing to go wrong at run time."""
        return None

    def probe(self) -> str | None:
        """Nothing to probe: the index is in this process."""
        return None

    def close(self) -> None:
        """Nothing to release: the mapping goes with the object."""

    @classmethod
    def load(
        cls,
        folder: Path | str,
        verify: Verify = "sha256",
        gpu: bool | None = None,
        progress: bool | None = None,
        coarse: Coarse = "flat",
        graph_ef: int = 128,
    ) -> Gallery:
        """Open a gallery folder read-only; ArtifactError if it is missing, truncated or not as gallery.json says.

        coarse: "flat" searches the centroids exactly, as the file stores them; "hnsw" swaps in a graph
        over them (graph_quantizer.py); "auto" does that on CPU from AUTO_MIN_NLIST lists up.
        """
        if coarse not in ("auto", "flat", "hnsw"):
            raise InputError(f"coarse must be 'auto', 'flat' or 'hnsw', got {coarse!r}")
        folder = Path(folder)
        meta = read_checked_meta(folder)
        path = verified_index(folder, meta, verify, progress)
        try:
            index = faiss.read_index(str(path), faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY)
        except RuntimeError as exc:
            raise ArtifactError(
                f"gallery {folder}: faiss cannot read {path.name} ({str(exc).splitlines()[0]})"
            ) from exc
        nlist = _check_shape(folder, meta, index)
        _no_prefetch_threads(index)
        use_gpu = _gpu_count() > 0 if gpu is None else gpu
        resources = graph = None
        if use_gpu:  # a GPU scans the centroids fast; faiss cannot clone a graph quantizer there
            index, resources = _to_gpu(index)
        elif coarse == "hnsw" or (coarse == "auto" and nlist >= graph_quantizer.AUTO_MIN_NLIST):
            graph = graph_quantizer.swap_in_graph(index)
        return cls(folder, meta, index, nlist, resources, graph, graph_ef)

    def search(
        self,
        queries: npt.ArrayLike,
        k: int,
        nprobe: int,
        exclude: Exclusion | None = None,
        ef_search: int | None = None,  # noqa: ARG002 (the protocol's: an IVF index has no graph width)
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        """Top-k inner products of queries [b, d], skipping `exclude`'s ids: (scores [b, k], ids [b, k]; -1 pads)."""
        q = checked_queries(queries, self.dim, k, nprobe, self.nlist)
        if q.shape[0] == 0:
            return np.zeros((0, k), dtype=np.float32), np.zeros((0, k), dtype=np.int64)
        if exclude is not None and len(exclude.ids):
            if self.on_gpu:  # GPU indexes take no id selector
                return excluding_by_overfetch(self.search, q, k, nprobe, exclude)
            return self._search_cpu(q, k, nprobe, exclude.faiss_selector.outer)
        if self.on_gpu:
            with self._gpu_lock:
                faiss.GpuParameterSpace().set_index_parameter(self._index, "nprobe", nprobe)
                scores, ids = self._index.search(q, k)
            return np.asarray(scores, dtype=np.float32), np.asarray(ids, dtype=np.int64)
        return self._search_cpu(q, k, nprobe, None)

    def _search_cpu(
        self, q: npt.NDArray[np.float32], k: int, nprobe: int, selector: Any
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        """One CPU search with nprobe (and the id selector, when given) carried by the call's own parameters."""
        params = faiss.SearchParametersIVF()
        params.nprobe = nprobe
        if selector is not None:
            params.sel = selector
        if self._graph is not None:
            graph_params = graph_quantizer.search_params(nprobe, self.graph_ef)
            params.quantizer_params = graph_params  # `graph_params` stays referenced until search returns
        scores, ids = self._index.search(q, k, params=params)
        return np.asarray(scores, dtype=np.float32), np.asarray(ids, dtype=np.int64)

    @property
    def faiss_index(self) -> Any:
        """The underlying faiss index, for read-only use (evaluation copies a subset out of it)."""
        return self._index


def verified_index(folder: Path, meta: dict[str, Any], verify: str, progress: bool | None = None) -> Path:
    """The gallery's index file, checked against gallery.json (size, then sha256 or its edges) before faiss reads it."""
    path = folder / str(meta.get("index_file", INDEX_NAME))
    if not path.is_file():
        raise ArtifactError(f"gallery {folder}: {path.name} is missing")
    size = path.stat().st_size
    if size != meta["index_bytes"]:
        raise ArtifactError(
            f"gallery {folder}: {path.name} is {size:,} bytes, gallery.json says {meta['index_bytes']:,} "
            "(truncated or replaced)"
        )
    if verify == "sha256":
        digest = sha256_of(path, progress)
        if digest != meta["sha256"]:
            raise ArtifactError(
                f"gallery {folder}: fingerprint mismatch: {path.name} has sha256 {digest[:16]}..., "
                f"gallery.json says {str(meta['sha256'])[:16]}... (corrupt or modified)"
            )
    elif verify == "size":
        if "edges_sha256" in meta and edges_sha256(path) != meta["edges_sha256"]:
            raise ArtifactError(f"gallery {folder}: fingerprint mismatch in the first / last MiB of {path.name}")
    else:
        raise InputError(f"verify must be 'sha256' or 'size', got {verify!r}")
    return path


def _check_shape(folder: Path, meta: dict[str, Any], index: Any) -> int:
    """The index must be what gallery.json describes; returns its nlist."""
    ivf = faiss.extract_index_ivf(index)
    found = {"d": int(index.d), "ntotal": int(index.ntotal), "nlist": int(ivf.nlist)}
    wrong = [f"{key} {found[key]} != {meta[key]}" for key in found if found[key] != meta[key]]
    if wrong:
        raise ArtifactError(f"gallery {folder}: index does not match gallery.json: {', '.join(wrong)}")
    return found["nlist"]


def _no_prefetch_threads(index: Any) -> None:
    """Stop the mmap'd lists from starting reader threads on every search.

    OnDiskInvertedLists pre-reads the probed lists with up to 32 fresh threads per search, meant for
    cold disks.  Here the file is hashed on load (so it sits in the page cache) and those threads
    tripled single-query p50 (1e6 gallery, nprobe 16: 0.96 ms -> 0.33 ms without them).
    """
    invlists = faiss.extract_index_ivf(index).invlists
    lists = faiss.downcast_InvertedLists(invlists) if invlists is not None else None
    if isinstance(lists, faiss.OnDiskInvertedLists):
        lists.prefetch_nthread = 0


def _gpu_count() -> int:
    """GPUs faiss can use (0 with faiss-cpu)."""
    get = getattr(faiss, "get_num_gpus", None)
    return int(get()) if get is not None else 0


def _to_gpu(index: Any) -> tuple[Any, Any]:
    """Clone the index onto GPU 0 (codes are copied into GPU memory); returns (GPU index, its resources)."""
    resources = faiss.StandardGpuResources()
    return faiss.index_cpu_to_gpu(resources, 0, index), resources
