"""The cross-fit plan: which rows each fold trains on and which held-out rows score it, drawn once from a seed.

Every id (query_ids and target_ids together, over every split) is dealt to one fold, so a query and
its relevant targets always share a fold and a fold's fit never sees them.  Per fold and split the plan
keeps the rows in the fold (their complement is what the fold's map is fitted on), every held-out
query row, a seeded sample of at most `max_eval_queries` of them (the rows scored, which bounds the
cost) and the held-out gallery they rank against: the fold's own old targets, plus with
eval_gallery "support" the other folds' up to MAX_EVAL_GALLERY as distractors.

The same-set rule (`same_set=True`) is a plan of one "fold" that trains on everything and scores a
sample of all queries against all targets.

The random draws happen in one fixed order (fold assignment, then per fold and per split the query
sample and the gallery sample), which is the order selection.py always drew them in: a plan from
the same seed is the same plan, and so is every number fitted on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from service.compat.io import Split
from service.rows import I64
from service.vocabulary import EvalGallery

Mask = npt.NDArray[np.bool_]
# Held-out gallery cap of eval_gallery="support": 5,000 queries x 50,000 targets per fold keeps a fit
# at 10^5+ support pairs to about a minute on 2 cores, and a gallery that size already ranks like a large one.
MAX_EVAL_GALLERY = 50_000


@dataclass(frozen=True, eq=False)
class FoldRows:
    """One split's rows in one fold: the rows held out of the fold's fit and the held-out rows it is scored on."""

    in_fold_query: Mask  # query rows of this fold (held out of its fit)
    in_fold_target: Mask  # target rows of this fold (held out of its fit)
    queries: I64  # every held-out query row (out-of-fold statistics)
    scored: I64  # the seeded sample of `queries` that is scored, in row order
    gallery: I64  # old-target rows the scored queries rank against, in row order

    def in_fold(self, block: str) -> Mask:
        """Rows of the "query" or "target" block that belong to this fold."""
        return self.in_fold_query if block == "query" else self.in_fold_target

    def train(self, block: str) -> Mask:
        """Rows of the "query" or "target" block the fold's map may be fitted on: every row outside the fold."""
        return ~self.in_fold(block)


@dataclass(frozen=True, eq=False)
class Fold:
    """One fold of a plan: its number and, per split name, its rows."""

    index: int
    rows: Mapping[str, FoldRows]


@dataclass(frozen=True, eq=False)
class CrossFitPlan:
    """The folds of one fit, drawn once: cross-fitted folds, or the single all-rows fold of the same-set rule."""

    folds: tuple[Fold, ...]
    same_set: bool

    @classmethod
    def draw(
        cls,
        splits: Mapping[str, Split],
        *,
        folds: int,
        same_set: bool,
        seed: int,
        max_eval_queries: int,
        eval_gallery: EvalGallery,
    ) -> CrossFitPlan:
        """Deal the splits' ids to folds and sample each fold's scored queries and gallery (seeded, fixed order)."""
        rng = np.random.default_rng(seed)
        names = list(splits)
        if same_set:
            rows = {}
            for m, s in splits.items():
                everything = np.arange(len(s.old_query))
                rows[m] = FoldRows(
                    in_fold_query=np.zeros(len(s.old_query), dtype=np.bool_),
                    in_fold_target=np.zeros(len(s.old_target), dtype=np.bool_),
                    queries=everything,
                    scored=sample_rows(everything, max_eval_queries, rng),
                    gallery=np.arange(len(s.old_target)),
                )
            return cls(folds=(Fold(0, rows),), same_set=True)
        assigned = dict(zip(names, assign_joint([splits[m] for m in names], folds, rng), strict=True))
        plan = []
        for f in range(folds):
            fold_rows = {}
            for m in names:
                q_fold, t_fold = assigned[m]
                held = np.flatnonzero(q_fold == f)
                fold_rows[m] = FoldRows(
                    in_fold_query=q_fold == f,
                    in_fold_target=t_fold == f,
                    queries=held,
                    scored=sample_rows(held, max_eval_queries, rng),
                    gallery=gallery_rows(t_fold, f, eval_gallery, rng),
                )
            plan.append(Fold(f, fold_rows))
        return cls(folds=tuple(plan), same_set=False)


def assign_joint(splits: Sequence[Split], folds: int, rng: np.random.Generator) -> list[tuple[I64, I64]]:
    """Folds of the query and target rows of several splits, drawn per id over all of them at once.

    Query ids are dealt round-robin over a random permutation first, so every fold gets queries;
    ids that only targets carry (distractors) are dealt the same way afterwards.  An id shared by
    two splits (the same item's text and image pairs) lands in one fold, so no fold's R has seen
    another modality's view of a held-out item.
    """
    q_ids = np.unique(np.concatenate([s.query_ids for s in splits]))
    t_only = np.setdiff1d(np.unique(np.concatenate([s.target_ids for s in splits])), q_ids)
    ids = np.concatenate([q_ids, t_only])
    fold_of = np.empty(len(ids), dtype=np.int64)
    fold_of[: len(q_ids)][rng.permutation(len(q_ids))] = np.arange(len(q_ids)) % folds
    fold_of[len(q_ids) :][rng.permutation(len(t_only))] = np.arange(len(t_only)) % folds
    order = np.argsort(ids)
    sorted_ids = ids[order]
    out = []
    for s in splits:
        q = fold_of[order[np.searchsorted(sorted_ids, s.query_ids)]]
        t = fold_of[order[np.searchsorted(sorted_ids, s.target_ids)]]
        out.append((q, t))
    return out


def sample_rows(rows: I64, cap: int, rng: np.random.Generator) -> I64:
    """At most `cap` of `rows`, a seeded sample kept in order (held-out scoring cost is bounded)."""
    if len(rows) <= cap:
        return rows
    return np.sort(rng.choice(rows, cap, replace=False))


def gallery_rows(t_fold: I64, fold: int, eval_gallery: EvalGallery, rng: np.random.Generator) -> I64:
    """Held-out gallery of a fold: its own targets, plus (eval_gallery "support") the other folds' up to the cap.

    The other folds' targets only add distractors: the held-out queries' relevant targets are all in
    their own fold, which R_f has never seen.  A larger gallery ranks more like the production one.
    """
    own = np.flatnonzero(t_fold == fold)
    if eval_gallery == "fold":
        return own
    others = np.flatnonzero(t_fold != fold)
    room = max(0, MAX_EVAL_GALLERY - len(own))
    if len(others) > room:
        others = rng.choice(others, room, replace=False)
    return np.sort(np.concatenate([own, others]))
