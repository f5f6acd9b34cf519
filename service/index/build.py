"""Build an IVF-PQ gallery folder from a `Source`: train on a sample, add in chunks, publish atomically.

Everything is written into a hidden sibling (atomic_dir.staging) and renamed to NAME only once
`index.faiss` and `gallery.json` (written last, with the file's sha256) are complete; an interrupted
build therefore never leaves anything at NAME that looks like a gallery.  Memory stays bounded by
the training sample (<= 1 GiB), one chunk and the index codes themselves, whatever N is.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt

import service
from service.atomic_dir import staging
from service.index.artifact import FORMAT_VERSION, INDEX_NAME, META_NAME, edges_sha256, write_meta
from service.index.coarse import TwoLevel, assign_two_level, train_two_level
from service.index.params import BuildParams
from service.index.sources import Rows, Source, chunks, sample_positions
from service.manifest import sha256_of
from service.progress import progress_bar

Log = Callable[[str], None]
_AGREEMENT_SAMPLE = 2000


class _Trained:
    """The trained, still empty index and how to feed it: OPQ transforms, IVF part, coarse assigner."""

    def __init__(self, index: Any, ivf: Any, transforms: list[Any], two_level: TwoLevel | None) -> None:
        self.index = index
        self.ivf = ivf
        self.transforms = transforms
        self.two_level = two_level

    def transform(self, x: Rows) -> Rows:
        """Apply the OPQ rotation when there is one (the IVF part sees rotated vectors)."""
        for vt in self.transforms:
            x = np.ascontiguousarray(vt.apply(x), dtype=np.float32)
        return x


def _train(sample: Rows, d: int, params: BuildParams, log: Log) -> _Trained:
    """Create the index and train the OPQ rotation, the coarse centroids and the PQ codebooks."""
    index = faiss.index_factory(d, params.factory(), faiss.METRIC_INNER_PRODUCT)
    # downcast: extract_index_ivf hands back the IndexIVF base class, which hides `pq`.
    ivf: Any = faiss.downcast_index(faiss.extract_index_ivf(index))
    ivf.cp.spherical = True  # centroids of unit vectors under inner product: keep them unit too
    ivf.cp.seed = params.seed
    if hasattr(ivf, "pq"):
        # One warning per sub-quantizer (64 lines) for a small sample says nothing `resolve` has not
        # checked already (>= 2^nbits training points); the sample size is logged above.
        ivf.pq.cp.min_points_per_centroid = 1
    # faiss's own warning for a sample under its points per list reads as an error; say what it means instead.
    advised = ivf.cp.min_points_per_centroid * params.nlist
    ivf.cp.min_points_per_centroid = 1
    if sample.shape[0] < advised:
        log(
            f"note: {sample.shape[0]:,} training vectors for {params.nlist:,} lists (faiss advises {advised:,}): "
            "the lists are noisier, so recall at a given nprobe is lower; fewer lists (--nlist) or more "
            "vectors avoid it, and `gallery eval` shows what it costs"
        )
    xt = sample
    transforms = []
    if params.opq:
        log(f"training OPQ{params.pq_m} rotation on {sample.shape[0]:,} vectors")
        pretransform = faiss.downcast_index(index)
        assert isinstance(pretransform, faiss.IndexPreTransform), type(pretransform)
        chain: Any = pretransform.chain  # a SWIG std::vector at runtime (the stubs say list)
        for i in range(chain.size()):
            vt = faiss.downcast_VectorTransform(chain.at(i))
            vt.train(xt)
            xt = np.ascontiguousarray(vt.apply(xt), dtype=np.float32)
            transforms.append(vt)
    two_level = None
    if params.two_level:
        log(f"two-level k-means: {params.nlist:,} centroids from {xt.shape[0]:,} vectors")
        two_level = train_two_level(xt, params.nlist, params.seed)
        ivf.quantizer.add(two_level.centroids)
    log(f"training {'PQ' if params.two_level else 'IVF + PQ'}{params.pq_m}x{params.nbits} on {xt.shape[0]:,} vectors")
    # With the quantizer already filled, IndexIVF.train only trains the PQ on the residuals.
    ivf.train(xt)
    index.is_trained = True
    return _Trained(index, ivf, transforms, two_level)


def _assignment_agreement(trained: _Trained, x: Rows, probe: int) -> float | None:
    """Share of rows whose two-level list is their exact nearest centroid (None for flat assignment)."""
    if trained.two_level is None:
        return None
    _, exact = trained.ivf.quantizer.search(x, 1)
    return float(np.mean(assign_two_level(x, trained.two_level, probe) == exact[:, 0]))


def _add_chunk(trained: _Trained, ids: npt.NDArray[np.int64], x: Rows, probe: int) -> None:
    """Add one chunk: exact coarse assignment inside faiss, or two-level assignment then add_core."""
    xt = trained.transform(x)
    if trained.two_level is None:
        trained.ivf.add_with_ids(xt, ids)
        return
    lists = assign_two_level(xt, trained.two_level, probe)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    trained.ivf.add_core(xt.shape[0], faiss.swig_ptr(xt), faiss.swig_ptr(ids), faiss.swig_ptr(lists))


def build_gallery(
    source: Source,
    out: Path,
    params: BuildParams,
    *,
    force: bool = False,
    progress: bool = True,
    log: Log = print,
    extra_meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build the gallery of `source` into folder `out` and return its gallery.json contents.

    extra_meta: more gallery.json keys (the item store's identity, say).
    """
    started = time.monotonic()
    with staging(out, force=force, marker=META_NAME, what="a gallery") as tmp:
        log(f"sampling {params.train_size:,} of {source.ntotal:,} vectors for training")
        sample = source.rows(sample_positions(source.ntotal, params.train_size, params.seed))
        trained = _train(sample, source.dim, params, log)
        agreement = _assignment_agreement(trained, trained.transform(sample[:_AGREEMENT_SAMPLE]), params.assign_probe)
        del sample
        train_s = time.monotonic() - started
        with progress_bar(total=source.ntotal, unit="vec", unit_scale=True, desc="adding", enabled=progress) as bar:
            for ids, x in chunks(source, params.chunk_size):
                _add_chunk(trained, ids, x, params.assign_probe)
                bar.update(x.shape[0])
        trained.index.ntotal = trained.ivf.ntotal
        if trained.index.ntotal != source.ntotal:
            raise RuntimeError(f"index holds {trained.index.ntotal} vectors, expected {source.ntotal}")
        index_path = tmp / INDEX_NAME
        log(f"writing {index_path.name}")
        faiss.write_index(trained.index, str(index_path))
        del trained
        with index_path.open("rb") as f:
            os.fsync(f.fileno())
        meta = _meta(source, params, index_path, agreement, train_s, time.monotonic() - started)
        meta.update(extra_meta or {})
        write_meta(tmp, meta)
    return meta


