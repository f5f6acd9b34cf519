"""The fit plot's heading: the profile, its models and head, and what a weight of 0 means."""

from __future__ import annotations

from types import SimpleNamespace

from service.commands.render import plot_heading, verdict_line


def profile(alpha: float) -> SimpleNamespace:
    return SimpleNamespace(
        profile_id="abc123", old_model_id="old-m", new_model_id="new-m", head="slerp", alphas={"text": alpha}
    )


def test_the_heading_names_the_profile_and_says_what_alpha_0_means() -> None:
    zero = plot_heading(profile(0.0), "no blend beats slerp")
    assert zero.startswith("profile abc123: old-m <- new-m; head slerp, alpha text 0.0")
    assert "serves the old query unchanged" in zero and "no blend beats" not in zero
    chosen = plot_heading(profile(0.4), "no blend beats slerp")
    assert chosen.endswith("no blend beats slerp") and "unchanged" not in chosen


def report(ceiling: float | None) -> dict[str, object]:
    rows = [{"alpha": a, "recall@1": r} for a, r in ((0.0, 0.40), (0.5, 0.46), (1.0, 0.30))]
    return {
        "chosen": {"slerp": rows[1]},
        "support_recall": {"slerp": rows},
        "new_to_new": None if ceiling is None else {"recall@1": ceiling},
    }


def test_the_verdict_line_sets_the_chosen_weight_between_old_and_new() -> None:
    line = verdict_line(report(0.70))
    assert line is not None
    assert "old->old 0.400, slerp at alpha 0.5 0.460 (+6.0 points), new->new 0.700" in line
    assert line.endswith("20% of what a re-index gains")  # 6 of the 30 points
    assert "new->new" not in (verdict_line(report(None)) or "")
    assert verdict_line({"chosen": {}, "support_recall": {}}) is None
