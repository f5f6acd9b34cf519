"""Model identity: which model produced a set of embeddings, carried from `encode` into every artifact.

    encode        OUT.npy + OUT.json      {backend, model_id, fingerprint, dim, count, modality, ...}
    support build SUPPORT/models.json     {"old": identity, "new": identity, query/target modality}
    fit           profile.json "models"   the two identities, taken from models.json
    gallery build gallery.json            the old model's id and fingerprint, from OUT.json
    serve         startup check           configured encoders == profile == gallery, else refuse

The fingerprint is the sha256 over the model folder's weight files (names and bytes, sorted), so a
renamed or moved folder keeps its identity and a retrained one does not.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from service.errors import ArtifactError, InputError
from service.json_file import read_json_object

MODELS_JSON = "models.json"
IDENTITY_KEYS = ("backend", "model_id", "fingerprint", "dim")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".onnx", ".msgpack", ".h5")
_BLOCK = 8 << 20


def weight_files(folder: Path) -> list[Path]:
    """The model's weight files under `folder`, sorted by relative path."""
    return sorted(
        (p for p in folder.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES),
        key=lambda p: p.relative_to(folder).as_posix(),
    )


def weights_fingerprint(folder: Path) -> str:
    """Hex sha256 over the weight files' relative names and bytes; InputError when there are none."""
    files = weight_files(folder)
    if not files:
        suffixes = ", ".join(WEIGHT_SUFFIXES)
        raise InputError(f"{folder}: no weight files ({suffixes}) in the model folder")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        with path.open("rb") as f:
            while block := f.read(_BLOCK):
                digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class ModelIdentity:
    """Who made a set of embeddings: backend name, model id, weights fingerprint (None if weightless), dim."""

    backend: str
    model_id: str
    fingerprint: str | None
    dim: int

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> ModelIdentity:
        """Parse a JSON object written by `as_dict`; ArtifactError naming `where` and what is wrong otherwise."""
        if data is None:
            raise ArtifactError(f"{where}: no model identity ({', '.join(IDENTITY_KEYS)})")
        if not isinstance(data, dict):
            raise ArtifactError(f"{where}: the model identity is {json_type(data)}, not an object")
        missing = [key for key in ("backend", "model_id", "dim") if key not in data]  # fingerprint: None if absent
        if missing:
            raise ArtifactError(f"{where}: the model identity has no {', '.join(map(repr, missing))}")
        try:
            fingerprint = data.get("fingerprint")
            return cls(
                backend=str(data["backend"]),
                model_id=str(data["model_id"]),
                fingerprint=None if fingerprint is None else str(fingerprint),
                dim=int(data["dim"]),
            )
        except (TypeError, ValueError) as exc:  # a dim that is not a number
            raise ArtifactError(f"{where}: malformed model identity ({type(exc).__name__}: {exc})") from exc

    def same_model(self, other: ModelIdentity) -> bool:
        """Same id, dim and (when both have one) fingerprint."""
        if (self.model_id, self.dim) != (other.model_id, other.dim):
            return False
        return self.fingerprint is None or other.fingerprint is None or self.fingerprint == other.fingerprint


def json_type(value: Any) -> str:
    """What a parsed JSON value is, as JSON names it ("an array", "null", ...), for error messages."""
    if value is None:
        return "null"
    for kind, name in ((bool, "a boolean"), (int | float, "a number"), (str, "a string"), (list, "an array")):
        if isinstance(value, kind):
            return name
    return "an object"


def read_models_json(folder: Path) -> tuple[ModelIdentity, ModelIdentity] | None:
    """(old, new) identities from FOLDER/models.json, or None when the folder has none."""
    path = folder / MODELS_JSON
    if not path.exists():
        return None
    data = read_json_object(path, str(path))
    sides = []
    for side in ("old", "new"):
        # Said here, not by from_dict: which key of the file is missing or is not an object.
        if side not in data:
            raise ArtifactError(f"{path}: no {side!r} key (the {side} model's identity: {', '.join(IDENTITY_KEYS)})")
        if not isinstance(data[side], dict):
            raise ArtifactError(
                f"{path}: {side!r} is {json_type(data[side])}, not an object (the {side} model's identity)"
            )
        sides.append(ModelIdentity.from_dict(data[side], f"{path} ({side})"))
    return sides[0], sides[1]
