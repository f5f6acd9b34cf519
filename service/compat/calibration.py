"""Putting the new-space scores on the old gallery's scale, so hybrid search can merge the two lists.

Hybrid search ranks moved items by new query . new row, and the others by the compatible query .
old row.  The two cosines live on different scales, so the merge maps the new scores onto the old
scale and leaves the old ones untouched: with nothing moved, hybrid is exactly the compatible
search, scores included.

How high a score is depends on the query as much as on the item: some queries sit in a crowded
part of their space and score high against everything.  So each query's scores are first read
against its own background in each space: the mean of its BACKGROUND_K best cosines over a fixed
set of reference rows, the support's targets in both spaces (stored in the profile).  The rows are
stored in their own top REFERENCE_RANK principal directions, and a query is read in the same ones:
a request then reads a fifth of the bytes in a 768-d space (references evicted from cache between
requests cost hybrid search more than the arithmetic), and the backgrounds came out the same
(docs/backfill.md: R@1 unchanged at 50 % moved on the synthetic and the real upgrade).  The map is
    s_new -> b_old(q) + scale * (s_new - b_new(q)) + shift
a line between the two spaces' distances above the query's background.  The references do not
change as items move, so neither does the map; a profile fitted before references were stored has
b = 0 (the plain line).  docs/backfill.md measures both on held-out test sets.

The line is fitted on the support set, which has both targets, for the decision the merge makes at
rank 1.  Per query: r_old / n_old, the best relevant and best non-relevant score in the old space
(compatible query), and r_new / n_new in the new space, each less the query's background there.
Within a space a monotone map changes nothing; across spaces the merge is right when a moved
relevant target beats the old side's best miss (scale * r_new + shift > n_old) and an unmoved one
beats the segment's best miss (r_old > scale * n_new + shift), each counted only where that space
alone ranks the target first.  The fit maximises the number of such right decisions: a grid over
log(scale), and for each scale the best shift by sorting.  The support's compatible queries are
in-sample for R (their old scores run a little high).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from service.rows import F32, F64, principal_directions

if TYPE_CHECKING:
    from service.compat.metrics import Relevance  # only the type: profiles load without torch

MAX_QUERIES = 5000
MAX_REFERENCES = 4000  # rows per space: a query's backgrounds cost 2 x 4000 dot products
BACKGROUND_K = 20
REFERENCE_RANK = 128  # principal directions kept per space (a space of at most this dim is kept whole)
_CHUNK = 256


@dataclass(frozen=True, eq=False)
class References:
    """The rows a query's background is read against, in both spaces (one per support target).

    Without a basis a side's rows are unit rows of its space; with one ([d, r], orthonormal columns:
    the rows' top principal directions) they are the rows' coordinates in it, and a query is read in
    the same coordinates, so its cosines with them are those of its projection.
    Compared by identity (eq=False): two maps are equal when they read the same stored rows.
    """

    old: F32  # [n, d_old], or [n, r_old] in old_basis's coordinates
    new: F32  # [n, d_new], or [n, r_new]
    k: int = BACKGROUND_K
    old_basis: F32 | None = None  # [d_old, r_old]
    new_basis: F32 | None = None  # [d_new, r_new]

    def __post_init__(self) -> None:
        if self.old.ndim != 2 or self.new.ndim != 2 or len(self.old) != len(self.new):
            shapes = f"{self.old.shape} / {self.new.shape}"
            raise ValueError(f"reference rows must be two matrices of as many rows, got {shapes}")
        if not 1 <= self.k <= len(self.old):
            raise ValueError(f"background k must be within 1..{len(self.old)} (the reference rows), got {self.k}")
        for side, rows, basis in (("old", self.old, self.old_basis), ("new", self.new, self.new_basis)):
            if basis is not None and (basis.ndim != 2 or basis.shape[1] != rows.shape[1]):
                raise ValueError(f"the {side} basis is {basis.shape}, its reference rows {rows.shape}: columns differ")

    @property
    def bases(self) -> tuple[F32 | None, F32 | None]:
        """(old_basis, new_basis)."""
        return self.old_basis, self.new_basis

    @property
    def directions(self) -> list[int | None]:
        """Per space (old, new): the principal directions its rows are read in; None where they are whole."""
        return [None if basis is None else int(basis.shape[1]) for basis in self.bases]

    @property
    def dims(self) -> tuple[int, int]:
        """The widths of the query rows each side reads: (d_old, d_new)."""
        d_old = self.old.shape[1] if self.old_basis is None else self.old_basis.shape[0]
        d_new = self.new.shape[1] if self.new_basis is None else self.new_basis.shape[0]
        return d_old, d_new

    def background(self, queries: F32, side: str) -> F32:
        """Per unit query row: the mean of its k best cosines against this side's references."""
        refs, basis = (self.old, self.old_basis) if side == "old" else (self.new, self.new_basis)
        rows = np.asarray(queries, dtype=np.float32)
        if basis is not None:
            rows = rows @ basis
        scores = rows @ refs.T
        best = np.partition(scores, len(refs) - self.k, axis=1)[:, len(refs) - self.k :]
        means: F32 = best.mean(axis=1, dtype=np.float64).astype(np.float32)
        return means


