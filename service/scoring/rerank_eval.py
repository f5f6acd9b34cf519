"""The re-rank cascade, offline and exact: the compatible query's top N old hits, re-ranked by the new model.

Stage 1: the profile's compatible query against every OLD target (exact inner product); its N best
are the candidates.  Stage 2: the first B of them in stage-1 order (the encode budget; B = N: all)
are ordered by the new query's cosine with their NEW rows and put first; the other N - B keep their
stage-1 order below them.  A query's relevant target is a hit at k when its place in that list is
below k; one outside the stage-1 top N is a miss at every k (the cascade returns only candidates).

Ranks are counted as evaluate.py counts them: only targets scoring strictly above the relevant one
are counted (ties go to the relevant target), so a cascade over every target with all of them
re-ranked is the re-indexed search exactly, and one with B = 0 is stage 1 exactly.  Among
non-relevant candidates of equal stage-1 score the order is numpy's partition's.  Queries are
searched in chunks: memory holds chunk x targets scores of each model, not queries x targets.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.compat.uncertainty import bootstrap_picks, interval95
from service.errors import InputError
from service.rows import F32, I64
from service.scoring.migration import BOOTSTRAP, Spaces, compatible_queries

# 128 queries x 10^6 targets is 0.5 GB of float32 scores per model; argpartition's int64 indices double one.
CHUNK = 128
KS = (1, 10)


@dataclass(frozen=True)
class Plan:
    """One cascade: `candidates` (N) from stage 1, the first `budget` (B <= N) of them re-ranked."""

    candidates: int
    budget: int


@dataclass(frozen=True)
class CascadeRanks:
    """Rank (0 = top) of each query's relevant target in each list; len(targets) when it is not in it."""

    compatible: I64  # stage 1 over every old target
    reindexed: I64  # the new query over every new target
    cascade: dict[Plan, I64]


def plans_of(candidates: Sequence[int], budget: int | None) -> list[Plan]:
    """One plan per N, the budget capped at N (None: all N re-ranked)."""
    return [Plan(n, n if budget is None else min(budget, n)) for n in candidates]


def cascade_ranks(spaces: Spaces, plans: Sequence[Plan], chunk: int = CHUNK) -> CascadeRanks:
    """Each query's relevant target's rank under stage 1, the re-indexed search and every plan's cascade."""
    n, m = len(spaces.served), len(spaces.old_targets)
    if any(not 0 <= p.budget <= p.candidates <= m for p in plans):
        raise ValueError(f"every plan needs 0 <= budget <= candidates <= {m} targets, got {list(plans)}")
    # The first B in stage-1 order are the relevant target and the B - 1 best others.
    others = max((p.budget for p in plans), default=0) - 1
    compatible = np.full(n, m, dtype=np.int64)
    reindexed = np.full(n, m, dtype=np.int64)
    cascade = {p: np.full(n, m, dtype=np.int64) for p in plans}
    for start in range(0, n, chunk):
        rows = np.arange(start, min(n, start + chunk))
        rows = rows[spaces.rel_target[rows] >= 0]  # a query without a relevant target stays a miss everywhere
        if not len(rows):
            continue
        target, local = spaces.rel_target[rows], np.arange(len(rows))
        old = spaces.served[rows] @ spaces.old_targets.T
        new = spaces.new_queries[rows] @ spaces.new_targets.T
        ref_old, ref_new = old[local, target], new[local, target]
        first = np.count_nonzero(old > ref_old[:, None], axis=1)
        compatible[rows] = first
        reindexed[rows] = np.count_nonzero(new > ref_new[:, None], axis=1)
        if others > 0:
            old[local, target] = -np.inf  # the candidates beside the relevant target, best first
            # Read from the same score matrix as the re-indexed rank, so B = N = all targets matches it bit for bit.
            beats = new[local[:, None], _best(old, others)] > ref_new[:, None]
        else:
            beats = np.zeros((len(rows), 0), dtype=bool)
        for plan in plans:
            reranked = np.count_nonzero(beats[:, : max(plan.budget - 1, 0)], axis=1)
            kept = np.where(first < plan.candidates, first, m)
            cascade[plan][rows] = np.where(first < plan.budget, reranked, kept)
    return CascadeRanks(compatible, reindexed, cascade)