def _meta(
    source: Source,
    params: BuildParams,
    index_path: Path,
    agreement: float | None,
    train_s: float,
    total_s: float,
) -> dict[str, Any]:
    """gallery.json: what the index is, where it came from, how it was built, and its fingerprint."""
    return {
        "format_version": FORMAT_VERSION,
        "d": source.dim,
        "nlist": params.nlist,
        "M": params.pq_m,
        "nbits": params.nbits,
        "opq": params.opq,
        "ntotal": source.ntotal,
        "metric": "inner_product",
        "factory": params.factory(),
        "old_model_id": source.model_id,
        # The model's identity (backend, model_id, weights fingerprint, dim) when the source knows it;
        # not part of the Source protocol, so wrappers and older sources simply record null.
        "old_model": getattr(source, "old_model", None),
        "source": source.describe(),
        "build": {
            **params.as_dict(),
            "coarse": f"two-level, top-{params.assign_probe} groups" if params.two_level else "exact",
            "assign_agreement": agreement,
            "train_s": round(train_s, 1),
            "total_s": round(total_s, 1),
        },
        "index_file": INDEX_NAME,
        "index_bytes": index_path.stat().st_size,
        "sha256": sha256_of(index_path, progress=None),
        "edges_sha256": edges_sha256(index_path),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "versions": {"nobackfill": service.__version__, "faiss": faiss.__version__},
    }
