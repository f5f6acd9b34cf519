"""The support rows a map (R or a learnt one) is fitted on, and what every selection report says of them.

`fit_on="both"` stacks the query pairs with the target pairs where new_target.npy exists (query
pairs only otherwise; the report's `fit_blocks` says which were used).  A fold's cross-covariance is
summed per block, so R for fold f is the total less fold f's (selection.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from service.compat.criteria import CRITERION_TEXT
from service.compat.crossfit import MAX_EVAL_GALLERY, CrossFitPlan
from service.compat.curves import Held
from service.compat.io import Split
from service.compat.procrustes import cross_covariance
from service.errors import InputError
from service.rows import F32, F64, I64
from service.vocabulary import EvalGallery, FitOn


@dataclass(frozen=True)
class Block:
    """Paired rows R can be fitted on: the query pairs or the target pairs of the split."""

    name: str
    new: F32
    old: F32
    ids: I64


def fit_blocks(split: Split, fit_on: FitOn) -> list[Block]:
    """The paired blocks R is fitted on; `both` uses target pairs only where new_target.npy exists."""
    blocks = []
    if fit_on in ("query", "both"):
        blocks.append(Block("query", split.new_query, split.old_query, split.query_ids))
    if fit_on in ("target", "both") and split.new_target is not None:
        blocks.append(Block("target", split.new_target, split.old_target, split.target_ids))
    if fit_on == "target" and split.new_target is None:
        raise InputError(f"{split.path / 'new_target.npy'}: missing (needed by --fit-on target)")
    return blocks


def support_pairs(split: Split, fit_on: FitOn) -> tuple[F32, F32, list[str]]:
    """All (new, old) pairs a map is fitted on for `fit_on`, and the names of the blocks used."""
    blocks = fit_blocks(split, fit_on)
    new, old = stack_pairs(blocks)
    return new, old, [b.name for b in blocks]


def stack_pairs(blocks: Sequence[Block], masks: Sequence[npt.NDArray[np.bool_]] | None = None) -> tuple[F32, F32]:
    """The (new, old) training pairs of the blocks, optionally restricted to rows where masks hold."""
    if masks is None:
        return np.concatenate([b.new for b in blocks]), np.concatenate([b.old for b in blocks])
    new = np.concatenate([b.new[m] for b, m in zip(blocks, masks, strict=True)])
    old = np.concatenate([b.old[m] for b, m in zip(blocks, masks, strict=True)])
    return new, old


def total(mats: Sequence[F64]) -> F64:
    """Element-wise sum of equally shaped cross-covariances."""
    out: F64 = np.sum(np.stack(mats), axis=0)
    return out


def _block_cov(block: Block, rows: npt.NDArray[np.bool_]) -> F64:
    """Cross-covariance of the selected rows of one block."""
    return cross_covariance(block.new[rows], block.old[rows])


def fold_covariances(plan: CrossFitPlan, blocks: Mapping[str, Sequence[Block]]) -> list[F64]:
    """Per fold of the plan, the cross-covariance of its own rows of every block (what its fit leaves out)."""
    return [
        total([_block_cov(b, fold.rows[m].in_fold(b.name)) for m in blocks for b in blocks[m]]) for fold in plan.folds
    ]


def check_fit_args(split: Split, fit_on: str, folds: int, same_set: bool) -> None:
    """Refuse fit options that cannot work on this split (InputError naming the option)."""
    if fit_on not in ("query", "target", "both"):
        raise InputError(f"--fit-on must be query, target or both, not {fit_on!r}")
    if not same_set and folds < 2:
        raise InputError(f"--folds must be at least 2 for cross-fitting, got {folds}")
    if not same_set and len(np.unique(split.query_ids)) < folds:
        raise InputError(f"{split.path / 'old_query.npy'}: fewer distinct query ids than --folds {folds}")


def report_basics(
    split: Split,
    blocks: Sequence[Block],
    held: Sequence[Held],
    fit_on: FitOn,
    folds: int,
    same_set: bool,
    criterion: str,
    eval_gallery: EvalGallery = EvalGallery.fold,
) -> dict[str, Any]:
    """The fit-report fields every head shares: how alpha was selected and on which rows."""
    gallery = (
        "all support targets"
        if same_set
        else f"old targets of every fold (at most {MAX_EVAL_GALLERY:,})"
        if eval_gallery == "support"
        else "old targets of the held-out fold"
    )
    return {
        "selection": "same-set" if same_set else "cross-fit",
        "criterion": criterion,
        "criterion_text": CRITERION_TEXT[criterion],
        "folds": 1 if same_set else folds,
        "fit_on": fit_on,
        "fit_blocks": [b.name for b in blocks],
        "fit_rows": int(sum(len(b.new) for b in blocks)),
        "support_queries": len(split.old_query),
        "support_targets": len(split.old_target),
        "eval_queries": int(sum(h.summary.n_queries for h in held)),
        "eval_gallery": gallery,
    }
