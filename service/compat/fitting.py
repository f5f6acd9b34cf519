"""Fitting a compat profile on support folders: load the splits, choose the head, fit, and return the profile.

`fit_profile(supports, options)` is what `nobackfill fit` runs, without the command line: supports maps
each query modality to its support folder, FitOptions holds every other choice.  The head picks the family:
- slerp / nlerp / adaptive / aligned: Procrustes R plus every blend weight, cross-fitted (selection.py);
  with several support folders, one R over all their pairs and the blend weights chosen per modality.
  No head given: slerp, or nlerp / adaptive when it beats slerp on the cross-fitted curve by more than
  slerp's standard error.
- adapter / adapter+slerp: the MKP adapter (fit_adapter.py).
- psp / lsp: P_tk from the class counts of the support logits (fit_classes.py).

The model ids come from each support folder's models.json, the options' ids overriding them.  All-zero
rows drop their pairs; each drop is one line passed to `warn` (FitOptions.strict refuses them instead).
Nothing is written: the caller saves the outcome's profile (profile.save_profile) where it wants.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from service.compat import selection
from service.compat.calibration import basis_tensors, fit_score_map, reference_tensors
from service.compat.fit_inputs import ModelIds, model_ids, query_pairs
from service.compat.fit_options import FitOptions, FitOutcome, check_options
from service.compat.heads import transform_in_chunks
from service.compat.hubness import K as HUBNESS_K
from service.compat.hubness import augmented, item_bias
from service.compat.io import Split, load_split
from service.compat.metrics import ranks, relevance
from service.compat.procrustes import normalize_rows
from service.compat.profile import CompatProfile
from service.compat.uncertainty import paired_differences, verdict
from service.errors import InputError
from service.rows import F32
from service.vocabulary import ADAPTER_HEADS, CLASS_HEADS, PROCRUSTES_HEADS, FitOn, Head

Warn = Callable[[str], None]
# The hubness check ranks at most this many support queries (seeded sample) against every support target.
HUBNESS_CHECK_QUERIES = 5000


def _ignore(_: str) -> None:
    """The default warning sink: the fit report counts the dropped rows anyway."""


def fit_profile(supports: Mapping[str, Path], options: FitOptions, warn: Warn = _ignore) -> FitOutcome:
    """Fit the profile FitOptions asks for on the support folder of every query modality in `supports`."""
    check_options(options)
    if not supports:
        raise InputError("no support set: pass SUPPORT_DIR or --support MODALITY=DIR")
    if len(supports) > 1:
        return _fit_modalities(dict(supports), options, warn)
    head = options.chosen_head
    ((modality, support_dir),) = supports.items()
    split = load_split(
        support_dir,
        require_new_target=options.fit_on is FitOn.target and head not in CLASS_HEADS,
        strict=options.strict,
    )
    _warn_zero_rows(split, warn)
    ids = model_ids(support_dir, split, options.old_model_id, options.new_model_id)
    if head in CLASS_HEADS:
        from service.compat.fit_classes import fit_classes

        return fit_classes(split, {modality: support_dir}, head, ids, options)
    if head in ADAPTER_HEADS:
        from service.compat.fit_adapter import fit_adapter  # imports torch: only for the adapter heads

        return _checked(fit_adapter(split, {modality: support_dir}, head, ids, options), {modality: split})
    return _checked(_fit_procrustes(split, modality, support_dir, ids, options), {modality: split})


def _checked(outcome: FitOutcome, splits: Mapping[str, Split]) -> FitOutcome:
    """The outcome with its calibration and its hubness check (what fit decides beyond the head)."""
    return _hubness_checked(_calibrated(outcome, splits), splits)


def _hubness_checked(outcome: FitOutcome, splits: Mapping[str, Split]) -> FitOutcome:
    """The outcome with, per modality, whether the hubness correction helps the head on the support (hubness.py).

    Cross-fitted over two halves of the support's queries: each half is ranked against every support
    target with the bias computed from the other half's mapped queries, and without it; the paired
    intervals of the R@1 and R@10 differences decide (helps: above 0 at one, below at neither).
    """
    checks = {}
    for modality, split in splits.items():
        served = normalize_rows(
            transform_in_chunks(
                outcome.profile, outcome.profile.head, split.old_query, split.new_query, modality
            ).queries
        )
        checks[modality] = hubness_check(served, normalize_rows(split.old_target), split)
    fit_report = {**outcome.profile.fit_report, "hubness": checks}
    return dataclasses.replace(outcome, profile=dataclasses.replace(outcome.profile, fit_report=fit_report))


def hubness_check(served: F32, targets: F32, split: Split, k: int = HUBNESS_K, seed: int = 0) -> dict[str, Any]:
    """R@1 of the served queries with and without the bias, each half's bias from the other half (see above)."""
    rng = np.random.default_rng(seed)
    rows = (
        np.arange(len(served))
        if len(served) <= HUBNESS_CHECK_QUERIES
        else rng.choice(len(served), HUBNESS_CHECK_QUERIES, replace=False)
    )
    served, query_ids, n = served[rows], split.query_ids[rows], len(rows)
    halves = np.array_split(rng.permutation(n), 2)
    with_bias = np.full(n, len(targets), dtype=np.int64)
    plain = ranks(served, targets, relevance(query_ids, split.target_ids))
    for mine, other in ((halves[0], halves[1]), (halves[1], halves[0])):
        if len(other) < k or not len(mine):
            return {"decided": False, "why": f"{n} support queries: too few to split for the check"}
        part = relevance(query_ids[mine], split.target_ids)
        q, t = augmented(served[mine], targets, item_bias(targets, served[other], k))
        with_bias[mine] = ranks(q, t, part)
    d = paired_differences(with_bias, plain)
    verdicts = {verdict(d[metric]) for metric in ("recall@1", "recall@10")}
    return {
        "decided": True,
        "k": k,
        "queries": n,
        **{
            f"{metric}_{side}": float((r < cut).mean())
            for metric, cut in (("recall@1", 1), ("recall@10", 10))
            for side, r in (("without", plain), ("with", with_bias))
        },
        "difference": d["recall@1"],
        "difference@10": d["recall@10"],
        # As the rollout gate reads two metrics: better beyond the noise at one, worse at neither.
        "helps": "compatible" in verdicts and "not compatible" not in verdicts,
    }