def in_principal_directions(rows: F32, rank: int) -> tuple[F32, F32 | None]:
    """The rows' coordinates in their own top `rank` principal directions (uncentred: the directions that keep
    most of their dot products) and that basis [d, r]; the rows unchanged, and no basis, when rank >= d."""
    if rank >= rows.shape[1]:
        return rows, None
    basis = np.ascontiguousarray(principal_directions(rows)[1][:, :rank])
    return np.ascontiguousarray(rows @ basis, dtype=np.float32), basis


@dataclass(frozen=True)
class ScoreMap:
    """New-space score s -> b_old(q) + scale * (s - b_new(q)) + shift on the old scale (b = 0 without references)."""

    scale: float
    shift: float
    references: References | None = None

    def background(self, queries: F32, side: str) -> F32:
        """Each unit query row's background on `side` ("old" or "new"); zeros without references."""
        if self.references is None:
            return np.zeros(len(queries), dtype=np.float32)
        return self.references.background(queries, side)

    def offset(self, b_old: F32, b_new: F32) -> F32:
        """Per query, b_old - scale * b_new: what its mapped new scores are shifted by."""
        scaled = np.float32(self.scale) * np.asarray(b_new, dtype=np.float32)
        return (np.asarray(b_old, dtype=np.float32) - scaled).astype(np.float32)

    def offsets(self, served: F32, new_queries: F32) -> F32:
        """offset() of both backgrounds: served = the compatible queries (old space), new_queries = new embeddings."""
        return self.offset(self.background(served, "old"), self.background(new_queries, "new"))

    def apply(self, scores: npt.NDArray[np.floating], offsets: F32 | None = None) -> F32:
        """Mapped scores of rows [b, k], each row shifted by its query's offset (padding -inf stays -inf)."""
        mapped = np.asarray(scores, dtype=np.float32) * np.float32(self.scale) + np.float32(self.shift)
        if offsets is not None:
            mapped = mapped + np.asarray(offsets, dtype=np.float32)[:, None]
        return mapped.astype(np.float32)

    def as_dict(self) -> dict[str, Any]:
        """JSON form, as profile.json stores it (the reference rows and bases go into the tensors file)."""
        line: dict[str, Any] = {"scale": self.scale, "shift": self.shift}
        refs = self.references
        if refs is not None:
            line["background"] = {"k": refs.k, "references": len(refs.old)}
            if refs.old_basis is not None or refs.new_basis is not None:
                # per space (old, new): the principal directions its references are read in, null where whole
                line["background"]["directions"] = refs.directions
        return line

    @classmethod
    def from_dict(
        cls, data: Any, references: tuple[F32, F32] | None = None, bases: tuple[F32 | None, F32 | None] = (None, None)
    ) -> ScoreMap:
        """Parse as_dict's form with its reference rows (old, new) and bases; ValueError when anything is off."""
        scale, shift = float(data["scale"]), float(data["shift"])
        if not (np.isfinite(scale) and np.isfinite(shift) and scale > 0):
            raise ValueError(f"scale must be finite and > 0, shift finite; got {scale}, {shift}")
        background = data.get("background")
        if background is None:
            return cls(scale, shift)
        if references is None:
            raise ValueError("a background is named but its reference rows are not in the tensors file")
        old, new = references
        if int(background["references"]) != len(old):
            raise ValueError(f"{background['references']} reference rows named, {len(old)} stored")
        refs = References(old, new, int(background["k"]), *bases)
        named = background.get("directions", [None, None])
        if named != refs.directions:
            raise ValueError(f"bases named for (old, new): {named} directions, stored: {refs.directions}")
        return cls(scale, shift, refs)


IDENTITY = ScoreMap(1.0, 0.0)


def reference_tensors(modality: str) -> tuple[str, str]:
    """The tensor names of a modality's reference rows (old space, new space) in the profile."""
    return f"calibration.{modality}.old_references", f"calibration.{modality}.new_references"


