"""The ONNX export folder's description, onnx.json: what was exported, from which model, and how well it agrees.

    ONNX_DIR/
        model.onnx        the transformer, its pooling and (when the model has one) its Normalize module, one graph
        tokenizer.json    the source model's tokenizer, saved as the library saves it (with its config files)
        onnx.json         this record
        manifest.json     every other file's size and sha256 (service/manifest.py), written last

onnx.json holds the source model's identity as the torch backend computes it (backend, model_id,
weights fingerprint, dim), so the runtime refuses an export of another model (or of other weights
under the same name) and keeps reporting the source's identity: profiles and galleries fitted on the
torch rows still match.  It also holds what the runtime must repeat exactly (the graph's inputs, the
tokenizer's max_length) and the check the export ran: the cosine of its rows to torch float32's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from service.encoders.identity import ModelIdentity
from service.errors import ArtifactError, InputError
from service.json_file import read_json_object
from service.manifest import verify_manifest, write_json_durably

RECORD_NAME = "onnx.json"
MODEL_NAME = "model.onnx"
RECORD_FORMAT = 1
OUTPUT_NAME = "sentence_embedding"
Precision = Literal["fp32", "int8"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "int8")


@dataclass(frozen=True)
class OnnxExport:
    """One export: its source model, precision, the graph's inputs, the tokenizer's length and its agreement check."""

    source: ModelIdentity
    precision: Precision
    inputs: tuple[str, ...]
    max_seq_length: int
    opset: int
    # {"texts": n, "min_cosine": ..., "mean_cosine": ...}: the export's rows against torch float32's.
    check: dict[str, float] = field(default_factory=dict)
    # Library versions that made it (for the record; nothing is compared against them).
    made_with: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form, as written to onnx.json."""
        data = asdict(self)
        data["source"] = self.source.as_dict()
        data["inputs"] = list(self.inputs)
        return {"format": RECORD_FORMAT, "model": MODEL_NAME, "output": OUTPUT_NAME, **data}


def write_record(folder: Path, export: OnnxExport) -> None:
    """Write folder/onnx.json durably (the manifest, written after it, covers it)."""
    write_json_durably(folder / RECORD_NAME, export.as_dict())


def read_export(folder: Path) -> OnnxExport:
    """The export in `folder`, its files checked against manifest.json; one-line errors naming what is wrong."""
    if not folder.is_dir():
        raise InputError(f"ONNX export folder {folder} does not exist (write it with `nobackfill encoder export`)")
    path = folder / RECORD_NAME
    if not path.is_file():
        raise ArtifactError(f"{folder}: no {RECORD_NAME}; not a folder `nobackfill encoder export` wrote")
    if verify_manifest(folder) is None:  # deleting the manifest must not switch the check off
        raise ArtifactError(f"{folder}: no manifest.json; export the model again")
    data = read_json_object(path, str(path))
    if data.get("format") != RECORD_FORMAT:
        raise ArtifactError(f"{path}: format {data.get('format')!r}, this build reads format {RECORD_FORMAT}")
    try:
        precision = data["precision"]
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
        inputs = tuple(str(name) for name in data["inputs"])
        export = OnnxExport(
            source=ModelIdentity.from_dict(data.get("source"), f"{path} (source)"),
            precision=precision,
            inputs=inputs,
            max_seq_length=int(data["max_seq_length"]),
            opset=int(data["opset"]),
            check={str(k): float(v) for k, v in dict(data.get("check") or {}).items()},
            made_with={str(k): str(v) for k, v in dict(data.get("made_with") or {}).items()},
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(f"{path}: malformed ({type(exc).__name__}: {exc})") from exc
    if not inputs or export.max_seq_length < 1:
        raise ArtifactError(f"{path}: malformed (no graph inputs, or a max_seq_length below 1)")
    if not (folder / MODEL_NAME).is_file():
        raise ArtifactError(f"{folder}: no {MODEL_NAME}")
    return export


def check_source(export: OnnxExport, folder: Path, model_folder: Path, fingerprint: str) -> None:
    """Refuse an export made from other weights than those in `model_folder` (ArtifactError, one line).

    The weights decide, not the name: a renamed copy of the same model is the same model (as for the
    profile's startup check), and a retrained one under the old name is not.
    """
    source = export.source
    if source.fingerprint != fingerprint:
        raise ArtifactError(
            f"ONNX export {folder} was made from another model ({source.model_id}, weights "
            f"{(source.fingerprint or 'unknown')[:12]}...), not from {model_folder} (weights {fingerprint[:12]}...): "
            "export this model again with `nobackfill encoder export`"
        )