def _calibrated(outcome: FitOutcome, splits: Mapping[str, Split]) -> FitOutcome:
    """The outcome with the hybrid merge's score map per modality whose support has new targets (calibration.py).

    Fitted on the support's compatible queries (the head as served) against both spaces' targets; a
    support without new_target.npy gets none, and hybrid then merges raw cosines.
    """
    calibration, reports, tensors = {}, {}, dict(outcome.profile.tensors)
    for modality, split in splits.items():
        if split.new_target is None:
            continue
        served = transform_in_chunks(outcome.profile, outcome.profile.head, split.old_query, split.new_query, modality)
        score_map, report = fit_score_map(
            served.queries,
            normalize_rows(split.old_target),
            normalize_rows(split.new_query),
            normalize_rows(split.new_target),
            relevance(split.query_ids, split.target_ids),
            seed=0,
        )
        calibration[modality], reports[modality] = score_map.as_dict(), report
        refs = score_map.references
        if refs is not None:
            old_name, new_name = reference_tensors(modality)
            tensors[old_name], tensors[new_name] = refs.old, refs.new
            for name, basis in zip(basis_tensors(modality), refs.bases, strict=True):
                if basis is not None:
                    tensors[name] = basis
    if not calibration:
        return outcome
    fit_report = {**outcome.profile.fit_report, "calibration": reports}
    profile = dataclasses.replace(outcome.profile, calibration=calibration, fit_report=fit_report, tensors=tensors)
    return dataclasses.replace(outcome, profile=profile)


def _warn_zero_rows(split: Split, warn: Warn) -> None:
    """One warning when all-zero rows were dropped from the split."""
    line = split.zero_rows_line()
    if line is not None:
        warn(f"{line} (--strict refuses them)")


def _head_alpha(head: Head, params: dict[str, dict[str, float]]) -> float:
    """The served head's weight: 1 for aligned (the map alone), the base a for adaptive, alpha otherwise."""
    return 1.0 if head is Head.aligned else params[head.value].get("alpha", params["adaptive"]["a"])


