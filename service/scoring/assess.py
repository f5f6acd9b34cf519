"""`nobackfill assess`: is this upgrade worth doing, does the bridge suffice, how much to backfill, or re-index?

From a profile (fitted on a support set) and a labelled test set with both models' targets:
    gain        new->new minus old->old at the judged metric (R@10) and at R@1, with paired 95 % intervals
    bridge      the profile's head against old->old: its verdict (uncertainty.verdict) at the judged
                metric and at R@1, and its retention (ARR@10 = R@10 / new->new's, and nDCG@10's), with
                intervals
The verdict, the first rule that holds:
    no upgrade needed       the gain's upper bound is under min_gain at both metrics: not worth a change
    bridge suffices         the bridge is compatible, not worse at either metric, and the lower bounds of
                            both retentions reach min_retention
    bridge now, backfill    the bridge is compatible, its retention below that: serve it, then move items
    re-index                the bridge is not better than the old system beyond the noise: the bridge
                            cannot carry this upgrade, only new-model rows can
Each comes with the figures that decided it.  With the gallery's size and the new encoder's rate, a
full backfill's cost; with calibration in the profile, the expected R@1 / R@10 of hybrid search at
10 / 25 / 50 % moved (scoring/migration_curve.py, random order).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.compat.heads import transform_in_chunks
from service.compat.io import Split
from service.compat.metrics import ranks, relevance
from service.compat.procrustes import normalize_rows
from service.compat.profile import CompatProfile
from service.compat.uncertainty import describe, few_queries_line, paired_differences, retention, summary
from service.errors import InputError
from service.rows import I64
from service.scoring.thresholds import MIN_GAIN, MIN_RETENTION

JUDGE = "recall@10"
FRACTIONS = (0.1, 0.25, 0.5)
VERDICTS = ("no upgrade needed", "bridge suffices", "bridge now, backfill", "re-index")


def assess(
    profile: CompatProfile,
    test: Split,
    modality: str,
    *,
    min_gain: float = MIN_GAIN,
    min_retention: float = MIN_RETENTION,
    judge: str = JUDGE,
) -> dict[str, Any]:
    """The verdict and the figures and thresholds that decided it, JSON-ready (see the module docstring)."""
    if test.new_target is None:
        raise InputError(f"{test.path}: no new_target.npy; assess needs the test targets through the new model too")
    rel = relevance(test.query_ids, test.target_ids)
    old_targets, new_targets = normalize_rows(test.old_target), normalize_rows(test.new_target)
    old_rank = ranks(normalize_rows(test.old_query), old_targets, rel)
    new_rank = ranks(normalize_rows(test.new_query), new_targets, rel)
    served = transform_in_chunks(profile, profile.head, test.old_query, test.new_query, modality).queries
    bridge_rank = ranks(served, old_targets, rel)
    verdict, why, figures = decide(old_rank, new_rank, bridge_rank, profile.head, min_gain, min_retention, judge)
    return {
        "verdict": verdict,
        "why": why,
        "profile_id": profile.profile_id,
        "head": profile.head,
        "test": str(test.path),
        "queries": len(test.old_query),
        "modality": modality,
        "judged_on": judge,
        "thresholds": {"min_gain": min_gain, "min_retention": min_retention},
        **figures,
        "warning": few_queries_line(len(test.old_query), f"test set {test.path}"),
    }


def backfill_cost(items: int, rate: float) -> dict[str, float]:
    """A full backfill's time at `rate` items per second."""
    if items < 1 or rate <= 0:
        raise InputError(f"--gallery-items must be >= 1 and the rate > 0, got {items} and {rate}")
    seconds = items / rate
    return {"items": items, "items_per_s": rate, "seconds": seconds, "hours": seconds / 3600}


def expected_curve(profile_dir: Path, test_dir: Path, modality: str) -> list[dict[str, Any]] | None:
    """R@1 / R@10 of hybrid search at FRACTIONS moved (random order), or None without a calibration."""
    from service.scoring.migration_curve import score_curve

    try:
        curve = score_curve(profile_dir, test_dir, [0.0, *FRACTIONS, 1.0], modality=modality)
    except InputError:  # a profile fitted without new targets has no calibration: no curve to expect
        return None
    return list(curve["rows"])


def decide(
    old_rank: I64,
    new_rank: I64,
    bridge_rank: I64,
    head: str,
    min_gain: float = MIN_GAIN,
    min_retention: float = MIN_RETENTION,
    judge: str = JUDGE,
) -> tuple[str, str, dict[str, Any]]:
    """The verdict from the three searches' ranks on the same queries, why, and the figures it read.

    Each figure is read at the judged metric and at R@1 (a top 10 that is nearly full already, as on
    easy sets, hides a gain or a loss at rank 1): the gain is "under min_gain" only when it is at both,
    and the bridge "suffices" only when both its ARR@10 and its nDCG@10 retention reach min_retention.
    """
    gains = paired_differences(new_rank, old_rank)
    gain = gains[judge]
    bridge = summary(bridge_rank, old_rank, judge)
    kept_all = retention(bridge_rank, new_rank)
    kept, kept_ndcg = kept_all["arr@10"], kept_all["ndcg_retention@10"]
    compatible = "compatible" in (bridge["compatible"], bridge["compatible@1"])
    worse = "not compatible" in (bridge["compatible"], bridge["compatible@1"])
    metric = judge.replace("recall", "R")
    enough = all(part is not None and part["low"] >= min_retention for part in (kept, kept_ndcg))
    if max(gain["high"], gains["recall@1"]["high"]) < min_gain:
        verdict = VERDICTS[0]
        why = (
            f"the new model gains {describe(gain)} points of {metric} and {describe(gains['recall@1'])} of R@1 over "
            f"the old one, all under {100 * min_gain:.0f}: not worth an upgrade"
        )
    elif compatible and not worse and enough:
        assert kept is not None and kept_ndcg is not None
        verdict = VERDICTS[1]
        why = (
            f"the bridge ({head}) keeps {kept['value']:.1%} of the re-indexed R@10 (95 % interval "
            f"{kept['low']:.1%}-{kept['high']:.1%}) and {kept_ndcg['value']:.1%} of its nDCG@10 (from "
            f"{kept_ndcg['low']:.1%}), at least {min_retention:.0%}: serve it, no backfill"
        )
    elif compatible and not worse:
        shares = " and ".join(
            f"{part['value']:.1%} ({part['low']:.1%}-{part['high']:.1%}) of its {name}"
            for name, part in (("R@10", kept), ("nDCG@10", kept_ndcg))
            if part is not None
        )
        verdict = VERDICTS[2]
        why = (
            f"the bridge ({head}) beats the old system ({metric} {describe(bridge['vs_old'][judge])}, R@1 "
            f"{describe(bridge['vs_old']['recall@1'])} points) but keeps {shares or 'nothing measurable'} of the "
            f"re-indexed search, under {min_retention:.0%}: serve it now and backfill towards the new model's "
            f"{describe(gain)} ({metric}) and {describe(gains['recall@1'])} (R@1) points"
        )
    else:
        verdict = VERDICTS[3]
        why = (
            f"the bridge ({head}) is not better than the old system beyond the noise ({metric} "
            f"{describe(bridge['vs_old'][judge])}, R@1 {describe(bridge['vs_old']['recall@1'])} points) while the "
            f"new model gains {describe(gain)}: only new-model rows carry this upgrade; re-index (or backfill)"
        )
    return verdict, why, {"gain": gain, "gain@1": gains["recall@1"], "bridge": {**bridge, **kept_all}}
