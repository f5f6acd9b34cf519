"""`nobackfill eval` without the CLI: every method's Recall@K, compatibility and flips on a test split.

Rows of a Procrustes profile: old (old->old, the reference), new (new->new, only when new_target.npy
exists: a re-indexed gallery, so neither compatibility nor a weight applies), aligned (Procrustes
only), midpoint (NLERP at 0.5), slerp / nlerp / adaptive (the profile's weights), oracle (the best
SLERP weight on the grid chosen on this very test set: an upper bound, never deployable).
Adapter profiles: old, new, adapter, and adapter+slerp when the profile has it.
psp / lsp profiles (the split holds logits): the gallery is the old model's PSP / LSP features of
old_target (psp.gallery_features, as `gallery build` must write it); rows old (old-model features of
the queries), new (new->new features, when new_target.npy exists), psp / lsp (new-model logits through
the head), and the raw-logit baseline the heads replace: old-logits (normalised old logits against a
gallery of normalised old logits, its reference) and new-logits (the new model's logits of the old
classes, through class_map, against that same raw gallery; its compatible / pfr / nfr are against
old-logits, not against old).
Every upgraded row goes through heads.transform, exactly as the service does.  Each upgraded row
carries its differences from the reference (R@1/5/10, MRR@10, nDCG@10) with 95 % paired bootstrap
intervals (uncertainty.py), and `compatible` is three-valued on the judged metric (R@10 unless told):
compatible when the whole interval is above 0, not compatible below, else not distinguishable;
`compatible@1` is the same on R@1.  Where the split has new targets, ARR@10 and nDCG@10 retention
(against new->new) come with their intervals.  pfr / nfr are flips against the reference at Recall@1.
The `<head>+csls` row also carries `vs_uncorrected`: its differences from the same head without the
hubness correction, paired on the same queries, so what the correction itself adds has its own interval.
A psp / lsp profile gets no `+csls` row: its gallery is class features, not a space mapped queries share.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt

from service.compat import psp
from service.compat.arcsearch import summarise_blends
from service.compat.curves import ALPHA_GRID, slerp_lambda
from service.compat.heads import transform_in_chunks
from service.compat.hubness import augmented, item_bias
from service.compat.io import Split
from service.compat.metrics import KS, flip_rates, ranks, recall_at_k, relevance
from service.compat.procrustes import normalize_rows
from service.compat.profile import CompatProfile
from service.compat.uncertainty import METRICS, paired_differences, per_query, retention, summary
from service.errors import InputError
from service.rows import F32
from service.vocabulary import HeadFamily, Mode

JUDGE = "recall@10"  # the metric `compatible` is judged on unless told: R@1 alone flips on a handful of queries


def slerp_curve(
    rotation: npt.NDArray[np.float32], split: Split, targets: npt.NDArray[np.float32]
) -> dict[float, dict[int, float]]:
    """Recall@K of SLERP at every grid weight on this split, under R (two matmuls, arcsearch.py)."""
    rel = relevance(split.query_ids, split.target_ids)
    summary, theta, _ = summarise_blends(split.old_query, split.new_query, rotation, targets, rel, k=max(KS))
    return {a: recall_at_k(summary.ranks(slerp_lambda(a, theta)), KS) for a in ALPHA_GRID}


def oracle_alpha(curve: dict[float, dict[int, float]]) -> float:
    """Best weight of a test curve (ties: better @5, @10, then smaller alpha): an upper bound, not deployable."""
    return max(curve, key=lambda a: (curve[a][1], curve[a][5], curve[a][10], -a))


def _oracle_alpha(profile: CompatProfile, split: Split, targets: npt.NDArray[np.float32]) -> float:
    """Best SLERP weight on the grid for this test set (ties: better @5, @10, then smaller alpha)."""
    return oracle_alpha(slerp_curve(profile.rotation, split, targets))


def method_row(
    method: str,
    alpha: float | None,
    rank: npt.NDArray[np.int64],
    against: npt.NDArray[np.int64],
    reference: bool = False,
    ceiling: npt.NDArray[np.int64] | None = None,
    judge: str = JUDGE,
) -> dict[str, Any]:
    """One row: its metrics, flips against the ranks `against`, and (not for a reference row) its differences
    from them with intervals, its verdicts and, given the re-indexed ranks `ceiling`, its retention."""
    means = {metric: float(values.mean()) if len(values) else 0.0 for metric, values in per_query(rank).items()}
    pfr, nfr = flip_rates(against < 1, rank < 1)
    judged: dict[str, Any] = {"vs_old": None, "compatible": None, "compatible@1": None}
    if not reference:
        judged = summary(rank, against, judge)
    return {
        "method": method,
        "alpha": alpha,
        **{metric: means[metric] for metric in METRICS},
        **judged,
        "judged_on": None if reference else judge,
        "retention": None if reference or ceiling is None else retention(rank, ceiling),
        "pfr": pfr,
        "nfr": nfr,
    }


def evaluate(
    profile: CompatProfile, split: Split, modality: str, judge: str = JUDGE, hubness_queries: F32 | None = None
) -> list[dict[str, Any]]:
    """Score every method of the profile's head family on the test split (see the module docstring).

    hubness_queries: unit mapped queries (a support set's or traffic's, through the head): adds the row
    `<head>+csls`, the head with each target's hubness bias subtracted, as the service serves it (hubness.py).
    """
    if judge not in METRICS:
        raise InputError(f"--judge must be one of {', '.join(METRICS)}, got {judge!r}")
    if split.old_dim != profile.old_dim or split.new_dim != profile.new_dim:
        raise InputError(
            f"{split.path}: dims old {split.old_dim} / new {split.new_dim} do not match the profile's "
            f"{profile.old_dim} / {profile.new_dim}"
        )
    if profile.family is HeadFamily.classes:
        return _evaluate_classes(profile, split, judge)
    targets = normalize_rows(split.old_target)
    rel = relevance(split.query_ids, split.target_ids)

    known: dict[str, tuple[float, npt.NDArray[np.int64]]] = {}  # mode -> (alpha, ranks) at the profile's weight

    def run(mode: str, alpha: float | None = None) -> tuple[float, npt.NDArray[np.int64]]:
        if alpha is None and str(mode) in known:
            return known[str(mode)]
        done = transform_in_chunks(profile, mode, split.old_query, split.new_query, modality, alpha)
        return done.alpha, ranks(done.queries, targets, rel)

    _, old_rank = run("old")
    rows = [method_row("old", 0.0, old_rank, old_rank, reference=True)]
    new_rank = None
    if split.new_target is not None:
        new_rank = ranks(normalize_rows(split.new_query), normalize_rows(split.new_target), rel)
        rows.append(method_row("new", None, new_rank, old_rank, reference=True))
    upgraded = partial(method_row, against=old_rank, ceiling=new_rank, judge=judge)
    if hubness_queries is not None:
        done = transform_in_chunks(profile, profile.head, split.old_query, split.new_query, modality)
        q, t = augmented(done.queries, targets, item_bias(targets, hubness_queries))
        csls_rank = ranks(q, t, rel)
        known[str(profile.head)] = (done.alpha, ranks(done.queries, targets, rel))  # its own row reuses them
        corrected = upgraded(f"{profile.head}+csls", done.alpha, csls_rank)
        # What the correction itself adds: the same queries through the same head without it, paired.
        corrected["vs_uncorrected"] = paired_differences(csls_rank, known[str(profile.head)][1])
        rows.append(corrected)
    if profile.family is HeadFamily.adapter:
        for mode in profile.modes():
            if mode != Mode.old:
                used, rank = run(mode)
                rows.append(upgraded(mode, used, rank))
        return rows
    for method, mode, alpha in (
        ("aligned", Mode.aligned, None),
        ("midpoint", Mode.nlerp, 0.5),
        ("slerp", Mode.slerp, None),
        ("nlerp", Mode.nlerp, None),
        ("adaptive", Mode.adaptive, None),
    ):
        used, rank = run(mode, alpha)
        rows.append(upgraded(method, used, rank))
    oracle = _oracle_alpha(profile, split, targets)
    used, rank = run("slerp", oracle)
    rows.append(upgraded("oracle", used, rank))
    return rows


def _evaluate_classes(profile: CompatProfile, split: Split, judge: str) -> list[dict[str, Any]]:
    """Rows of a psp / lsp profile: its head and the raw-logit baseline, each against its own gallery."""
    head: psp.ClassSpace = "psp" if profile.head == "psp" else "lsp"
    rel = relevance(split.query_ids, split.target_ids)
    top_k = profile.top_k
    gallery = psp.gallery_features(split.old_target, head, top_k)
    old_rank = ranks(psp.gallery_features(split.old_query, head, top_k), gallery, rel)
    rows = [method_row("old", 0.0, old_rank, old_rank, reference=True)]
    new_rank = None
    if split.new_target is not None:
        new_gallery = psp.gallery_features(split.new_target, head, top_k)
        new_rank = ranks(psp.gallery_features(split.new_query, head, top_k), new_gallery, rel)
        rows.append(method_row("new", None, new_rank, old_rank, reference=True))
    queries = transform_in_chunks(profile, head, None, split.new_query, "text").queries
    rows.append(method_row(head, 1.0, ranks(queries, gallery, rel), old_rank, ceiling=new_rank, judge=judge))
    raw_gallery = normalize_rows(split.old_target)
    raw_old = ranks(normalize_rows(split.old_query), raw_gallery, rel)
    rows.append(method_row("old-logits", None, raw_old, raw_old, reference=True))
    cols = np.arange(profile.old_classes) if profile.class_map is None else np.asarray(profile.class_map)
    raw_new = ranks(normalize_rows(split.new_query[:, cols]), raw_gallery, rel)
    rows.append(method_row("new-logits", None, raw_new, raw_old, judge=judge))
    return rows
