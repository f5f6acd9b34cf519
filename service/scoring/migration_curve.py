"""`backfill curve`: load a profile and a test set, score hybrid search as items move (evaluate.py), plot it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from service.compat.calibration import IDENTITY
from service.errors import InputError
from service.plots import png_of, pyplot
from service.scoring.migration import (
    Spaces,
    compatible_queries,
    curve,
    gain_share,
    hot_order,
    move_order,
    old_system_right,
    zipf_weights,
)
from service.vocabulary import Merge


def score_curve(
    profile_dir: Path,
    test_dir: Path,
    fractions: Sequence[float],
    *,
    merge: str = "calibrated",
    order: str = "random",
    zipf: float | None = None,
    traffic: int = 10_000,
    modality: str | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """The curve's rows, each row's share of the gain, and a title and caption saying how it was made."""
    if not Merge.has(merge):
        raise InputError(f"--merge must be one of {', '.join(Merge)}, got {merge!r}")
    if order not in ("random", "hot"):
        raise InputError(f"--order must be random or hot, got {order!r}")
    if not fractions or any(not 0.0 <= f <= 1.0 for f in fractions) or list(fractions) != sorted(fractions):
        raise InputError(f"--fractions must rise within [0, 1], got {list(fractions)}")
    profile, modality, split, served = compatible_queries(
        profile_dir, test_dir, modality, "the curve needs the targets through both models"
    )
    score_map = profile.score_map(modality)
    if Merge(merge) == Merge.calibrated and score_map is None:
        raise InputError(
            f"profile {profile.profile_id} has no calibration for {modality} queries: refit it with `nobackfill fit` "
            "on a support set with new_target.npy, or pass --merge raw / rrf"
        )
    spaces = Spaces.of(split, served)
    weights = zipf_weights(len(spaces.served), zipf, seed) if zipf is not None else None
    if order == "hot":
        if weights is None:
            raise InputError("--order hot needs --zipf S: hit counts come from traffic with a popularity")
        moves = hot_order(spaces, weights, traffic, seed)
    else:
        moves = move_order(len(spaces.old_targets), seed)
    old_right = old_system_right(split, spaces)
    rows = curve(spaces, fractions, moves, Merge(merge), score_map or IDENTITY, weights, seed, old_right)
    traffic_text = f"queries weighted by Zipf({zipf})" if zipf is not None else "every query once"
    return {
        "title": f"hybrid search as items move: profile {profile.profile_id} on {test_dir} ({modality} queries)",
        "caption": (
            f"{len(spaces.old_targets):,} targets moved in {order} order, merge {merge}; {traffic_text}; "
            "95 % bootstrap intervals over queries; "
            "share of the gain = (R@1 - R@1 at 0 %) / (R@1 at 100 % - R@1 at 0 %); "
            "negative flips = queries the old system answered right at rank 1, answered wrong now"
        ),
        "rows": rows,
        "gain_share": gain_share(rows),
        "merge": merge,
        "order": order,
        "zipf": zipf,
    }


def plot_curves(curves: Mapping[str, list[dict[str, Any]]], title: str) -> bytes:
    """R@1 and R@10 against the moved share for each named curve, with interval bands, as PNG bytes."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    for ax, k in zip(axes, (1, 10), strict=True):
        for name, rows in curves.items():
            x = [100 * r["fraction"] for r in rows]
            ax.plot(x, [r[f"recall@{k}"] for r in rows], "o-", label=name)
            ax.fill_between(x, [r[f"ci@{k}"][0] for r in rows], [r[f"ci@{k}"][1] for r in rows], alpha=0.2)
        ax.set_xlabel("items moved into the segment (%)")
        ax.set_ylabel(f"R@{k}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    return png_of(fig)
