"""Fitting the adapter heads: the MKP adapter (adapter), and SLERP between the old query and its output (adapter+slerp).

Cross-fitted (the default): one adapter per fold on the other folds, scored on its held-out fold
after every epoch; the epochs are chosen by early stopping there (mapped_selection.fit_mapped_slerp), the
final adapter trains for that many, and adapter+slerp's alpha is chosen at that epoch.  The report
compares the adapter with Procrustes on the same held-out folds.  --same-set trains once, all epochs.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from service.compat import mapped_selection, support_blocks
from service.compat.adapter import AdapterConfig, EpochHook, TrainedAdapter, train_adapter
from service.compat.fit_inputs import ModelIds
from service.compat.fit_options import FitOptions, FitOutcome, PlotPanel
from service.compat.io import Split
from service.compat.profile import CompatProfile
from service.errors import InputError
from service.rows import F32
from service.vocabulary import Head

# Early stopping needs room to stop in: without --epochs, a small support set trains for at least
# MIN_ADAPTER_STEPS optimiser steps (at most MAX_ADAPTER_EPOCHS epochs); the folds then pick the epoch.
# On the real corpus (4,000 rows, batch 256) 10 epochs left the held-out score still rising.
MIN_ADAPTER_STEPS = 300
MAX_ADAPTER_EPOCHS = 50


def max_epochs(rows: int, batch_size: int, default: int) -> int:
    """Epochs an early-stopped adapter may train: the config's, raised to reach MIN_ADAPTER_STEPS steps."""
    steps_per_epoch = max(1, -(-rows // batch_size))
    return max(default, min(MAX_ADAPTER_EPOCHS, -(-MIN_ADAPTER_STEPS // steps_per_epoch)))


def adapter_config(split: Split, options: FitOptions) -> AdapterConfig:
    """The adapter's config: the overrides and the seed, and room for early stopping unless --epochs is given."""
    try:
        config = AdapterConfig(**{**options.adapter, "seed": options.seed})
        if "epochs" not in options.adapter and not options.same_set:
            rows = len(support_blocks.support_pairs(split, options.fit_on)[0])
            config = replace(config, epochs=max_epochs(rows, config.batch_size, config.epochs))
    except ValueError as exc:
        raise InputError(f"adapter options: {exc}") from exc
    return config


def fit_adapter(split: Split, supports: dict[str, Path], head: Head, ids: ModelIds, options: FitOptions) -> FitOutcome:
    """--head adapter / adapter+slerp on the one support split of `supports`: the profile with the adapter."""
    ((modality, _),) = supports.items()
    config = adapter_config(split, options)
    fit_on, folds, same_set = options.fit_on, options.folds, options.same_set

    def fit_map(
        new: F32,
        old: F32,
        on_epoch: EpochHook | None = None,
        stop_after: int | None = None,
    ) -> TrainedAdapter:
        return train_adapter(new, old, config, progress=options.progress, on_epoch=on_epoch, stop_after=stop_after)

    before = torch.get_num_threads()
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    try:
        if head is Head.adapter and same_set:
            new, old, blocks = support_blocks.support_pairs(split, fit_on)
            adapter = fit_map(new, old)
            report: dict[str, Any] = {
                "selection": "none (the adapter head has no weight to choose)",
                "folds": 0,
                "fit_on": fit_on,
                "fit_blocks": blocks,
                "fit_rows": len(new),
                "support_queries": len(split.old_query),
                "support_targets": len(split.old_target),
            }
            alphas: dict[str, float] = {modality: 1.0}
            params: dict[str, dict[str, dict[str, float]]] = {}
        else:
            result = mapped_selection.fit_mapped_slerp(
                split, fit_map, options, mode=head.value, early_stop=not same_set
            )
            adapter, report = result.mapper, result.report
            alphas = {modality: result.alpha}
            params = {modality: {head.value: {"alpha": result.alpha}}}
            if head is Head.adapter:
                # The adapter head serves the map alone: the SLERP curve only fed the comparison.
                report = {k: v for k, v in report.items() if k not in ("support_recall", "chosen", "alpha_grid")}
                report["selection"] = f"none (no weight to choose); epochs by early stopping on {folds} folds"
                alphas, params = {modality: 1.0}, {}
    finally:
        torch.set_num_threads(before)
    profile = CompatProfile(
        head=head.value,
        old_dim=split.old_dim,
        new_dim=split.new_dim,
        alphas=alphas,
        params=params,
        fit_on=fit_on,
        folds=int(report["folds"]),
        fit_report={**report, "query_modality": modality, "zero_rows_dropped": split.zero_rows},
        tensors={k: v.numpy() for k, v in adapter.state_dict_tensors().items()},
        adapter=adapter.meta(),
        old_model_id=ids.old,
        new_model_id=ids.new,
        models=ids.record,
    )
    panels: list[PlotPanel] = []
    if "support_recall" in report:
        panels.append((report, f"{split.new_dim} -> {split.old_dim} adapter, {modality} queries, fit on {fit_on}"))
    return FitOutcome(profile=profile, reports={modality: report}, panels=panels, head_why=None, supports=supports)
