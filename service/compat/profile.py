"""The compat profile artifact (DESIGN.md section 3): a folder with profile.json and tensors.safetensors.

profile.json carries the format version, head, model ids and dims, per-modality blend parameters,
the fit settings, the whole fit report and the sha256 of tensors.safetensors.  The tensors file holds
R (and, later, adapter weights); it is read with safetensors only -- nothing is ever unpickled.
Loading verifies the checksum, the format version and every shape.  Saving goes through a temporary
sibling folder and one rename, so a failed write leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from service.errors import ArtifactError

FORMAT_VERSION = 1
PROFILE_JSON = "profile.json"
TENSORS = "tensors.safetensors"
HEADS = ("slerp", "nlerp", "adaptive", "aligned")
BLEND_MODES = ("slerp", "nlerp", "adaptive")
PROCRUSTES_MODES = ("old", "aligned", *BLEND_MODES)
_ORTHO_TOL = 1e-3


@dataclass(frozen=True, eq=False)
class CompatProfile:
    """A loaded (or freshly fitted) compatibility profile; arrays are float32.

    alphas: the default head's weight per query modality (adaptive: its base a; aligned: 1.0).
    params: modality -> mode -> fitted parameters ({"alpha"} for slerp / nlerp, {"a", "b", "c_ref"}
    for adaptive).  fit_report: the whole report of selection.fit, JSON-able.
    """

    head: str
    old_model_id: str
    new_model_id: str
    old_dim: int
    new_dim: int
    alphas: dict[str, float]
    params: dict[str, dict[str, dict[str, float]]]
    fit_on: str
    folds: int
    fit_report: dict[str, Any]
    tensors: dict[str, npt.NDArray[np.float32]]
    created_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    tensors_sha256: str = ""

    @property
    def dim(self) -> int:
        """Side of the square R: both spaces are zero-padded to this."""
        return max(self.old_dim, self.new_dim)

    @property
    def rotation(self) -> npt.NDArray[np.float32]:
        """The Procrustes map R [dim, dim], new -> old."""
        return self.tensors["R"]

    @property
    def profile_id(self) -> str:
        """Short id derived from the sha256 of the metadata (which includes the tensors' sha256)."""
        return hashlib.sha256(_canonical(self.metadata()).encode()).hexdigest()[:12]

    def modes(self) -> list[str]:
        """Modes this profile can serve (a Procrustes profile serves old, aligned and the blends)."""
        return list(PROCRUSTES_MODES)

    def metadata(self) -> dict[str, Any]:
        """The content of profile.json."""
        return {
            "format_version": FORMAT_VERSION,
            "head": self.head,
            "old_model_id": self.old_model_id,
            "new_model_id": self.new_model_id,
            "old_dim": self.old_dim,
            "new_dim": self.new_dim,
            "alphas": self.alphas,
            "params": self.params,
            "fit_on": self.fit_on,
            "folds": self.folds,
            "created_at": self.created_at,
            "fit_report": self.fit_report,
            "tensors_sha256": self.tensors_sha256,
        }


def _canonical(obj: Any) -> str:
    """Deterministic JSON text used for hashing."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _sha256(path: Path) -> str:
    """Hex sha256 of a file, streamed."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _validate(profile: CompatProfile, where: Path | str) -> None:
    """Shapes, finiteness and value ranges of a profile; ArtifactError naming `where` on failure."""
    if profile.head not in HEADS:
        raise ArtifactError(f"{where}: unknown head {profile.head!r} (known: {', '.join(HEADS)})")
    if profile.old_dim < 1 or profile.new_dim < 1:
        raise ArtifactError(f"{where}: dims must be positive, got {profile.old_dim} / {profile.new_dim}")
    if "R" not in profile.tensors:
        raise ArtifactError(f"{where}: tensor R is missing")
    r = profile.tensors["R"]
    if r.shape != (profile.dim, profile.dim):
        raise ArtifactError(
            f"{where}: R has shape {tuple(r.shape)}, expected ({profile.dim}, {profile.dim}) "
            f"for old_dim {profile.old_dim} / new_dim {profile.new_dim}"
        )
    if r.dtype != np.float32 or not np.isfinite(r).all():
        raise ArtifactError(f"{where}: R must be finite float32")
    err = float(np.abs(r.astype(np.float64).T @ r - np.eye(profile.dim)).max())
    if err > _ORTHO_TOL:
        raise ArtifactError(f"{where}: R is not orthogonal (max |R^T R - I| = {err:.2e})")
    for modality, alpha in profile.alphas.items():
        if not 0.0 <= float(alpha) <= 1.0:
            raise ArtifactError(f"{where}: alpha {alpha} for modality {modality!r} is outside [0, 1]")


def save_profile(
    profile: CompatProfile,
    directory: Path | str,
    *,
    overwrite: bool = False,
    extra_files: Mapping[str, bytes] | None = None,
) -> CompatProfile:
    """Write the profile folder atomically; returns the profile with its tensors' sha256 filled in."""
    target = Path(directory)
    _validate(profile, target)
    if target.exists() and not target.is_dir():
        raise ArtifactError(f"{target}: exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ArtifactError(f"{target}: exists and is not empty (use --force to replace it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in profile.tensors.items()}
        save_file(tensors, str(tmp / TENSORS), metadata={"format_version": str(FORMAT_VERSION)})
        sha = _sha256(tmp / TENSORS)
        saved = replace(profile, tensors_sha256=sha)
        (tmp / PROFILE_JSON).write_text(json.dumps(saved.metadata(), indent=2) + "\n")
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
        _publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return saved


def _publish(tmp: Path, target: Path) -> None:
    """Move the finished temporary folder onto target with renames (the old one kept until the end)."""
    if target.is_dir():
        if not any(target.iterdir()):
            target.rmdir()
            os.rename(tmp, target)
            return
        backup = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        backup.rmdir()
        os.rename(target, backup)
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(backup, target)
            raise
        shutil.rmtree(backup, ignore_errors=True)
        return
    os.rename(tmp, target)


def load_profile(directory: Path | str, *, old_dim: int | None = None, new_dim: int | None = None) -> CompatProfile:
    """Load and verify a profile folder (format, sha256, shapes; dims against the encoders when given)."""
    root = Path(directory)
    meta_path, tensors_path = root / PROFILE_JSON, root / TENSORS
    if not root.is_dir():
        raise ArtifactError(f"{root}: profile directory does not exist")
    for p in (meta_path, tensors_path):
        if not p.is_file():
            raise ArtifactError(f"{p}: missing")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{meta_path}: not valid JSON ({exc})") from exc
    if not isinstance(meta, dict):
        raise ArtifactError(f"{meta_path}: expected a JSON object")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{meta_path}: format_version {version!r} is unsupported (want {FORMAT_VERSION})")
    sha = _sha256(tensors_path)
    if sha != meta.get("tensors_sha256"):
        raise ArtifactError(
            f"{tensors_path}: sha256 {sha[:12]}... does not match profile.json "
            f"({str(meta.get('tensors_sha256'))[:12]}...); the profile is corrupt or was edited"
        )
    try:
        tensors = load_file(str(tensors_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ArtifactError(f"{tensors_path}: unreadable safetensors file ({exc})") from exc
    try:
        profile = CompatProfile(
            head=str(meta["head"]),
            old_model_id=str(meta["old_model_id"]),
            new_model_id=str(meta["new_model_id"]),
            old_dim=int(meta["old_dim"]),
            new_dim=int(meta["new_dim"]),
            alphas={str(k): float(v) for k, v in meta["alphas"].items()},
            params={
                str(mod): {str(mode): {str(k): float(v) for k, v in p.items()} for mode, p in modes.items()}
                for mod, modes in meta["params"].items()
            },
            fit_on=str(meta["fit_on"]),
            folds=int(meta["folds"]),
            fit_report=dict(meta["fit_report"]),
            tensors={k: np.asarray(v) for k, v in tensors.items()},
            created_at=str(meta["created_at"]),
            tensors_sha256=sha,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ArtifactError(f"{meta_path}: malformed field ({type(exc).__name__}: {exc})") from exc
    _validate(profile, root)
    check_dims(profile, old_dim=old_dim, new_dim=new_dim)
    return profile


def check_dims(profile: CompatProfile, *, old_dim: int | None = None, new_dim: int | None = None) -> None:
    """Refuse a profile whose dims differ from the encoders' / gallery's."""
    if old_dim is not None and old_dim != profile.old_dim:
        raise ArtifactError(
            f"profile {profile.profile_id}: old_dim {profile.old_dim} does not match "
            f"the old encoder / gallery dim {old_dim}"
        )
    if new_dim is not None and new_dim != profile.new_dim:
        raise ArtifactError(
            f"profile {profile.profile_id}: new_dim {profile.new_dim} does not match the new encoder dim {new_dim}"
        )
