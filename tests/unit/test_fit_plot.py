"""The fit plot's heading: the profile, its models and head, and what a weight of 0 means."""

from __future__ import annotations

from types import SimpleNamespace

from service.commands.render import plot_heading


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