def basis_tensors(modality: str) -> tuple[str, str]:
    """The tensor names of a modality's reference bases (old space, new space), where the rows have them."""
    return f"calibration.{modality}.old_basis", f"calibration.{modality}.new_basis"


SCALES = np.exp(np.linspace(np.log(0.05), np.log(20.0), 161))


def best_scores(queries: F32, targets: F32, rel: Relevance, rows: npt.NDArray[np.int64]) -> tuple[F64, F64]:
    """Per query of `rows`: its best relevant score and its best non-relevant score, in one space."""
    starts = np.concatenate([[0], np.cumsum(np.bincount(rel.query_index, minlength=rel.n_queries))])
    hit, miss = np.empty(len(rows)), np.empty(len(rows))
    for start in range(0, len(rows), _CHUNK):
        block = rows[start : start + _CHUNK]
        s = queries[block] @ targets.T
        for i, q in enumerate(block.tolist()):
            relevant = rel.target_index[starts[q] : starts[q + 1]]
            hit[start + i] = s[i, relevant].max()
            s[i, relevant] = -np.inf
            miss[start + i] = s[i].max()
    return hit, miss


def best_line(r_old: F64, n_old: F64, r_new: F64, n_new: F64) -> tuple[ScoreMap, float]:
    """The (scale, shift) with the most right cross-space decisions, and the share of them that are right."""
    new_first, old_first = r_new > n_new, r_old > n_old
    best, chosen = -1, IDENTITY
    for scale in SCALES:
        low = np.sort((n_old - scale * r_new)[new_first])  # shift must be above these
        high = np.sort((r_old - scale * n_new)[old_first])  # ... and below these
        cuts = np.concatenate([low, high])
        if not len(cuts):
            break
        cuts = np.sort(cuts)
        shifts = np.concatenate([[cuts[0] - 1.0], (cuts[:-1] + cuts[1:]) / 2, [cuts[-1] + 1.0]])
        right = np.searchsorted(low, shifts, side="left") + len(high) - np.searchsorted(high, shifts, side="right")
        i = int(np.argmax(right))
        if right[i] > best:
            best, chosen = int(right[i]), ScoreMap(float(scale), float(shifts[i]))
    decisions = int(new_first.sum() + old_first.sum())
    return chosen, best / decisions if decisions else 0.0


def fit_score_map(
    served: F32, old_targets: F32, new_queries: F32, new_targets: F32, rel: Relevance, seed: int = 0
) -> tuple[ScoreMap, dict[str, Any]]:
    """The map of new scores onto the old scale (see the module docstring) and a JSON-able report.

    All rows must be unit: served = the compatible queries, new_queries / new_targets = the new model's.
    The references are up to MAX_REFERENCES of the targets, drawn at random, each side in its own top
    REFERENCE_RANK principal directions (the fit reads the backgrounds as a request will).
    """
    rng = np.random.default_rng(seed)
    with_rel = np.unique(rel.query_index)
    rows = with_rel if len(with_rel) <= MAX_QUERIES else np.sort(rng.choice(with_rel, MAX_QUERIES, replace=False))
    picked = np.sort(rng.choice(len(old_targets), min(MAX_REFERENCES, len(old_targets)), replace=False))
    old_refs, old_basis = in_principal_directions(old_targets[picked], REFERENCE_RANK)
    new_refs, new_basis = in_principal_directions(new_targets[picked], REFERENCE_RANK)
    references = References(old_refs, new_refs, min(BACKGROUND_K, len(picked)), old_basis, new_basis)
    b_old = references.background(served[rows], "old").astype(np.float64)
    b_new = references.background(new_queries[rows], "new").astype(np.float64)
    r_old, n_old = best_scores(served, old_targets, rel, rows)
    r_new, n_new = best_scores(new_queries, new_targets, rel, rows)
    line, right = best_line(r_old - b_old, n_old - b_old, r_new - b_new, n_new - b_new)
    score_map = ScoreMap(line.scale, line.shift, references)
    report = {
        "method": "rank-1 decisions over each query's background",
        "queries": int(len(rows)),
        "right_decisions": round(right, 4),
        "median_scores": {
            "old_hit": float(np.median(r_old)),
            "old_miss": float(np.median(n_old)),
            "new_hit": float(np.median(r_new)),
            "new_miss": float(np.median(n_new)),
            "old_background": float(np.median(b_old)),
            "new_background": float(np.median(b_new)),
        },
        **score_map.as_dict(),
    }
    return score_map, report