def _best(scores: F32, k: int) -> I64:
    """Column indices of each row's k highest scores, highest first (1 <= k <= columns)."""
    m = scores.shape[1]
    part = np.argpartition(scores, m - k, axis=1)[:, m - k :] if k < m else np.tile(np.arange(m), (len(scores), 1))
    order = np.argsort(-np.take_along_axis(scores, part, axis=1), axis=1, kind="stable")
    best: I64 = np.take_along_axis(part, order, axis=1).astype(np.int64)
    return best


def _recall(rank: I64, k: int, picks: I64) -> tuple[float, list[float]]:
    """Share of queries whose rank is below k, and its 95 % bootstrap interval over queries."""
    hit = (rank < k).astype(np.float64)
    return float(hit.mean()), list(interval95(hit[picks].mean(axis=1)))


def _recalls(rank: I64, picks: I64) -> dict[str, Any]:
    """R@1 and R@10 with their intervals."""
    out: dict[str, Any] = {}
    for k in KS:
        out[f"recall@{k}"], out[f"ci@{k}"] = _recall(rank, k, picks)
    return out


def cascade_rows(ranks: CascadeRanks, plans: Sequence[Plan], seed: int = 0) -> dict[str, Any]:
    """The two references and one row per plan, every recall with a bootstrap interval (the same resamples)."""
    n = len(ranks.compatible)
    picks = bootstrap_picks(n, BOOTSTRAP, seed)
    rows = []
    for plan in plans:
        stage1, stage1_ci = _recall(ranks.compatible, plan.candidates, picks)
        row = {"candidates": plan.candidates, "budget": plan.budget, "stage1_recall": stage1, "stage1_ci": stage1_ci}
        rows.append(row | _recalls(ranks.cascade[plan], picks))
    return {
        "compatible": _recalls(ranks.compatible, picks),
        "reindexed": _recalls(ranks.reindexed, picks),
        "rows": rows,
    }


def score_cascade(
    profile_dir: Path,
    test_dir: Path,
    candidates: Sequence[int],
    *,
    budget: int | None = None,
    modality: str | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Load a profile and a test split, and score the cascade at each N against both references."""
    started = time.perf_counter()
    if not candidates or any(c < 1 for c in candidates) or list(candidates) != sorted(set(candidates)):
        raise InputError(f"--candidates must be rising positive integers, got {list(candidates)}")
    if budget is not None and budget < 0:
        raise InputError(f"--budget must be 0 or more, got {budget}")
    profile, modality, split, served = compatible_queries(
        profile_dir, test_dir, modality, "the cascade re-ranks by the targets' new-model rows"
    )
    if candidates[-1] > len(split.old_target):
        raise InputError(f"--candidates {candidates[-1]} is more than the {len(split.old_target):,} targets")
    spaces = Spaces.of(split, served)
    del split, served  # at 10^6 targets the raw rows are gigabytes beside the unit ones
    plans = plans_of(candidates, budget)
    result = cascade_rows(cascade_ranks(spaces, plans), plans, seed)
    n, m = len(spaces.served), len(spaces.old_targets)
    missing = int((spaces.rel_target < 0).sum())
    budget_text = "every candidate re-ranked" if budget is None else f"the first {budget} candidates re-ranked"
    return result | {
        "title": f"re-rank cascade: profile {profile.profile_id} ({profile.head}) on {test_dir} ({modality} queries)",
        "caption": (
            f"{n:,} queries over {m:,} targets ({missing} without a relevant target: misses); stage 1 = {profile.head} "
            f"query over the old targets, its top N re-ranked by new-model cosine, {budget_text}; "
            "95 % bootstrap intervals over queries"
        ),
        "queries": n,
        "targets": m,
        "no_relevant": missing,
        "mode": str(profile.head),
        "modality": modality,
        "budget": budget,
        "seconds": round(time.perf_counter() - started, 1),
    }
