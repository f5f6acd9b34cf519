"""`eval --gallery`: the profile's head scored through the frozen gallery, by the calls the service makes.

The exact `eval` ranks every test target by an exact inner product.  The service searches an IVF-PQ
index instead (approximate codes, nprobe lists of nlist) and, with a hubness sidecar, re-ranks its
candidates (hubness.Corrected).  Given the gallery and optionally the sidecar, this ranks the test
queries of old, the profile's head and `<head>+csls` with those very calls, so the figures are what is
served and the rankings are the ids the service answers, id for id.  The test split's target_ids must
name gallery ids (`synth test --gallery-size N` over `gallery build --size N` does): a query's rank is
the first position of a relevant id in its served top DEPTH, and DEPTH when none is there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from service.compat.evaluation import method_row
from service.compat.heads import transform_in_chunks
from service.compat.hubness import Corrected
from service.compat.io import Split
from service.compat.metrics import relevance
from service.compat.profile import CompatProfile
from service.compat.uncertainty import paired_differences
from service.errors import InputError
from service.rows import I64

DEPTH = 10  # the metrics stop at 10: R@10, MRR@10, nDCG@10


@dataclass(frozen=True)
class Served:
    """Each method's served top-DEPTH gallery ids per test query, and the rank of its relevant id."""

    ids: dict[str, I64]
    ranks: dict[str, I64]
    alphas: dict[str, float | None]


def served_rankings(
    profile: CompatProfile, split: Split, modality: str, gallery: Any, nprobe: int, corrected: Corrected | None
) -> Served:
    """The gallery's answers (an index.Gallery: compat sits beside index) for old, the head and `<head>+csls`."""
    if split.old_dim != gallery.dim:
        raise InputError(f"{split.path}: old dim {split.old_dim} is not the gallery's {gallery.dim}")
    head = str(profile.head)
    ids: dict[str, I64] = {}
    alphas: dict[str, float | None] = {}
    for mode in ("old", head):
        done = transform_in_chunks(profile, mode, split.old_query, split.new_query, modality)
        ids[mode], alphas[mode] = gallery.search(done.queries, DEPTH, nprobe)[1], done.alpha
        if corrected is not None and mode == head:  # what transform_and_search serves for the head's rows
            every = np.ones(len(done.queries), dtype=bool)
            ids[f"{head}+csls"] = corrected.search(gallery, done.queries, DEPTH, nprobe, every)[1]
            alphas[f"{head}+csls"] = done.alpha
    return Served(ids, {method: _ranks(found, split) for method, found in ids.items()}, alphas)


def served_rows(served: Served, judge: str) -> list[dict[str, Any]]:
    """Eval rows of the served rankings: metrics, differences from old with intervals, verdicts."""
    old = served.ranks["old"]
    rows = [method_row("old", 0.0, old, old, reference=True)]
    for method, rank in served.ranks.items():
        if method != "old":
            rows.append(method_row(method, served.alphas[method], rank, old, judge=judge))
    for row in rows:
        if row["method"].endswith("+csls"):
            uncorrected = served.ranks[row["method"].removesuffix("+csls")]
            row["vs_uncorrected"] = paired_differences(served.ranks[row["method"]], uncorrected)
    return rows


def _ranks(found: I64, split: Split) -> I64:
    """Per query, the first position in `found` of an id relevant to it (DEPTH when none is there)."""
    rel = relevance(split.query_ids, split.target_ids)
    wanted = np.zeros(found.shape, dtype=bool)
    for q, t in zip(rel.query_index.tolist(), rel.target_index.tolist(), strict=True):
        wanted[q] |= found[q] == split.target_ids[t]
    return np.where(wanted.any(axis=1), wanted.argmax(axis=1), DEPTH).astype(np.int64)
