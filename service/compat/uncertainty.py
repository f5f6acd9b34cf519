"""How sure a comparison of two rankings of the same queries is: paired bootstrap intervals, retention, a verdict.

Per query, from the rank of its best relevant target (metrics.ranks): hit@1 / @5 / @10, the reciprocal
rank within 10 (MRR@10) and the discounted gain within 10 (nDCG@10 = 1 / log2(2 + rank), which is
the usual nDCG when a query has one relevant target).  Two methods ranked on the same queries are
compared by resampling the queries with replacement, each query's pair of values kept together
(a paired bootstrap): the 2.5 / 97.5 percentiles of the resampled mean difference are the 95 %
interval.  Retention is the same, of a ratio of means: R@10 (or nDCG@10) of the bridge over that of
the re-indexed search (ARR@10 in the literature).  The resamples depend only on the seed and the
number of queries, so every method is judged on the same draws, and a run is repeatable.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from service.rows import F64

METRICS = ("recall@1", "recall@5", "recall@10", "mrr@10", "ndcg@10")
RESAMPLES = 1000
SEED = 0
# Below this many queries an interval of a recall difference is wider than the effects it is asked to tell
# apart (one query is 2 points at 50): the numbers are printed, with a warning.
FEW_QUERIES = 200
Verdict = Literal["compatible", "not compatible", "not distinguishable"]


def per_query(rank: npt.NDArray[np.integer]) -> dict[str, F64]:
    """Each metric's value per query, from the 0-based rank of its best relevant target."""
    r = np.asarray(rank, dtype=np.float64)
    within = r < 10
    return {
        "recall@1": (r < 1).astype(np.float64),
        "recall@5": (r < 5).astype(np.float64),
        "recall@10": within.astype(np.float64),
        "mrr@10": np.where(within, 1.0 / (r + 1.0), 0.0),
        "ndcg@10": np.where(within, 1.0 / np.log2(r + 2.0), 0.0),
    }


def bootstrap_picks(n: int, resamples: int = RESAMPLES, seed: int = SEED) -> npt.NDArray[np.int64]:
    """The resampled query indices: [resamples, n], the same for every method of one comparison."""
    return np.random.default_rng(seed).integers(0, max(n, 1), (resamples, n))


def interval95(values: F64) -> tuple[float, float]:
    """The 95 % percentile interval of resampled statistics."""
    low, high = np.quantile(values, [0.025, 0.975])
    return float(low), float(high)


def paired_differences(
    rank: npt.NDArray[np.integer],
    reference: npt.NDArray[np.integer],
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> dict[str, dict[str, float]]:
    """Per metric: the mean difference (rank's minus reference's) and its 95 % paired bootstrap interval."""
    picks = bootstrap_picks(len(rank), resamples, seed)
    mine, theirs = per_query(rank), per_query(reference)
    out = {}
    for metric in METRICS:
        d = mine[metric] - theirs[metric]
        low, high = interval95(d[picks].mean(axis=1)) if len(d) else (0.0, 0.0)
        out[metric] = {"diff": float(d.mean()) if len(d) else 0.0, "low": low, "high": high}
    return out


def retention(
    rank: npt.NDArray[np.integer],
    ceiling: npt.NDArray[np.integer],
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> dict[str, dict[str, float] | None]:
    """ARR@10 (R@10 over the ceiling's) and nDCG@10 retention, each with its 95 % paired bootstrap interval."""
    picks = bootstrap_picks(len(rank), resamples, seed)
    mine, top = per_query(rank), per_query(ceiling)
    out: dict[str, dict[str, float] | None] = {}
    for name, metric in (("arr@10", "recall@10"), ("ndcg_retention@10", "ndcg@10")):
        denominator = top[metric].mean() if len(rank) else 0.0
        if denominator == 0:
            out[name] = None  # the ceiling finds nothing: no ratio
            continue
        resampled_top = top[metric][picks].mean(axis=1)
        ratios = mine[metric][picks].mean(axis=1) / np.where(resampled_top > 0, resampled_top, np.nan)
        low, high = interval95(ratios[np.isfinite(ratios)])
        out[name] = {"value": float(mine[metric].mean() / denominator), "low": low, "high": high}
    return out


def verdict(difference: dict[str, float]) -> Verdict:
    """Compatible when the interval of the difference is above 0, not compatible below it, else not distinguishable."""
    if difference["low"] > 0:
        return "compatible"
    if difference["high"] < 0:
        return "not compatible"
    return "not distinguishable"


def few_queries_line(n: int, what: str) -> str | None:
    """A warning when `n` queries are too few for the intervals to tell small effects apart; None otherwise."""
    if n >= FEW_QUERIES:
        return None
    return (
        f"{what} has {n} queries (under {FEW_QUERIES}): one query moves a recall by {100 / max(n, 1):.1f} points, so "
        "the intervals are wide and most differences will read 'not distinguishable'"
    )


def describe(difference: dict[str, float]) -> str:
    """A difference and its interval in points, e.g. '+1.2 [-1.8, +4.2]'."""
    return "{:+.1f} [{:+.1f}, {:+.1f}]".format(*(100 * difference[k] for k in ("diff", "low", "high")))


def summary(rank: npt.NDArray[np.integer], reference: npt.NDArray[np.integer], judge: str) -> dict[str, Any]:
    """Differences from the reference, the verdict on `judge` (and on R@1), for one method's row."""
    differences = paired_differences(rank, reference)
    return {
        "vs_old": differences,
        "compatible": verdict(differences[judge]),
        "compatible@1": verdict(differences["recall@1"]),
    }
