"""Fitting the psp / lsp heads: P_tk from the class counts alone; the support logits only feed the report.

SUPPORT_DIR holds LOGITS (old_query.npy: old-model logits of the queries [n, C_k], new_query.npy:
new-model logits [n, C_t], old_target.npy: old-model logits of gallery items).  The fit is data-free
apart from the class counts: P_tk depends on C_k, C_t and the class map only.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from service.compat import psp
from service.compat.evaluation import evaluate
from service.compat.fit_inputs import ModelIds
from service.compat.fit_options import FitOptions, FitOutcome, parse_class_map
from service.compat.io import Split
from service.compat.profile import CompatProfile
from service.errors import InputError
from service.vocabulary import Head


def fit_classes(split: Split, supports: dict[str, Path], head: Head, ids: ModelIds, options: FitOptions) -> FitOutcome:
    """--head psp / lsp: the profile with P_tk, its report scoring the head on the support logits."""
    class_map = parse_class_map(options.class_map)
    c_old, c_new = split.old_dim, split.new_dim
    if options.old_classes is not None and options.old_classes != c_old:
        raise InputError(
            f"{split.path / 'old_query.npy'}: {c_old} columns (old-model logits), but --old-classes is "
            f"{options.old_classes}"
        )
    try:
        p_tk = psp.correction_matrix(c_old, c_new, class_map)
        rotation = psp.prototype_rotation(c_old, c_new)
    except ValueError as exc:
        raise InputError(f"{split.path}: {exc} (old logits have {c_old} columns, new logits {c_new})") from exc
    classes = {"old_classes": c_old, "new_classes": c_new, "top_k": options.top_k, "class_map": class_map}
    report: dict[str, Any] = {
        "selection": "none (data-free: P_tk depends on the class counts only)",
        "folds": 0,
        "support_queries": len(split.old_query),
        "support_targets": len(split.old_target),
        "prototype_rotation_deg": math.degrees(rotation),
        "zero_rows_dropped": split.zero_rows,
    }
    profile = CompatProfile(
        head=head.value,
        old_dim=c_old,
        new_dim=c_new,
        alphas={},
        params={},
        fit_on="none",
        folds=0,
        fit_report=report,  # support_eval is added below
        tensors={"P_tk": p_tk.astype(np.float32)},
        classes=classes,
        old_model_id=ids.old,
        new_model_id=ids.new,
        models=ids.record,
    )
    # The support logits only describe the result (no parameter is chosen on them).
    report["support_eval"] = evaluate(profile, split, "text")
    return FitOutcome(profile=profile, reports={}, panels=[], head_why=None, supports=supports)
