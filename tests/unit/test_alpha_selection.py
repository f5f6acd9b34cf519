"""Choosing alpha: the criteria on hand-made curves, the head choice, and small noisy upgrades never below old->old."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.compat import criteria, crossfit, curves, selection
from service.compat.arcsearch import summarise_blends
from service.compat.fit_options import FitOptions
from service.compat.io import Split, load_split
from service.compat.metrics import KS, recall_at_k, relevance
from service.compat.procrustes import normalize_rows
from service.errors import InputError
from tests.support.upgrade_standin import make_world, write_split


def curve(r1: list[float], se: float = 0.01) -> list[dict[str, float]]:
    """Curve rows over ALPHA_GRID with the given R@1; the other scores move with it."""
    rows = []
    for alpha, r in zip(curves.ALPHA_GRID, r1, strict=True):
        rows.append(
            {
                "alpha": alpha,
                "recall@1": r,
                "recall@5": r + 0.2,
                "recall@10": r + 0.3,
                "mrr@10": r + 0.05,
                "mean@1-10": r + 0.1667,
                "se@1": se,
                "se_mrr@10": se,
                "se_mean@1-10": se,
            }
        )
    return rows


FLAT_TOP = [0.30, 0.40, 0.50, 0.555, 0.556, 0.558, 0.561, 0.557, 0.50, 0.40, 0.30]


def test_arg_max_is_the_old_rule_and_ties_go_to_the_smaller_weight() -> None:
    assert criteria.choose(curve(FLAT_TOP), "r1")["alpha"] == 0.6
    tied = curve([0.1, 0.5, 0.5, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])
    assert criteria.choose(tied, "r1")["alpha"] == 0.1


def test_one_se_rule_takes_the_centre_of_a_flat_top() -> None:
    # 0.3 .. 0.7 are within one standard error of the best (0.561 at 0.6): the median weight is 0.5.
    for criterion in ("r1-1se", "mean-1se", "mrr-1se"):
        assert criteria.choose(curve(FLAT_TOP), criterion)["alpha"] == 0.5
    # A tiny standard error leaves only the peak.
    assert criteria.choose(curve(FLAT_TOP, se=1e-4), "mean-1se")["alpha"] == 0.6


def test_a_plateau_that_reaches_weight_zero_keeps_the_old_system() -> None:
    useless = [0.40, 0.405, 0.398, 0.39, 0.30, 0.2, 0.1, 0.05, 0.03, 0.02, 0.01]
    assert criteria.choose(curve(useless), "mean-1se")["alpha"] == 0.0
    assert criteria.choose(curve(useless), "r1")["alpha"] == 0.1


def test_unknown_criterion_is_refused() -> None:
    with pytest.raises(InputError, match="--criterion"):
        criteria.choose(curve(FLAT_TOP), "best")


def _report(slerp: float, nlerp: float, se: float) -> dict[str, Any]:
    rows = curve(FLAT_TOP, se=se)
    pick = {"alpha": 0.5, "recall@1": slerp, "mean@1-10": slerp}
    return {
        "criterion": "mean-1se",
        "support_recall": {"slerp": rows},
        "chosen": {"slerp": pick, "nlerp": {**pick, "mean@1-10": nlerp}, "adaptive": {**pick, "a": 0.5, "b": 0.0}},
    }


def test_head_choice_needs_more_than_one_standard_error() -> None:
    head, why = criteria.head_choice(_report(0.50, 0.505, se=0.01))
    assert head == "slerp" and "standard error" in why
    head, why = criteria.head_choice(_report(0.50, 0.52, se=0.01))
    assert head == "nlerp" and "0.0200" in why


def test_report_carries_the_curve_with_standard_errors(tmp_path: Path) -> None:
    split = load_split(write_split(tmp_path / "s", 400, make_world(8, 12, 6), seed=1))
    rep = selection.fit(split, FitOptions(folds=4)).report
    assert rep["criterion"] == criteria.DEFAULT_CRITERION and rep["criterion_text"]
    for row in rep["support_recall"]["slerp"]:
        assert {"se@1", "mrr@10", "mean@1-10", "se_mean@1-10"} <= set(row)
        assert row["se@1"] >= 0 and row["recall@1"] <= row["recall@5"] <= row["recall@10"]
    assert any(row["se_mrr@10"] > 0 for row in rep["support_recall"]["slerp"])
    assert rep["best_head"]["head"] in ("slerp", "nlerp", "adaptive") and rep["best_head"]["why"]


def _test_r1(test: Split, fitted: selection.FitResult, alpha: float) -> float:
    """Test Recall@1 of SLERP(alpha) under the fitted R."""
    rel = relevance(test.query_ids, test.target_ids)
    summary, theta, _ = summarise_blends(
        test.old_query, test.new_query, fitted.rotation, normalize_rows(test.old_target), rel, k=max(KS)
    )
    return recall_at_k(summary.ranks(curves.slerp_lambda(alpha, theta)), KS)[1]


@pytest.mark.parametrize("seed", range(4))
def test_small_noisy_upgrade_never_falls_below_old(tmp_path: Path, seed: int) -> None:
    # 120 support pairs of a noisy upgrade: the cross-fitted curve is noisy, and the chosen weight must
    # still not lose to the old system on a separate test set.
    world = make_world(16, 24, 8, seed=seed, view_noise=0.8)
    support = load_split(write_split(tmp_path / "support", 120, world, seed=10 + seed))
    test = load_split(write_split(tmp_path / "test", 600, world, seed=20 + seed))
    fitted = selection.fit(support, FitOptions(folds=5, seed=seed))
    assert _test_r1(test, fitted, fitted.params["slerp"]["alpha"]) >= _test_r1(test, fitted, 0.0)


@pytest.mark.parametrize("seed", range(3))
def test_a_useless_new_model_keeps_weight_zero(tmp_path: Path, seed: int) -> None:
    # New embeddings that are pure noise: any weight above 0 only hurts.
    world = make_world(16, 24, 8, seed=seed)
    folders = {name: write_split(tmp_path / name, n, world, seed=s) for name, n, s in (("s", 200, 1), ("t", 500, 2))}
    rng = np.random.default_rng(seed)
    for folder in folders.values():
        for name in ("new_query.npy", "new_target.npy"):
            np.save(folder / name, rng.standard_normal(np.load(folder / name).shape).astype(np.float32))
    support, test = load_split(folders["s"]), load_split(folders["t"])
    fitted = selection.fit(support, FitOptions(folds=5, seed=seed))
    assert _test_r1(test, fitted, fitted.params["slerp"]["alpha"]) >= _test_r1(test, fitted, 0.0)


def test_several_modalities_share_one_r_and_draw_folds_per_id_over_all(two_modality_splits: dict[str, Split]) -> None:
    text, image = two_modality_splits["text"], two_modality_splits["image"]  # ids 0..199: shared with text
    joint = crossfit.assign_joint([text, image], 4, np.random.default_rng(0))
    (tq, _), (iq, it) = joint
    assert np.array_equal(tq[:200], iq) and np.array_equal(iq, it)  # one id, one fold, whatever the split
    fitted = selection.fit_modalities({"text": text, "image": image}, FitOptions(folds=4))
    assert set(fitted.params) == set(fitted.reports) == {"text", "image"}
    assert fitted.reports["image"]["support_queries"] == 200
    assert fitted.reports["text"]["fit_rows_all_modalities"] == 2 * 300 + 2 * 200
    with pytest.raises(InputError, match="no support set"):
        selection.fit_modalities({})
