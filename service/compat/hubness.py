"""Hubness correction (CSLS) on the frozen gallery: a per-item bias computed offline, subtracted as served.

Some gallery items sit close to many mapped queries ("hubs") and crowd the top of lists they do not
belong in.  CSLS (cross-domain similarity local scaling) scores a mapped query x and an item y as
2 cos(x, y) - r(y) - r(x), with r(y) the mean cosine of y to its K nearest mapped queries.  r(x) is
the same for every item of one query, so the ranking is that of cos(x, y) - r(y) / 2: one number per
item, computed once from the gallery's rows and a sample of the profile head's mapped queries (the
support set's, or exported traffic's), and nothing re-encoded.

    HUBNESS_DIR/
        bias.npy        float32 [n]: r(y) / 2 per item, in the order of ids.npy
        ids.npy         int64 [n]: the gallery ids, ascending
        hubness.json    the gallery's fingerprint, the profile id, K, how many queries and from where
        manifest.json   size and sha256 of the three (service/manifest.py)

Served (compat.hubness_dir): for a query answered by the profile's head, the gallery returns
compat.hubness_candidates hits, each score less its item's bias, re-sorted and cut to k; `eval`
scores the same correction on a test set (the `<head>+csls` row), so what is served is what was scored.
A sidecar of another gallery or profile is refused in one line.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from service.atomic_dir import staging
from service.errors import ArtifactError, InputError
from service.json_file import read_json_object
from service.manifest import verify_manifest, write_json_durably, write_manifest
from service.rows import F32, I64

if TYPE_CHECKING:
    from service.compat.profile import CompatProfile

K = 10
FORMAT_VERSION = 1
META = "hubness.json"


def item_bias(rows: F32, queries: F32, k: int = K) -> F32:
    """r(y) / 2 for each unit row y: half its mean cosine to its k nearest unit mapped queries."""
    if len(queries) < k:
        raise InputError(f"the hubness correction needs at least {k} mapped queries, got {len(queries)}")
    sims = (
        torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
        @ torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32)).T
    )
    return (sims.topk(k, dim=1).values.mean(dim=1) / 2).numpy().astype(np.float32)


def biases(chunks: Iterable[tuple[I64, F32]], queries: F32, k: int = K) -> tuple[I64, F32]:
    """Ids and biases over every (ids, unit rows) chunk of a gallery, sorted by id."""
    id_parts, bias_parts = [], []
    for ids, rows in chunks:
        id_parts.append(np.asarray(ids, dtype=np.int64))
        bias_parts.append(item_bias(rows, queries, k))
    ids, bias = np.concatenate(id_parts), np.concatenate(bias_parts)
    order = np.argsort(ids, kind="stable")
    return ids[order], bias[order]


@dataclass(frozen=True)
class Hubness:
    """A loaded sidecar: each gallery id's bias, and what it was computed for."""

    ids: I64  # ascending
    bias: F32
    meta: dict[str, Any]

    def of(self, ids: I64) -> F32:
        """The bias of each id (0 for -1 padding or an id the sidecar lacks)."""
        pos = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)
        return np.where(self.ids[pos] == ids, self.bias[pos], 0.0).astype(np.float32)

    def correct(self, scores: F32, ids: I64, k: int) -> tuple[F32, I64]:
        """Each row's hits less their biases, re-sorted, cut to k (padding stays last)."""
        corrected = np.where(ids >= 0, scores - self.of(ids), -np.inf).astype(np.float32)
        order = np.argsort(-corrected, axis=1, kind="stable")[:, :k]
        out_s = np.take_along_axis(corrected, order, axis=1)
        out_i = np.take_along_axis(ids, order, axis=1)
        return np.where(out_i >= 0, out_s, scores.min(initial=0.0)).astype(np.float32), out_i


