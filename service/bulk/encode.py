"""Encode validated inputs with one of the service's encoders into OUT.npy + OUT.json, chunk by chunk.

    input_spec + scan (inputs.py)     every input checked once, bad ones refused or counted
    load_encoder                      create_encoder(EncoderSettings(...)): the service's own backend code
    encode_file                       batch_size inputs per encoder call -> check_rows -> memory-mapped
                                      rows of a hidden OUT.npy; then OUT.json; both renamed into place
                                      at the end (atomic.py), so a failure or Ctrl-C leaves nothing

OUT.json (the encode sidecar of docs/architecture.md, "Artifact formats") describes OUT.npy: the
model identity (backend, model_id, fingerprint, dim), count, modality, dtype, the input and what was
skipped (line and reason per skipped input, so rows can be lined back up with the input).
`sidecar_identity` reads it back for `gallery build --from-npy`.  What a model returns is checked
before it is written: the shape, finiteness and a non-zero norm; rows are written as the encoder
returned them (float32), so they match what the service computes for the same input.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

import service
from service.bulk.atomic import make_parents, publish_files, refuse_existing, remove_empty, temp_json
from service.bulk.inputs import Bad, Blank, InputSpec, Item, Scan, encoder_input, read_items
from service.bulk.npy_writer import NpyWriter
from service.cpu_limit import usable_cpus
from service.encoders.base import Embeddings, Encoder, modalities_of
from service.encoders.identity import ModelIdentity
from service.errors import ArtifactError, InputError, NobackfillError
from service.json_file import read_json_object
from service.vocabulary import Modality, Role

FORMAT_VERSION = 1


def sidecar(out: Path) -> Path:
    """OUT.json beside OUT.npy."""
    return out.with_suffix(".json")


def check_outputs(out: Path, ids_out: Path | None, force: bool) -> None:
    """Refuse an --out that is not a .npy, or outputs that exist without --force (before any model loads)."""
    if out.suffix != ".npy":
        raise InputError(f"{out}: --out must name a .npy file")
    if ids_out is not None and (ids_out.suffix != ".npy" or ids_out in (out, sidecar(out))):
        raise InputError(f"{ids_out}: --ids-out must name a .npy file other than --out")
    refuse_existing([out, sidecar(out), *([ids_out] if ids_out else [])], force)


def load_encoder(
    backend: str,
    path: Path | None,
    *,
    role: Role = Role.old,
    device: str = "auto",
    model_id: str | None = None,
    fp16: bool = True,
    cpu_bf16: bool = False,
    threads: int | None = None,
    onnx_dir: Path | None = None,
) -> tuple[Encoder, ModelIdentity]:
    """Build backend `backend` from `path` as the service would for `role`; returns it and its identity.

    `onnx_dir`: run it on ONNX Runtime (runtime onnx) over the folder `nobackfill encoder export` wrote from
    `path`; the identity stays the source model's, so rows and profiles match the torch path's.
    """
    from service.encoders.registry import create_encoder, identity_of
    from service.settings import ONNX_BACKEND, EncoderSettings

    if onnx_dir is not None and backend != ONNX_BACKEND:
        raise InputError(
            f"--onnx runs {ONNX_BACKEND} models only (exported by `nobackfill encoder export`), not {backend}"
        )
    settings = EncoderSettings(
        backend=backend,
        path=None if path is None else str(path),
        device=device,
        model_id=model_id,
        fp16=fp16,
        cpu_bf16=cpu_bf16,
        # Offline, one encoder runs at a time: it may have every core (the service splits them in two).
        threads=threads or usable_cpus(),  # the container's CPU limit, not the node's cores
        runtime="torch" if onnx_dir is None else "onnx",
        onnx_dir=None if onnx_dir is None else str(onnx_dir),
    )
    encoder = create_encoder(settings, role)
    return encoder, identity_of(encoder, backend)


def check_modality(encoder: Encoder, backend: str, modality: Modality) -> None:
    """InputError when the encoder does not encode `modality`."""
    if modality not in modalities_of(encoder):
        served = ", ".join(modalities_of(encoder))
        raise InputError(f"backend {backend} ({encoder.model_id}) encodes {served}, not {modality}")


def check_rows(rows: Any, count: int, dim: int, what: str, allow_zero: bool = False) -> Embeddings:
    """The encoder's output for `count` inputs as float32 rows; NobackfillError naming `what` if unusable.

    allow_zero: all-zero rows (no known token, for a static model) are returned for the caller to skip.
    """
    if not isinstance(rows, np.ndarray) or rows.shape != (count, dim):
        shape = getattr(rows, "shape", type(rows).__name__)
        raise NobackfillError(f"{what}: the encoder returned {shape}, expected ({count}, {dim})")
    out = np.asarray(rows, dtype=np.float32)
    finite = np.isfinite(out).all(axis=1)
    if not finite.all():
        raise NobackfillError(f"{what}: the encoder returned NaN or inf in {int((~finite).sum())} row(s)")
    zero = ~np.any(out != 0, axis=1)
    if zero.any() and not allow_zero:
        raise NobackfillError(f"{what}: the encoder returned {int(zero.sum())} all-zero row(s)")
    return out


def encode_batch(
    encoder: Encoder, values: list[str], modality: Modality, what: str, allow_zero: bool = False
) -> Embeddings:
    """One encoder call on text values or image paths; foreign errors become one line naming `what`."""
    batch = [encoder_input(v, modality) for v in values]
    try:
        rows = encoder.encode(batch, modality)
    except NobackfillError as exc:  # e.g. an image the backend cannot decode: say which inputs
        raise type(exc)(f"{what}: {exc.message}") from exc
    except Exception as exc:  # torch / PIL / plug-in errors: one boundary turns them into our tree
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise NobackfillError(f"{what}: the encoder failed ({type(exc).__name__}: {first})") from exc
    return check_rows(rows, len(values), encoder.dim, what, allow_zero)


def batches(spec: InputSpec, scan: Scan, batch_size: int) -> Iterator[list[Item]]:
    """The usable inputs again, batch_size at a time; InputError if the input changed since `scan`."""
    skipped = {bad.line for bad in scan.skipped}
    batch: list[Item] = []
    seen = 0
    for item in read_items(spec, check_images=False):
        if isinstance(item, Blank):
            continue
        if isinstance(item, Bad):
            if item.line not in skipped:
                raise InputError(f"{item.message()} (the input changed while it was being encoded)")
            continue
        seen += 1
        if seen > scan.count:
            raise InputError(f"{spec.path}: more than the {scan.count} inputs checked (it changed while encoding)")
        batch.append(item)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch
    if seen != scan.count:
        raise InputError(f"{spec.path}: {seen} inputs now, {scan.count} when checked (it changed while encoding)")


def _where(spec: InputSpec, batch: list[Item]) -> str:
    """FILE:FIRST-LAST of a batch, for errors."""
    lines = f"{batch[0].line}" if len(batch) == 1 else f"{batch[0].line}-{batch[-1].line}"
    return f"{spec.path}:{lines}" if spec.kind != "folder" else f"{spec.path} (files {lines})"


def encode_file(
    encoder: Encoder,
    identity: ModelIdentity,
    spec: InputSpec,
    scan: Scan,
    out: Path,
    *,
    ids_out: Path | None = None,
    batch_size: int = 64,
    progress: bool = True,
) -> dict[str, Any]:
    """Write OUT.npy (float32 [scan.count, dim] unit rows), OUT.json and the ids file; returns OUT.json's content."""
    from service.progress import progress_bar

    if scan.count == 0:
        raise InputError(f"{spec.path}: no usable inputs ({len(scan.skipped)} skipped)")
    check_modality(encoder, identity.backend, spec.modality)
    created = make_parents(out) + (make_parents(ids_out) if ids_out is not None else [])
    writers: list[NpyWriter] = []
    json_tmp: Path | None = None
    try:
        writers.append(NpyWriter(out, (scan.count, identity.dim), np.float32))
        if ids_out is not None:
            writers.append(NpyWriter(ids_out, (scan.count,), np.int64))
        started = time.perf_counter()
        with progress_bar(total=scan.count, unit="input", desc=out.name, enabled=progress) as bar:
            for batch in batches(spec, scan, batch_size):
                rows = encode_batch(encoder, [item.value for item in batch], spec.modality, _where(spec, batch))
                writers[0].append(rows)
                if ids_out is not None:
                    writers[1].append(_ids(batch, spec))
                bar.update(len(batch))
        meta = _meta(identity, spec, scan, out, ids_out, time.perf_counter() - started)
        json_tmp = temp_json(sidecar(out), meta)
        publish_files([*((w.close(), w.final) for w in writers), (json_tmp, sidecar(out))])
    except BaseException:
        for writer in writers:
            writer.discard()
        if json_tmp is not None:
            json_tmp.unlink(missing_ok=True)
        remove_empty(created)
        raise
    return meta