def _fit_procrustes(split: Split, modality: str, support_dir: Path, ids: ModelIds, options: FitOptions) -> FitOutcome:
    """One support folder, a Procrustes head: R and every blend weight, cross-fitted (or same-set)."""
    result = selection.fit(split, options, query_pairs(options.query_pairs, split, ids))
    head, why = options.chosen_head, None
    if options.head is None:
        head, why = Head(result.report["best_head"]["head"]), result.report["best_head"]["why"]
    profile = CompatProfile(
        head=head.value,
        old_model_id=ids.old,
        new_model_id=ids.new,
        models=ids.record,
        old_dim=split.old_dim,
        new_dim=split.new_dim,
        alphas={modality: float(_head_alpha(head, result.params))},
        params={modality: result.params},
        fit_on=options.fit_on,
        folds=int(result.report["folds"]),
        fit_report={**result.report, "query_modality": modality, "zero_rows_dropped": split.zero_rows},
        tensors={"R": result.rotation},
    )
    title = f"{split.new_dim} -> {split.old_dim}, {modality} queries, fit on {options.fit_on.value}"
    return FitOutcome(
        profile=profile,
        reports={modality: result.report},
        panels=[(result.report, title)],
        head_why=why,
        supports={modality: support_dir},
    )


def _fit_modalities(dirs: dict[str, Path], options: FitOptions, warn: Warn) -> FitOutcome:
    """Several support folders: one R over all their pairs, the blend weights chosen per query modality."""
    head = options.head
    if head is not None and head not in PROCRUSTES_HEADS:
        raise InputError(
            f"--head {head.value} fits one query modality; several --support folders need "
            f"{' / '.join(PROCRUSTES_HEADS)}"
        )
    fit_on = options.fit_on
    splits = {
        m: load_split(d, require_new_target=fit_on is FitOn.target, strict=options.strict) for m, d in dirs.items()
    }
    first = next(iter(splits))
    for m, s in splits.items():
        _warn_zero_rows(s, warn)
        if (s.old_dim, s.new_dim) != (splits[first].old_dim, splits[first].new_dim):
            raise InputError(
                f"{dirs[m]}: {m} pairs are {s.new_dim} -> {s.old_dim}, but the {first} pairs in {dirs[first]} are "
                f"{splits[first].new_dim} -> {splits[first].old_dim}"
            )
    # An empty id counts as not given here (one folder's ids must not be ""-overridden for all).
    old_id, new_id = options.old_model_id or None, options.new_model_id or None
    ids = {m: model_ids(dirs[m], s, old_id, new_id) for m, s in splits.items()}
    for m, i in ids.items():
        if (i.old, i.new, i.record) != (ids[first].old, ids[first].new, ids[first].record):
            raise InputError(
                f"{dirs[m]}: models {i.old} -> {i.new} differ from {dirs[first]}'s {ids[first].old} -> "
                f"{ids[first].new}; one profile serves one model pair"
            )
    pairs = query_pairs(options.query_pairs, splits[first], ids[first])
    fitted = selection.fit_modalities(splits, options, pairs)
    why = None
    if head is None:
        favoured = {fitted.reports[m]["best_head"]["head"] for m in splits}
        agree = len(favoured) == 1
        head = Head(next(iter(favoured))) if agree else Head.slerp
        why = "; ".join(f"{m}: {fitted.reports[m]['best_head']['why']}" for m in splits)
        if not agree:
            why += " (the modalities disagree, so slerp serves them all)"
    first_rep = fitted.reports[first]
    report: dict[str, Any] = {
        **{k: first_rep[k] for k in ("selection", "criterion", "criterion_text", "folds", "fit_on", "eval_gallery")},
        "query_modalities": list(splits),
        "fit_rows": first_rep["fit_rows_all_modalities"],
        "support_queries": sum(len(s.old_query) for s in splits.values()),
        "support_targets": sum(len(s.old_target) for s in splits.values()),
        "modalities": {m: {**fitted.reports[m], "support_dir": str(dirs[m])} for m in splits},
        "zero_rows_dropped": {f"{m}/{f}": c for m, s in splits.items() for f, c in s.zero_rows.items()},
    }
    profile = CompatProfile(
        head=head.value,
        old_model_id=ids[first].old,
        new_model_id=ids[first].new,
        models=ids[first].record,
        old_dim=splits[first].old_dim,
        new_dim=splits[first].new_dim,
        alphas={m: float(_head_alpha(head, fitted.params[m])) for m in splits},
        params=fitted.params,
        fit_on=fit_on,
        folds=int(first_rep["folds"]),
        fit_report=report,
        tensors={"R": fitted.rotation},
    )
    panels = [
        (fitted.reports[m], f"{splits[m].new_dim} -> {splits[m].old_dim}, {m} queries, fit on {fit_on.value}")
        for m in splits
    ]
    outcome = FitOutcome(profile=profile, reports=fitted.reports, panels=panels, head_why=why, supports=dirs)
    return _checked(outcome, splits)
