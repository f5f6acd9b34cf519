"""`nobackfill eval` without the CLI: every method's Recall@K, compatibility and flips on a test split.

Rows: old (old->old, the reference), new (new->new, only when new_target.npy exists: a re-indexed
gallery, so neither compatibility nor a weight applies), aligned (Procrustes only), midpoint (NLERP at
0.5), slerp / nlerp / adaptive (the profile's weights), oracle (the best SLERP weight on the grid chosen
on this very test set: an upper bound, never deployable).  Every upgraded row goes through
heads.transform, exactly as the service does.  `compatible` is Recall@1 strictly above old->old;
pfr / nfr are flips against old->old at Recall@1.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from service.compat.arcsearch import summarise_blends
from service.compat.heads import transform
from service.compat.io import Split
from service.compat.metrics import KS, flip_rates, is_compatible, ranks, recall_at_k, relevance
from service.compat.procrustes import normalize_rows
from service.compat.profile import CompatProfile
from service.compat.selection import ALPHA_GRID, slerp_lambda
from service.errors import InputError

_CHUNK = 16384
COLUMNS = ("method", "alpha", "recall@1", "recall@5", "recall@10", "compatible", "pfr", "nfr")


def _oracle_alpha(profile: CompatProfile, split: Split, targets: npt.NDArray[np.float32]) -> float:
    """Best SLERP weight on the grid for this test set (ties: better @5, @10, then smaller alpha)."""
    rel = relevance(split.query_ids, split.target_ids)
    summary, theta, _ = summarise_blends(split.old_query, split.new_query, profile.rotation, targets, rel, k=max(KS))
    scored = []
    for a in ALPHA_GRID:
        rec = recall_at_k(summary.ranks(slerp_lambda(a, theta)), KS)
        scored.append((rec[1], rec[5], rec[10], -a))
    return -max(scored)[3]


def evaluate(profile: CompatProfile, split: Split, modality: str) -> list[dict[str, Any]]:
    """Score every method on the test split; returns rows keyed by COLUMNS."""
    if split.old_dim != profile.old_dim or split.new_dim != profile.new_dim:
        raise InputError(
            f"{split.path}: dims old {split.old_dim} / new {split.new_dim} do not match the profile's "
            f"{profile.old_dim} / {profile.new_dim}"
        )
    targets = normalize_rows(split.old_target)
    rel = relevance(split.query_ids, split.target_ids)

    def run(mode: str, alpha: float | None = None) -> tuple[float, npt.NDArray[np.int64]]:
        # Chunks bound the float64 temporaries of the blends on large test sets.
        parts = [
            transform(profile, mode, split.old_query[s : s + _CHUNK], split.new_query[s : s + _CHUNK], modality, alpha)
            for s in range(0, len(split.old_query), _CHUNK)
        ]
        queries = np.concatenate([p.queries for p in parts])
        weights = np.concatenate([p.row_alpha for p in parts]).astype(np.float64)
        used = float(weights.mean()) if mode == "adaptive" else parts[0].alpha
        return used, ranks(queries, targets, rel)

    _, old_rank = run("old")
    old_ok = old_rank < 1
    old_r1 = recall_at_k(old_rank, KS)[1]

    def row(method: str, alpha: float | None, rank: npt.NDArray[np.int64], reference: bool) -> dict[str, Any]:
        rec = recall_at_k(rank, KS)
        pfr, nfr = flip_rates(old_ok, rank < 1)
        return {
            "method": method,
            "alpha": alpha,
            **{f"recall@{k}": rec[k] for k in KS},
            "compatible": None if reference else is_compatible(rec[1], old_r1),
            "pfr": pfr,
            "nfr": nfr,
        }

    rows = [row("old", 0.0, old_rank, reference=True)]
    if split.new_target is not None:
        new_rank = ranks(normalize_rows(split.new_query), normalize_rows(split.new_target), rel)
        rows.append(row("new", None, new_rank, reference=True))
    for method, mode, alpha in (
        ("aligned", "aligned", None),
        ("midpoint", "nlerp", 0.5),
        ("slerp", "slerp", None),
        ("nlerp", "nlerp", None),
        ("adaptive", "adaptive", None),
    ):
        used, rank = run(mode, alpha)
        rows.append(row(method, used, rank, reference=False))
    oracle = _oracle_alpha(profile, split, targets)
    used, rank = run("slerp", oracle)
    rows.append(row("oracle", used, rank, reference=False))
    return rows
