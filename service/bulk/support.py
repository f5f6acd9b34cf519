"""Build a support folder for `nobackfill fit` from a pairs file and two model folders.

    read_pairs (pairs.py)            every row checked, images opened, targets deduplicated by id
    old model: load -> queries -> old_query.npy, targets -> old_target.npy -> unload
    new model: load -> queries -> new_query.npy, targets -> new_target.npy -> unload
    query_ids.npy, target_ids.npy, models.json -> the hidden folder renamed to --out

The models run one after the other, so the machine only ever holds one of them (two large models
need not fit at once).  The folder has the layout service/compat/io.py reads, plus models.json:
{"format_version": 1, "old": identity, "new": identity, "query_modality", "target_modality",
"pairs", ...}; `fit` takes the model identities from it.  Nothing appears at --out until every
file is complete; --force only ever replaces a folder that holds a support set.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

import service
from service.atomic_dir import check_output, staging
from service.bulk.atomic import make_parents, remove_empty
from service.bulk.encode import check_modality, encode_batch, load_encoder
from service.bulk.npy_writer import NpyWriter
from service.bulk.pairs import Pairs
from service.encoders.base import Encoder
from service.encoders.identity import MODELS_JSON, ModelIdentity
from service.vocabulary import Modality, Role

Log = Callable[[str], None]
FORMAT_VERSION = 1
_SUPPORT_MARKERS = (MODELS_JSON, "old_query.npy")


@dataclass(frozen=True)
class ModelSource:
    """One side of the upgrade: a backend name and its model folder (None for the synthetic backends)."""

    backend: str
    path: Path | None
    model_id: str | None = None


@dataclass(frozen=True)
class EncodeOptions:
    """How the models run: device, batch size, fp16 on CUDA, bfloat16 on CPU, CPU threads, progress bars."""

    device: str = "auto"
    batch_size: int = 64
    fp16: bool = True
    cpu_bf16: bool = False
    threads: int | None = None
    progress: bool = True


def models_json(
    old: ModelIdentity,
    new: ModelIdentity,
    query_modality: str,
    target_modality: str,
    pairs: int,
    **extra: Any,
) -> dict[str, Any]:
    """The content of a support folder's models.json."""
    return {
        "format_version": FORMAT_VERSION,
        "old": old.as_dict(),
        "new": new.as_dict(),
        "query_modality": query_modality,
        "target_modality": target_modality,
        "pairs": pairs,
        **extra,
    }


def check_support_out(out: Path, force: bool) -> None:
    """Refuse a non-empty --out without --force, and with it anything that is not a support folder."""
    check_output(out, force, marker=_SUPPORT_MARKERS, what="a support folder")


def build_support(
    pairs: Pairs,
    old: ModelSource,
    new: ModelSource,
    out: Path,
    *,
    query_modality: Modality,
    target_modality: Modality,
    options: EncodeOptions | None = None,
    log: Log = lambda _: None,
) -> dict[str, Any]:
    """Encode `pairs` with both models into a new support folder at `out`; returns models.json's content."""
    options = options or EncodeOptions()
    created = make_parents(out)
    try:
        with staging(out, marker=MODELS_JSON) as tmp:
            identities: list[ModelIdentity] = []
            sides: tuple[tuple[Role, ModelSource], ...] = ((Role.old, old), (Role.new, new))
            for role, side in sides:
                encoder, identity = load_encoder(
                    side.backend,
                    side.path,
                    role=role,
                    device=options.device,
                    model_id=side.model_id,
                    fp16=options.fp16,
                    cpu_bf16=options.cpu_bf16,
                    threads=options.threads,
                )
                log(f"{role} model: {identity.backend} {identity.model_id} ({identity.dim}-d) on {encoder.device}")
                for modality in {query_modality, target_modality}:
                    check_modality(encoder, identity.backend, modality)
                queries, targets = tmp / f"{role}_query.npy", tmp / f"{role}_target.npy"
                _encode_side(encoder, pairs, pairs.queries, pairs.query_lines, query_modality, queries, options)
                _encode_side(encoder, pairs, pairs.targets, pairs.target_lines, target_modality, targets, options)
                identities.append(identity)
                del encoder
                _release_memory()
            np.save(tmp / "query_ids.npy", np.asarray(pairs.query_ids, dtype=np.int64))
            np.save(tmp / "target_ids.npy", np.asarray(pairs.target_ids, dtype=np.int64))
            content = models_json(
                identities[0],
                identities[1],
                query_modality,
                target_modality,
                len(pairs.queries),
                targets=len(pairs.targets),
                source=str(pairs.path.resolve()),
                skipped=len(pairs.skipped),
                skipped_inputs=[{"line": b.line, "reason": b.reason} for b in pairs.skipped],
                created_at=datetime.now(UTC).isoformat(timespec="seconds"),
                nobackfill_version=service.__version__,
            )
            (tmp / MODELS_JSON).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    except BaseException:
        remove_empty(created)
        raise
    return content


def _encode_side(
    encoder: Encoder,
    pairs: Pairs,
    values: Sequence[str],
    lines: Sequence[int],
    modality: Modality,
    final: Path,
    options: EncodeOptions,
) -> None:
    """Encode `values` batch by batch into the .npy `final` (inside the temporary folder)."""
    from service.progress import progress_bar

    writer = NpyWriter(final, (len(values), encoder.dim), np.float32)
    try:
        desc = final.stem.replace("_", " ")
        with progress_bar(total=len(values), unit="input", desc=desc, enabled=options.progress) as bar:
            for start in range(0, len(values), options.batch_size):
                chunk = list(values[start : start + options.batch_size])
                what = f"{pairs.path}:{lines[start]}-{lines[start + len(chunk) - 1]} ({desc})"
                writer.append(encode_batch(encoder, chunk, modality, what))
                bar.update(len(chunk))
        os.replace(writer.close(), final)
    except BaseException:
        writer.discard()
        raise


def _release_memory() -> None:
    """Give a dropped model's memory back before the next one loads (CUDA caches it otherwise)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
