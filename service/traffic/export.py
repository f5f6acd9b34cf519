"""`nobackfill traffic export` without the CLI (compat/io.py's load_query_pairs reads the folder back for fit).

    DIR/old_query.npy   [n, d_old] float32   old-model query embeddings, oldest pair first
    DIR/new_query.npy   [n, d_new] float32   the same queries through the new model
    DIR/models.json     the two identities (the format `support build` writes, source "traffic"),
                        the query modalities and how many stored pairs were refused

One export holds one model pair: the pair of the newest stored pair (the models being served now).
Stored pairs of any other model pair (left from before an upgrade) are refused: counted, named in
models.json and in the command's warning, never written.  The folder appears in one rename.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.compat.io import QUERY_NEW, QUERY_OLD  # the folder's file names, as load_query_pairs reads them
from service.encoders.identity import MODELS_JSON, ModelIdentity
from service.errors import InputError
from service.traffic.base import PairStore, parse_models_key


@dataclass(frozen=True)
class Exported:
    """What an export wrote and what it refused."""

    pairs: int
    old: ModelIdentity
    new: ModelIdentity
    modalities: dict[str, int]
    refused: dict[str, int]  # "old_id -> new_id" -> pairs refused


def _label(models: str) -> str:
    """'old_id -> new_id' for a models_key string (or the raw string when it does not parse)."""
    try:
        old, new = parse_models_key(models)
    except Exception:  # noqa: BLE001 (a malformed key is still reported, not fatal)
        return models[:80]
    return f"{old.model_id} -> {new.model_id}"


def export_pairs(store: PairStore, out: Path, *, limit: int | None = None, force: bool = False) -> Exported:
    """Write the store's newest `limit` pairs of the current model pair to `out`; InputError when there are none."""
    from service.atomic_dir import replace_dir, sibling_dir
    from service.bulk.support import models_json

    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not force)):
        raise InputError(f"{out}: exists and is not an empty folder (use --force to replace it)")
    stored = store.read(limit)
    if not stored.runs:
        raise InputError(f"the {store.kind} traffic store holds no pairs (is traffic.sample_rate above 0?)")
    current = stored.runs[0].models
    kept = [r for r in stored.runs if r.models == current]
    refused = Counter[str]()
    for run in stored.runs:
        if run.models != current:
            refused[_label(run.models)] += len(run)
    old_id, new_id = parse_models_key(current)
    # Oldest first, as the pairs were served: the runs and their rows are newest first.
    old = np.concatenate([r.old for r in kept])[::-1].astype(np.float32)
    new = np.concatenate([r.new for r in kept])[::-1].astype(np.float32)
    if old.shape[1] != old_id.dim or new.shape[1] != new_id.dim:
        raise InputError(
            f"stored pairs are {old.shape[1]}/{new.shape[1]}-d but their models say {old_id.dim}/{new_id.dim}"
        )
    modalities = dict(Counter(m for r in kept for m in r.modality))
    only = next(iter(modalities)) if len(modalities) == 1 else "mixed"
    meta: dict[str, Any] = models_json(
        old_id,
        new_id,
        only,
        "none",
        len(old),
        source="traffic",
        store=store.kind,
        query_modalities=modalities,
        refused_pairs=dict(refused),
    )
    tmp = sibling_dir(out)
    np.save(tmp / QUERY_OLD, old)
    np.save(tmp / QUERY_NEW, new)
    (tmp / MODELS_JSON).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    replace_dir(tmp, out)
    return Exported(len(old), old_id, new_id, modalities, dict(refused))