def _ids(batch: list[Item], spec: InputSpec) -> npt.NDArray[np.int64]:
    """Per row: the --id-field value, else the input's 0-based line (or folder position)."""
    if spec.id_field is not None:
        return np.array([item.id for item in batch], dtype=np.int64)
    return np.array([item.line - 1 for item in batch], dtype=np.int64)


def _meta(
    identity: ModelIdentity, spec: InputSpec, scan: Scan, out: Path, ids_out: Path | None, seconds: float
) -> dict[str, Any]:
    """The content of OUT.json."""
    return {
        "format_version": FORMAT_VERSION,
        **identity.as_dict(),
        "count": scan.count,
        "modality": spec.modality,
        "dtype": "float32",
        "file": out.name,
        "input": str(spec.path.resolve()),
        "input_kind": spec.kind,
        "field": spec.field,
        "id_field": spec.id_field,
        "ids": None if ids_out is None else str(ids_out.resolve()),
        "skipped": len(scan.skipped),
        "skipped_inputs": [{"line": b.line, "where": b.where, "reason": b.reason} for b in scan.skipped],
        # Blank lines hold no input: rows (and ids) count the non-blank lines in order.
        "blank_lines": scan.blank,
        "seconds": round(seconds, 2),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "nobackfill_version": service.__version__,
    }