@dataclass(frozen=True)
class Corrected:
    """The served correction: a sidecar and how many hits it re-ranks (compat.hubness_candidates)."""

    hubness: Hubness
    candidates: int

    def search(
        self,
        gallery: Any,
        batch: F32,
        k: int,
        nprobe: int,
        rows: npt.NDArray[np.bool_],
        ef_search: int | None = None,
    ) -> tuple[F32, I64]:
        """The gallery's top-k; `rows` re-ranked over max(k, candidates) hits less their biases."""
        scores, ids = gallery.search(batch, max(k, self.candidates), nprobe, ef_search=ef_search)
        out_s, out_i = scores[:, :k].copy(), ids[:, :k].copy()
        if rows.any():
            out_s[rows], out_i[rows] = self.hubness.correct(scores[rows], ids[rows], k)
        return out_s, out_i


def write_hubness(out: Path, ids: I64, bias: F32, meta: dict[str, Any]) -> None:
    """Write a sidecar folder atomically (a hidden sibling renamed into place)."""
    with staging(out, marker=META) as tmp:  # a failed write leaves no hidden sibling behind
        np.save(tmp / "ids.npy", ids)
        np.save(tmp / "bias.npy", bias)
        write_json_durably(tmp / META, {"format_version": FORMAT_VERSION, **meta})
        write_manifest(tmp)


def load_hubness(folder: Path, gallery_fingerprint: str, profile_id: str) -> Hubness:
    """A sidecar checked against its manifest, the served gallery and profile; ArtifactError in one line."""
    if verify_manifest(folder) is None:
        raise ArtifactError(f"hubness sidecar {folder}: manifest.json is missing")
    meta = read_json_object(folder / META, f"hubness sidecar {folder}: {META}")
    if meta.get("gallery_fingerprint") != gallery_fingerprint:
        raise ArtifactError(
            f"hubness sidecar {folder} was computed for gallery {str(meta.get('gallery_fingerprint'))[:12]}..., "
            f"not the served {gallery_fingerprint[:12]}...; recompute it with `nobackfill gallery hubness`"
        )
    if meta.get("profile_id") != profile_id:
        raise ArtifactError(
            f"hubness sidecar {folder} was computed for profile {meta.get('profile_id')}, not the served "
            f"{profile_id}; recompute it with `nobackfill gallery hubness`"
        )
    ids, bias = np.load(folder / "ids.npy"), np.load(folder / "bias.npy")
    if ids.dtype != np.int64 or bias.dtype != np.float32 or ids.shape != bias.shape or ids.ndim != 1:
        raise ArtifactError(f"hubness sidecar {folder}: ids.npy and bias.npy must be int64 and float32 of one length")
    if not np.isfinite(bias).all() or (len(ids) > 1 and not (np.diff(ids) > 0).all()):
        raise ArtifactError(f"hubness sidecar {folder}: biases must be finite and ids ascending")
    return Hubness(ids, bias, meta)


def augmented(queries: F32, targets: F32, bias: F32) -> tuple[F32, F32]:
    """Queries and targets whose inner products are cos - bias (a column of ones against one of -bias), for ranks()."""
    q = np.hstack([queries, np.ones((len(queries), 1), dtype=np.float32)]).astype(np.float32)
    t = np.hstack([targets, -bias[:, None]]).astype(np.float32)
    return q, t


def mapped_queries(profile: CompatProfile, folder: Path, modality: str) -> tuple[F32, str]:
    """A support or traffic folder's queries through the profile's head (unit, zero rows dropped), and its kind."""
    from service.compat.heads import transform_in_chunks
    from service.compat.io import load_query_pairs, load_split
    from service.compat.procrustes import normalize_rows

    if (folder / "old_target.npy").is_file():
        split = load_split(folder, old_dim=profile.old_dim, new_dim=profile.new_dim)
        old, new, kind = split.old_query, split.new_query, "support"
    else:
        pairs = load_query_pairs(folder)
        old, new, kind = pairs.old, pairs.new, "traffic"
    mapped = normalize_rows(transform_in_chunks(profile, profile.head, old, new, modality).queries)
    return mapped[np.any(mapped != 0, axis=1)], kind
