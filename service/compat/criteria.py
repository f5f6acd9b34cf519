"""Which blend weight a criterion picks on a support curve, and which blend the curves favour.

Each weight of a support curve (curves.py) carries R@1/5/10, MRR@10 and the mean of R@1/5/10, averaged
over folds, with a standard error from their spread over the folds.  The criterion (CRITERIA,
docs/alpha-selection.md for the measurements) picks the weight: the arg-max of one score, or -- the
default, "mrr-1se" -- the median of the weights whose MRR@10 is within one standard error of the best,
and weight 0 whenever that plateau reaches it (the data cannot tell the blend from the old system).
Ties go to the better Recall@1, @5, @10, then the smaller weight.  `head_choice` says whether NLERP or
adaptive beats SLERP by more than the standard error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from service.errors import InputError
from service.vocabulary import Criterion

# criterion -> (score read off a curve row, its standard error, "centre of the one-SE set" or arg-max)
_CRITERIA: dict[str, tuple[str, str, bool]] = {
    Criterion.r1: ("recall@1", "se@1", False),
    Criterion.mean: ("mean@1-10", "se_mean@1-10", False),
    Criterion.mrr: ("mrr@10", "se_mrr@10", False),
    Criterion.r1_1se: ("recall@1", "se@1", True),
    Criterion.mean_1se: ("mean@1-10", "se_mean@1-10", True),
    Criterion.mrr_1se: ("mrr@10", "se_mrr@10", True),
}
CRITERIA: tuple[str, ...] = tuple(c.value for c in Criterion)
DEFAULT_CRITERION = Criterion.mrr_1se
CRITERION_TEXT: dict[str, str] = {
    Criterion.r1: "arg-max of R@1",
    Criterion.mean: "arg-max of the mean of R@1, R@5, R@10",
    Criterion.mrr: "arg-max of MRR@10",
    Criterion.r1_1se: "centre of the weights within one standard error of the best R@1",
    Criterion.mean_1se: "centre of the weights within one standard error of the best mean of R@1/5/10",
    Criterion.mrr_1se: "centre of the weights within one standard error of the best MRR@10",
}


def check_criterion(criterion: str) -> None:
    """Refuse an unknown selection criterion (InputError listing the known ones)."""
    if criterion not in _CRITERIA:
        raise InputError(f"--criterion must be one of {', '.join(CRITERIA)}, not {criterion!r}")


def choose(rows: Sequence[dict[str, float]], criterion: str, weight: str = "alpha") -> dict[str, float]:
    """The row a criterion picks from a 1-d curve (`weight` names its grid key); ties: R@1, @5, @10, smaller weight.

    One-SE rules: the rows whose score is within one standard error of the best form a plateau the data
    cannot tell apart; its median weight is chosen (the lower one of an even count), so noise moving
    the arg-max along a flat top does not move the choice.  The standard error is the median over the
    grid of each row's: one row's spread over 5 folds is itself noisy.  When the plateau reaches weight 0
    the data cannot tell the blend from the old system, so weight 0 it is: never below old -> old.
    """
    check_criterion(criterion)
    score, _, plateau = _CRITERIA[criterion]
    best = max(rows, key=lambda r: (r[score], r["recall@1"], r["recall@5"], r["recall@10"], -r[weight]))
    if not plateau:
        return best
    near = sorted((r for r in rows if r[score] >= best[score] - curve_se(rows, criterion)), key=lambda r: r[weight])
    return near[0] if near[0][weight] == 0.0 else near[(len(near) - 1) // 2]


def curve_se(rows: Sequence[dict[str, float]], criterion: str) -> float:
    """The standard error a one-SE rule uses on this curve: the median of its rows' standard errors."""
    return float(np.median([r[_CRITERIA[criterion][1]] for r in rows]))


def choose_adaptive(rows: Sequence[dict[str, float]], criterion: str) -> dict[str, float]:
    """The (a, b) a criterion picks on the adaptive grid: arg-max, or the one-SE set's smallest |b| and centre a."""
    check_criterion(criterion)
    score, _, plateau = _CRITERIA[criterion]
    best = max(rows, key=lambda r: (r[score], r["recall@1"], r["recall@5"], r["recall@10"], -abs(r["b"]), -r["a"]))
    if not plateau:
        return best
    near = [r for r in rows if r[score] >= best[score] - curve_se(rows, criterion)]
    flattest = min(abs(r["b"]) for r in near)
    return choose([r for r in near if abs(r["b"]) == flattest], criterion, weight="a") if len(near) > 1 else best


def criterion_score(criterion: str) -> str:
    """The key of the curve-row score a criterion reads (e.g. "mrr@10")."""
    return _CRITERIA[criterion][0]


def head_choice(report: dict[str, Any]) -> tuple[str, str]:
    """The blend the cross-fitted curves favour, and why: NLERP / adaptive only when it beats SLERP by > 1 SE.

    Scores are the criterion's, at each mode's chosen point; the margin is the standard error of the
    SLERP curve (curve_se).
    """
    criterion = report.get("criterion", DEFAULT_CRITERION)
    score = criterion_score(criterion)
    chosen = report["chosen"]
    base = chosen["slerp"]
    se = curve_se(report["support_recall"]["slerp"], criterion)
    margins = {m: chosen[m][score] - base[score] for m in ("nlerp", "adaptive") if m in chosen}
    mode, gain = max(margins.items(), key=lambda kv: kv[1], default=("slerp", 0.0))
    if gain > se:
        return mode, f"{mode} beats slerp on the cross-fitted {score} by {gain:.4f} (> the standard error {se:.4f})"
    return "slerp", f"no blend beats slerp on the cross-fitted {score} by more than the standard error {se:.4f}"
