"""What a fit reads besides the support pairs: the model ids it records and the unlabelled query pairs it adds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from service.compat.io import Split, load_query_pairs
from service.encoders.identity import MODELS_JSON, ModelIdentity, read_models_json
from service.errors import InputError
from service.rows import F32


class ModelIds(NamedTuple):
    """The model ids a profile records, and the two identities (ModelIdentity.as_dict) when known."""

    old: str
    new: str
    record: dict[str, Any] | None


def model_ids(support_dir: Path, split: Split, old_id: str | None, new_id: str | None) -> ModelIds:
    """Ids from SUPPORT_DIR/models.json (written by `support build`), the given ones overriding them.

    Without models.json both ids must be given: the service compares them with its encoders' and its
    gallery's, so a guessed id would either refuse a good profile or accept a wrong one.
    """
    found = read_models_json(support_dir)
    if found is None:
        missing = [f"--{side}-model-id" for side, given in (("old", old_id), ("new", new_id)) if given is None]
        if missing:
            raise InputError(
                f"{support_dir / MODELS_JSON}: missing; pass {' and '.join(missing)} "
                "(or build the support set with `nobackfill support build`, which writes it)"
            )
        assert old_id is not None and new_id is not None
        return ModelIds(old_id, new_id, None)
    old, new = found
    for identity, dim, side in ((old, split.old_dim, "old"), (new, split.new_dim, "new")):
        if identity.dim != dim:
            raise InputError(
                f"{support_dir / MODELS_JSON}: the {side} model is {identity.dim}-d, "
                f"but {side}_query.npy holds {dim}-d rows"
            )
    old = replace(old, model_id=old_id) if old_id else old
    new = replace(new, model_id=new_id) if new_id else new
    return ModelIds(old.model_id, new.model_id, {"old": old.as_dict(), "new": new.as_dict()})


def query_pairs(folders: Sequence[Path], split: Split, ids: ModelIds) -> list[tuple[F32, F32]]:
    """(new, old) rows of every query-pairs folder, checked against the support's dims and models."""

    out = []
    for folder in folders:
        pairs = load_query_pairs(folder)
        if (pairs.old.shape[1], pairs.new.shape[1]) != (split.old_dim, split.new_dim):
            raise InputError(
                f"{folder}: query pairs are {pairs.new.shape[1]} -> {pairs.old.shape[1]}, but the support pairs are "
                f"{split.new_dim} -> {split.old_dim}"
            )
        for side, theirs, ours_id in (("old", pairs.old_model, ids.old), ("new", pairs.new_model, ids.new)):
            if theirs is None:
                continue
            ours = ModelIdentity.from_dict(ids.record[side], side) if ids.record else None
            same = ours.same_model(theirs) if ours is not None else theirs.model_id == ours_id
            if not same:
                print_id = f"{theirs.model_id} ({theirs.fingerprint or 'no fingerprint'})"
                raise InputError(
                    f"{folder / MODELS_JSON}: the {side} model is {print_id}, not the support's {ours_id}; "
                    "query pairs must come from the same two models"
                )
        if not len(pairs.new):
            raise InputError(f"{folder}: no usable query pairs (every row is all-zero)")
        out.append((pairs.new, pairs.old))
    return out