def sidecar_identity(npy: Path, rows: int, dim: int) -> ModelIdentity | None:
    """The model identity in the OUT.json beside `npy`, checked against its shape; None when there is none."""
    path = sidecar(npy)
    if not path.is_file():
        return None
    meta = read_json_object(path, str(path))
    identity = ModelIdentity.from_dict(meta, str(path))
    if identity.dim != dim or meta.get("count") != rows:
        raise ArtifactError(
            f"{path}: describes {meta.get('count')} rows of dim {identity.dim}, but {npy.name} holds {rows} of dim "
            f"{dim}; it belongs to another file (remove it, or re-run nobackfill encode)"
        )
    return identity


def write_items(spec: InputSpec, scan: Scan, out: Path, *, by_id: bool, force: bool) -> dict[str, Any]:
    """The item store of the usable inputs: keyed like the gallery's ids (--ids-out's when `by_id`, else the row)."""
    from service.items.store import write_item_store

    def rows() -> Iterator[tuple[int, str]]:
        row = 0
        for batch in batches(spec, scan, 4096):
            ids = _ids(batch, spec).tolist() if by_id else range(row, row + len(batch))
            yield from zip(ids, (item.value for item in batch), strict=True)
            row += len(batch)

    return write_item_store(out, rows(), spec.modality, str(spec.path.resolve()), force=force)
