"""What `fit` is asked to do (FitOptions) and what it hands back (FitOutcome), with the cheap checks of the options.

Imports nothing heavy (no numpy, no torch), so the command line can check its flags before loading anything.
The option names follow the `nobackfill fit` flags, and so do the error messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.errors import InputError
from service.vocabulary import ADAPTER_HEADS, CLASS_HEADS, Criterion, EvalGallery, FitOn, Head

if TYPE_CHECKING:
    from service.compat.profile import CompatProfile

# Weight of one unlabelled query pair (fit --add-query-pairs) against one labelled support row in R's
# fit; measured in docs/traffic-learning.md.
QUERY_PAIRS_WEIGHT = 1.0
# Held-out queries scored per fold (selection.MAX_EVAL_QUERIES, kept here so this module stays light).
EVAL_QUERIES = 5000

# One panel of the fit's plot: a selection report (support curve per weight) and its title.
PlotPanel = tuple[dict[str, Any], str]


@dataclass(frozen=True)
class FitOptions:
    """Every choice of one fit; the defaults are `nobackfill fit`'s.

    head: the head the profile serves; None chooses among the Procrustes blends on the cross-fitted curve.
    adapter: AdapterConfig fields to override (adapter heads only); threads: torch CPU threads while training.
    old_classes / top_k / class_map: psp / lsp only; class_map is the new-model index of each old class,
    as a sequence or as the comma-separated text --class-map takes.
    query_pairs: folders of unlabelled (old, new) query pairs that join R's fit, weighted by query_pairs_weight.
    old_model_id / new_model_id: the ids to record, overriding SUPPORT_DIR/models.json's (required without it).
    progress: draw the adapter's training progress on stderr.
    """

    head: Head | None = None
    fit_on: FitOn = FitOn.both
    folds: int = 5
    same_set: bool = False
    eval_queries: int = EVAL_QUERIES
    seed: int = 0
    criterion: Criterion = Criterion.mrr_1se
    eval_gallery: EvalGallery = EvalGallery.support
    strict: bool = False
    adapter: Mapping[str, Any] = field(default_factory=dict)
    threads: int | None = None
    old_classes: int | None = None
    top_k: int | None = None
    class_map: str | Sequence[int] | None = None
    query_pairs: Sequence[Path] = ()
    query_pairs_weight: float = QUERY_PAIRS_WEIGHT
    old_model_id: str | None = None
    new_model_id: str | None = None
    progress: bool = False

    @property
    def chosen_head(self) -> Head:
        """The head the checks and the fit start from: the given one, else slerp (the automatic choice's base)."""
        return self.head or Head.slerp


# `nobackfill fit`'s defaults: what a fit called without options (selection.fit, ...) selects with.
DEFAULT_OPTIONS = FitOptions()


@dataclass(frozen=True, eq=False)
class FitOutcome:
    """A fitted profile, not yet saved, and what a report of the fit needs.

    reports: per query modality, the selection report its weights were chosen on (the support curves).
    panels: the plot's panels, one per curve that was cross-fitted or scored; empty when there is nothing to plot.
    head_why: why the automatic choice picked the head (None when the head was given).
    supports: the support folder of every query modality.
    """

    profile: CompatProfile
    reports: dict[str, dict[str, Any]]
    panels: list[PlotPanel]
    head_why: str | None
    supports: dict[str, Path]


def check_options(options: FitOptions) -> None:
    """Refuse options that the chosen head would silently ignore, before any file is read."""
    head = options.chosen_head
    adapter = {**options.adapter, **({"threads": options.threads} if options.threads is not None else {})}
    given = {"old_classes": options.old_classes, "top_k": options.top_k, "class_map": options.class_map}
    classes = {k: v for k, v in given.items() if v is not None}
    if adapter and head not in ADAPTER_HEADS:
        names = ", ".join("--" + k.replace("_", "-") for k in adapter)
        raise InputError(f"{names} only apply to --head adapter / adapter+slerp, not {head.value}")
    if classes and head not in CLASS_HEADS:
        names = ", ".join("--" + k.replace("_", "-") for k in classes)
        raise InputError(f"{names} only apply to --head psp / lsp, not {head.value}")
    if options.query_pairs and head in (*ADAPTER_HEADS, *CLASS_HEADS):
        raise InputError(f"--add-query-pairs refits Procrustes' R; --head {head.value} has no R to refit")


def parse_class_map(class_map: str | Sequence[int] | None) -> list[int] | None:
    """'3,0,1' (or [3, 0, 1]) -> [3, 0, 1]; None stays None."""
    if class_map is None:
        return None
    if not isinstance(class_map, str):
        return [int(c) for c in class_map]
    try:
        return [int(part) for part in class_map.split(",") if part.strip()]
    except ValueError as exc:
        raise InputError(f"--class-map must be comma-separated integers, got {class_map!r}") from exc
