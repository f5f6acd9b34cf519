"""The compat profile artifact (DESIGN.md section 3): a folder with profile.json and tensors.safetensors.

profile.json carries the format version, head, model ids and dims (and, when known, the two models'
identities: backend, weights fingerprint, dim), per-modality blend parameters, the fit settings, the
whole fit report and the sha256 of tensors.safetensors.  The tensors file is read with safetensors
only -- nothing is ever unpickled.  What it holds depends on the head family:

    head                           tensors                          profile.json extras
    slerp, nlerp, adaptive,        R [d, d] (Procrustes, padded)    params per modality
      aligned
    adapter, adapter+slerp         adapter.* (MKP adapter h)        "adapter": the adapter's meta();
                                                                    adapter+slerp: its alpha in params
    psp, lsp                       P_tk [C_k, C_t] (for the record; "classes": old_classes C_k,
                                   queries use psp.query_features)  new_classes C_t, top_k, class_map

Modes served (modes()): a Procrustes head serves old, aligned, slerp, nlerp, adaptive; adapter serves
old and adapter; adapter+slerp serves old, adapter and adapter+slerp; psp serves psp, lsp serves lsp
(their gallery holds the old model's PSP / LSP features and a query needs only new-model logits).
Format 2 added the adapter / PSP heads and the `adapter` / `classes` keys; format 1 files (Procrustes
only) still load.  Loading verifies the checksum, the format version and every shape, and builds the
adapter once so a corrupt one is refused at load time, not at the first query.  Saving goes through a
temporary sibling folder and one rename, so a failed write leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from service.atomic_dir import replace_dir
from service.compat.psp import correction_matrix
from service.errors import ArtifactError

if TYPE_CHECKING:
    from service.compat.adapter import TrainedAdapter

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
PROFILE_JSON = "profile.json"
TENSORS = "tensors.safetensors"
PROCRUSTES_HEADS = ("slerp", "nlerp", "adaptive", "aligned")
ADAPTER_HEADS = ("adapter", "adapter+slerp")
CLASS_HEADS = ("psp", "lsp")
HEADS = (*PROCRUSTES_HEADS, *ADAPTER_HEADS, *CLASS_HEADS)
BLEND_MODES = ("slerp", "nlerp", "adaptive")
PROCRUSTES_MODES = ("old", "aligned", *BLEND_MODES)
# Modes that take an explicit alpha (a weight on the mapped new query).
ALPHA_MODES = (*BLEND_MODES, "adapter+slerp")
HEAD_MODES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(PROCRUSTES_HEADS, PROCRUSTES_MODES),
    "adapter": ("old", "adapter"),
    "adapter+slerp": ("old", "adapter", "adapter+slerp"),
    "psp": ("psp",),
    "lsp": ("lsp",),
}
# Same string as service.compat.adapter.TENSOR_PREFIX, repeated so this module does not import torch.
ADAPTER_PREFIX = "adapter."
_ORTHO_TOL = 1e-3
_PTK_TOL = 1e-5


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
    adapter: dict[str, Any] | None = None  # adapter heads: TrainedAdapter.meta()
    classes: dict[str, Any] | None = None  # psp / lsp: old_classes, new_classes, top_k, class_map
    models: dict[str, Any] | None = None  # {"old": ModelIdentity.as_dict(), "new": ...} from models.json

    @property
    def dim(self) -> int:
        """Side of the square R: both spaces are zero-padded to this."""
        return max(self.old_dim, self.new_dim)

    @property
    def rotation(self) -> npt.NDArray[np.float32]:
        """The Procrustes map R [dim, dim], new -> old."""
        if "R" not in self.tensors:
            raise ArtifactError(f"profile (head {self.head}) has no Procrustes map R")
        return self.tensors["R"]

    @cached_property
    def rotation_block(self) -> npt.NDArray[np.float32]:
        """R[:new_dim, :old_dim], contiguous: the only part of R a query transform reads."""
        return np.ascontiguousarray(self.rotation[: self.new_dim, : self.old_dim])

    @cached_property
    def adapter_model(self) -> TrainedAdapter:
        """The MKP adapter h (new -> old), built once from the adapter.* tensors (imports torch)."""
        from service.compat.adapter import TENSOR_PREFIX, load_adapter

        assert TENSOR_PREFIX == ADAPTER_PREFIX, "profile and adapter disagree on the tensor prefix"
        if self.adapter is None:
            raise ArtifactError(f"profile (head {self.head}) has no adapter")
        tensors = {k: v for k, v in self.tensors.items() if k.startswith(ADAPTER_PREFIX)}
        try:
            return load_adapter(tensors, self.adapter)
        except (ValueError, KeyError, TypeError) as exc:
            raise ArtifactError(f"adapter cannot be rebuilt: {exc}") from exc

    @property
    def old_classes(self) -> int:
        """C_k of a psp / lsp profile (the old model's classes = the gallery's dim)."""
        return int(self._classes()["old_classes"])

    @property
    def top_k(self) -> int | None:
        """Top-k sparsification of a psp / lsp profile (None = all classes), gallery and queries alike."""
        k = self._classes().get("top_k")
        return None if k is None else int(k)

    @property
    def class_map(self) -> list[int] | None:
        """New-model output index of each old class of a psp / lsp profile (None = identity)."""
        m = self._classes().get("class_map")
        return None if m is None else [int(c) for c in m]

    def _classes(self) -> dict[str, Any]:
        """The `classes` block, or ArtifactError for a profile without one."""
        if self.classes is None:
            raise ArtifactError(f"profile (head {self.head}) has no class counts")
        return self.classes

    @property
    def profile_id(self) -> str:
        """Short id derived from the sha256 of the metadata (which includes the tensors' sha256)."""
        return hashlib.sha256(_canonical(self.metadata()).encode()).hexdigest()[:12]

    def modes(self) -> list[str]:
        """Modes this profile can serve (see the module docstring)."""
        return list(HEAD_MODES.get(self.head, ()))

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
            "adapter": self.adapter,
            "classes": self.classes,
            # Only when known: a profile without identities keeps the profile_id it always had.
            **({"models": self.models} if self.models is not None else {}),
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
    for name, t in profile.tensors.items():
        if t.dtype != np.float32 or not np.isfinite(t).all():
            raise ArtifactError(f"{where}: tensor {name} must be finite float32")
    if profile.head in PROCRUSTES_HEADS:
        _validate_rotation(profile, where)
    elif profile.head in ADAPTER_HEADS:
        _validate_adapter(profile, where)
    else:
        _validate_classes(profile, where)
    for modality, alpha in profile.alphas.items():
        if not 0.0 <= float(alpha) <= 1.0:
            raise ArtifactError(f"{where}: alpha {alpha} for modality {modality!r} is outside [0, 1]")
    for modality, modes in profile.params.items():
        for mode, p in modes.items():
            if mode in ("slerp", "nlerp", "adapter+slerp") and not 0.0 <= float(p.get("alpha", -1.0)) <= 1.0:
                raise ArtifactError(f"{where}: {mode} alpha for modality {modality!r} is missing or outside [0, 1]")


def _validate_rotation(profile: CompatProfile, where: Path | str) -> None:
    """R of a Procrustes head: present, square of side max(d_old, d_new), orthogonal."""
    if "R" not in profile.tensors:
        raise ArtifactError(f"{where}: tensor R is missing")
    r = profile.tensors["R"]
    if r.shape != (profile.dim, profile.dim):
        raise ArtifactError(
            f"{where}: R has shape {tuple(r.shape)}, expected ({profile.dim}, {profile.dim}) "
            f"for old_dim {profile.old_dim} / new_dim {profile.new_dim}"
        )
    err = float(np.abs(r.astype(np.float64).T @ r - np.eye(profile.dim)).max())
    if err > _ORTHO_TOL:
        raise ArtifactError(f"{where}: R is not orthogonal (max |R^T R - I| = {err:.2e})")


def _validate_adapter(profile: CompatProfile, where: Path | str) -> None:
    """An adapter head: meta present, dims agree, and the net rebuilds from the tensors."""
    meta = profile.adapter
    if not isinstance(meta, dict):
        raise ArtifactError(f"{where}: head {profile.head} needs the adapter description in profile.json")
    dims = (meta.get("old_dim"), meta.get("new_dim"))
    if dims != (profile.old_dim, profile.new_dim):
        raise ArtifactError(
            f"{where}: adapter maps {dims[1]} -> {dims[0]}, but the profile is {profile.new_dim} -> {profile.old_dim}"
        )
    try:
        profile.adapter_model  # noqa: B018 (builds and caches the net; raises on bad tensors)
    except ArtifactError as exc:
        raise ArtifactError(f"{where}: {exc.message}") from exc
    if profile.head == "adapter+slerp":
        for modality in profile.alphas:
            if "adapter+slerp" not in profile.params.get(modality, {}):
                raise ArtifactError(f"{where}: no adapter+slerp alpha for modality {modality!r}")


def _validate_classes(profile: CompatProfile, where: Path | str) -> None:
    """A psp / lsp head: class counts match the dims, top_k and class_map are valid, P_tk agrees."""
    c = profile.classes
    if not isinstance(c, dict):
        raise ArtifactError(f"{where}: head {profile.head} needs the class counts in profile.json")
    try:
        c_old, c_new = int(c["old_classes"]), int(c["new_classes"])
        top_k = c.get("top_k")
        class_map = c.get("class_map")
        if (c_old, c_new) != (profile.old_dim, profile.new_dim):
            raise ValueError(f"classes {c_old} -> {c_new} differ from the dims {profile.old_dim} / {profile.new_dim}")
        if top_k is not None and int(top_k) < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        expected = correction_matrix(c_old, c_new, class_map)
    except (KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(f"{where}: bad class block ({exc})") from exc
    p = profile.tensors.get("P_tk")
    if p is None:
        raise ArtifactError(f"{where}: tensor P_tk is missing")
    if p.shape != expected.shape or float(np.abs(p - expected).max()) > _PTK_TOL:
        raise ArtifactError(f"{where}: P_tk {tuple(p.shape)} is not the correction matrix for {c_old} -> {c_new}")


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
        replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return saved


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
    if version not in READABLE_VERSIONS:
        raise ArtifactError(
            f"{meta_path}: format_version {version!r} is unsupported "
            f"(this build reads {', '.join(map(str, READABLE_VERSIONS))})"
        )
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
            # Format 1 (Procrustes only) has neither key.
            adapter=_optional_dict(meta.get("adapter")),
            classes=_optional_dict(meta.get("classes")),
            models=_optional_dict(meta.get("models")),  # absent before the model identities were recorded
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ArtifactError(f"{meta_path}: malformed field ({type(exc).__name__}: {exc})") from exc
    _validate(profile, root)
    check_dims(profile, old_dim=old_dim, new_dim=new_dim)
    return profile


def _optional_dict(value: Any) -> dict[str, Any] | None:
    """A JSON object or null from profile.json."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"expected an object or null, got {type(value).__name__}")
    return dict(value)


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
