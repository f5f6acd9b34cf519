"""The compat profile artifact: a folder with profile.json, tensors.safetensors and manifest.json.

save_profile writes format 3 atomically (a temporary sibling folder, the manifest last, one rename);
load_profile checks the manifest before anything is parsed, then the format version, the tensors'
sha256, every field's JSON type and range and the head's own tensors, and refuses in one
ArtifactError line naming the file.  Formats 1 and 2 without a manifest still load, with a warning.
The tensors file is read with safetensors only: nothing is ever unpickled.  What each head stores
(R, the adapter.* tensors, P_tk), the modes it serves (vocabulary.HEAD_MODES), the format history and
every refusal are in docs/architecture.md, "The profile folder".
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from service.atomic_dir import readable_by_others, staging
from service.compat.psp import correction_matrix
from service.errors import ArtifactError
from service.json_file import read_json_object
from service.manifest import MANIFEST_NAME, sha256_of, verify_manifest, write_manifest
from service.vocabulary import ADAPTER_HEADS, ALPHA_MODES, PROCRUSTES_HEADS, Head, HeadFamily, Mode

if TYPE_CHECKING:
    from service.compat.adapter import TrainedAdapter
    from service.compat.calibration import ScoreMap

FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
MANIFEST_SINCE = 3  # from this format on, a folder without manifest.json is refused
PROFILE_JSON = "profile.json"
TENSORS = "tensors.safetensors"
# Same string as service.compat.adapter.TENSOR_PREFIX, repeated so this module does not import torch.
ADAPTER_PREFIX = "adapter."
_ORTHO_TOL = 1e-3
_PTK_TOL = 1e-5
_MAX_HIDDEN = 1 << 16  # an adapter wider than this is a corrupt meta block, not a trained net

log = logging.getLogger(__name__)


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
    # modality -> {"scale", "shift"}: new-space scores onto the old scale, for hybrid search (compat/calibration.py)
    calibration: dict[str, Any] | None = None

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

    def score_map(self, modality: str) -> ScoreMap | None:
        """The calibration of new-space scores for `modality` (hybrid search), or None when none was fitted."""
        line = (self.calibration or {}).get(modality)
        return None if line is None else self._score_maps[modality]

    @cached_property
    def _score_maps(self) -> dict[str, ScoreMap]:
        """Every modality's calibration with its reference rows, built once (a request reads it)."""
        from service.compat.calibration import ScoreMap, basis_tensors, reference_tensors

        maps = {}
        for modality, line in (self.calibration or {}).items():
            names = reference_tensors(modality)
            refs = tuple(self.tensors[n] for n in names) if all(n in self.tensors for n in names) else None
            old_basis, new_basis = (self.tensors.get(n) for n in basis_tensors(modality))
            maps[modality] = ScoreMap.from_dict(line, refs, (old_basis, new_basis))  # type: ignore[arg-type]
        return maps

    @property
    def profile_id(self) -> str:
        """Short id derived from the sha256 of the metadata (which includes the tensors' sha256)."""
        return hashlib.sha256(_canonical(self.metadata()).encode()).hexdigest()[:12]

    @property
    def family(self) -> HeadFamily:
        """What the profile stores to serve its head (R, an adapter, or class counts)."""
        return Head(self.head).family

    def modes(self) -> list[Mode]:
        """Modes this profile can serve: its head's in vocabulary.HEAD_MODES."""
        return list(Head(self.head).modes) if Head.has(self.head) else []

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
            **({"calibration": self.calibration} if self.calibration is not None else {}),
        }


def _canonical(obj: Any) -> str:
    """Deterministic JSON text used for hashing."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _validate(profile: CompatProfile, meta_where: Path | str, tensors_where: Path | str) -> None:
    """Shapes, finiteness and ranges of a profile; one ArtifactError line naming profile.json or the tensors file."""
    if not Head.has(profile.head):
        raise ArtifactError(f"{meta_where}: unknown head {profile.head!r} (known: {', '.join(Head)})")
    if profile.old_dim < 1 or profile.new_dim < 1:
        raise ArtifactError(f"{meta_where}: dims must be positive, got {profile.old_dim} / {profile.new_dim}")
    for name, t in profile.tensors.items():
        if t.dtype != np.float32 or not np.isfinite(t).all():
            raise ArtifactError(f"{tensors_where}: tensor {name} must be finite float32")
    _validate_params(profile, meta_where)
    _validate_calibration(profile, meta_where)
    if profile.head in PROCRUSTES_HEADS:
        _validate_rotation(profile, tensors_where)
    elif profile.head in ADAPTER_HEADS:
        _validate_adapter(profile, meta_where, tensors_where)
    else:
        _validate_classes(profile, meta_where, tensors_where)


def _validate_params(profile: CompatProfile, where: Path | str) -> None:
    """alphas and every head's fitted parameters: finite, in range, and present for the profile's own head."""

    def unit_interval(value: float, what: str) -> None:
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise ArtifactError(f"{where}: {what} is {value}, outside [0, 1]")

    for modality, alpha in profile.alphas.items():
        unit_interval(float(alpha), f"alpha for modality {modality!r}")
    for modality, modes in profile.params.items():
        for mode, p in modes.items():
            what = f"{mode} parameters for modality {modality!r}"
            bad = [k for k, v in p.items() if not math.isfinite(float(v))]
            if bad:
                raise ArtifactError(f"{where}: {what}: {', '.join(bad)} not finite")
            if mode in (Mode.slerp, Mode.nlerp, Mode.adapter_slerp):
                if "alpha" not in p:
                    raise ArtifactError(f"{where}: {what} lack alpha")
                unit_interval(float(p["alpha"]), f"the {mode} alpha for modality {modality!r}")
            elif mode == Mode.adaptive:
                missing = [k for k in ("a", "b", "c_ref") if k not in p]
                if missing:
                    raise ArtifactError(f"{where}: {what} lack {', '.join(missing)}")
                unit_interval(float(p["a"]), f"the adaptive a for modality {modality!r}")
                if not abs(float(p["c_ref"])) <= 1.0:  # a cosine
                    raise ArtifactError(
                        f"{where}: the adaptive c_ref for modality {modality!r} is {p['c_ref']}, not a cosine"
                    )
    own = profile.head if profile.head in ALPHA_MODES else None
    for modality in profile.alphas:
        if own is not None and own not in profile.params.get(modality, {}):
            raise ArtifactError(f"{where}: no {own} parameters for modality {modality!r}, which has an alpha")


def _validate_calibration(profile: CompatProfile, where: Path | str) -> None:
    """Each modality's score map: two finite numbers, a positive scale, reference rows of both dims when named."""
    from service.compat.calibration import reference_tensors

    for modality in profile.calibration or {}:
        try:
            score_map = profile._score_maps[modality]
        except (KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(f"{where}: calibration for modality {modality!r}: {exc}") from exc
        refs = score_map.references
        if refs is not None and refs.dims != (profile.old_dim, profile.new_dim):
            old_name, new_name = reference_tensors(modality)
            raise ArtifactError(
                f"{where}: {old_name} / {new_name} read {refs.dims[0]} / {refs.dims[1]}-d queries (with their bases), "
                f"expected old_dim {profile.old_dim} / new_dim {profile.new_dim}"
            )


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


def _validate_adapter(profile: CompatProfile, meta_where: Path | str, tensors_where: Path | str) -> None:
    """An adapter head: meta as adapter.meta() writes it, dims agree, and the net rebuilds from the tensors."""
    meta = profile.adapter
    if not isinstance(meta, dict):
        raise ArtifactError(f"{meta_where}: head {profile.head} needs the adapter description in profile.json")
    try:
        dims = (_count(meta.get("old_dim"), "adapter old_dim"), _count(meta.get("new_dim"), "adapter new_dim"))
        hidden = _count(meta.get("hidden"), "adapter hidden")
        if hidden > _MAX_HIDDEN:
            raise ValueError(f"adapter hidden {hidden} exceeds {_MAX_HIDDEN}")
        config = meta.get("config", {})
        if not isinstance(config, dict):
            raise TypeError("adapter config must be an object")
        odd = [k for k, v in config.items() if isinstance(v, float) and not math.isfinite(v)]
        if odd:
            raise ValueError(f"adapter config {', '.join(odd)} not finite")
    except (TypeError, ValueError) as exc:
        raise ArtifactError(f"{meta_where}: bad adapter block ({exc})") from exc
    if dims != (profile.old_dim, profile.new_dim):
        raise ArtifactError(
            f"{meta_where}: adapter maps {dims[1]} -> {dims[0]}, "
            f"but the profile is {profile.new_dim} -> {profile.old_dim}"
        )
    try:
        profile.adapter_model  # noqa: B018 (builds and caches the net; raises on bad tensors)
    except ArtifactError as exc:
        raise ArtifactError(f"{tensors_where}: {exc.message}") from exc


def _validate_classes(profile: CompatProfile, meta_where: Path | str, tensors_where: Path | str) -> None:
    """A psp / lsp head: class counts match the dims, top_k and class_map are valid, P_tk agrees."""
    c = profile.classes
    if not isinstance(c, dict):
        raise ArtifactError(f"{meta_where}: head {profile.head} needs the class counts in profile.json")
    try:
        c_old, c_new = _count(c.get("old_classes"), "old_classes"), _count(c.get("new_classes"), "new_classes")
        top_k = c.get("top_k")
        class_map = c.get("class_map")
        if (c_old, c_new) != (profile.old_dim, profile.new_dim):
            raise ValueError(f"classes {c_old} -> {c_new} differ from the dims {profile.old_dim} / {profile.new_dim}")
        if top_k is not None:
            _count(top_k, "top_k")
        if class_map is not None and not (isinstance(class_map, list) and all(_is_int(m) for m in class_map)):
            raise TypeError("class_map must be a list of integers")
        expected = correction_matrix(c_old, c_new, class_map)
    except (KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(f"{meta_where}: bad class block ({exc})") from exc
    p = profile.tensors.get("P_tk")
    if p is None:
        raise ArtifactError(f"{tensors_where}: tensor P_tk is missing")
    if p.shape != expected.shape or float(np.abs(p - expected).max()) > _PTK_TOL:
        raise ArtifactError(
            f"{tensors_where}: P_tk {tuple(p.shape)} is not the correction matrix for {c_old} -> {c_new}"
        )


def _is_int(value: Any) -> bool:
    """A JSON integer (bool is an int to Python, never to a profile)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _count(value: Any, what: str, minimum: int = 1) -> int:
    """A JSON integer >= minimum, or ValueError naming it (int() would take "8", 8.7 and true)."""
    if not _is_int(value) or int(value) < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _number(value: Any, what: str) -> float:
    """A JSON number (finiteness is checked by _validate, which names the field)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number, got {value!r}")
    return float(value)


def save_profile(
    profile: CompatProfile,
    directory: Path | str,
    *,
    overwrite: bool = False,
    extra_files: Mapping[str, bytes] | Callable[[CompatProfile], Mapping[str, bytes]] | None = None,
) -> CompatProfile:
    """Write the profile folder atomically with its manifest; returns the profile with its tensors' sha256 filled in.

    extra_files may be a function of the saved profile (its final profile_id known), e.g. a plot naming it.
    """
    target = Path(directory)
    _validate(profile, target / PROFILE_JSON, target / TENSORS)
    with staging(target, force=overwrite, error=ArtifactError) as tmp:
        tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in profile.tensors.items()}
        save_file(tensors, str(tmp / TENSORS), metadata={"format_version": str(FORMAT_VERSION)})
        sha = sha256_of(tmp / TENSORS)
        saved = replace(profile, tensors_sha256=sha)
        (tmp / PROFILE_JSON).write_text(json.dumps(saved.metadata(), indent=2) + "\n")
        extra = extra_files(saved) if callable(extra_files) else extra_files or {}
        for name, data in extra.items():
            if name == MANIFEST_NAME:
                raise ArtifactError(f"{target}: {MANIFEST_NAME} is written by save_profile, not an extra file")
            (tmp / name).write_bytes(data)
        write_manifest(tmp, known={TENSORS: sha})
        readable_by_others(tmp)
    return saved


def load_profile(directory: Path | str, *, old_dim: int | None = None, new_dim: int | None = None) -> CompatProfile:
    """Load and verify a profile folder (manifest, format, sha256, parameters, shapes; dims when given)."""
    root = Path(directory)
    meta_path, tensors_path = root / PROFILE_JSON, root / TENSORS
    if not root.is_dir():
        raise ArtifactError(f"{root}: profile directory does not exist")
    for p in (meta_path, tensors_path):
        if not p.is_file():
            raise ArtifactError(f"{p}: missing")
    digests = verify_manifest(root)  # before anything is parsed: every byte read below is the written one
    meta = read_json_object(meta_path, str(meta_path), finite=True)  # NaN / Infinity refused like any bad token
    version = meta.get("format_version")
    if not _is_int(version) or version not in READABLE_VERSIONS:
        raise ArtifactError(
            f"{meta_path}: format_version {version!r} is unsupported "
            f"(this build reads {', '.join(map(str, READABLE_VERSIONS))})"
        )
    if digests is None:
        if version >= MANIFEST_SINCE:
            raise ArtifactError(
                f"{root / MANIFEST_NAME}: missing (a format-{version} profile lists every file with its sha256)"
            )
        log.warning(
            "%s: format-%s profile without %s: profile.json is not checksummed (re-save it to add one)",
            root,
            version,
            MANIFEST_NAME,
        )
        sha = sha256_of(tensors_path)
    else:
        sha = digests[TENSORS] if TENSORS in digests else sha256_of(tensors_path)
    if sha != meta.get("tensors_sha256"):
        raise ArtifactError(
            f"{tensors_path}: sha256 {sha[:12]}... does not match profile.json "
            f"({str(meta.get('tensors_sha256'))[:12]}...); the profile is corrupt or was edited"
        )
    try:
        tensors = load_file(str(tensors_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ArtifactError(f"{tensors_path}: unreadable safetensors file ({exc})") from exc
    profile = _from_meta(meta, meta_path, {k: np.asarray(v) for k, v in tensors.items()}, sha)
    _validate(profile, meta_path, tensors_path)
    check_dims(profile, old_dim=old_dim, new_dim=new_dim)
    return profile


def _from_meta(
    meta: dict[str, Any], meta_path: Path, tensors: dict[str, npt.NDArray[np.float32]], sha: str
) -> CompatProfile:
    """Build a CompatProfile from profile.json's fields, refusing wrong JSON types in one line."""
    try:
        return CompatProfile(
            head=str(meta["head"]),
            old_model_id=str(meta["old_model_id"]),
            new_model_id=str(meta["new_model_id"]),
            old_dim=_count(meta["old_dim"], "old_dim"),
            new_dim=_count(meta["new_dim"], "new_dim"),
            alphas={str(k): _number(v, f"alpha {k!r}") for k, v in _object(meta["alphas"]).items()},
            params={
                str(mod): {
                    str(mode): {str(k): _number(v, f"{mode} {k} of {mod!r}") for k, v in _object(p).items()}
                    for mode, p in _object(modes).items()
                }
                for mod, modes in _object(meta["params"]).items()
            },
            fit_on=str(meta["fit_on"]),
            folds=_count(meta["folds"], "folds", minimum=0),
            fit_report=_object(meta["fit_report"]),
            tensors=tensors,
            created_at=str(meta["created_at"]),
            tensors_sha256=sha,
            # Format 1 (Procrustes only) has neither key.
            adapter=_optional_dict(meta.get("adapter")),
            classes=_optional_dict(meta.get("classes")),
            models=_optional_dict(meta.get("models")),  # absent before the model identities were recorded
            calibration=_optional_dict(meta.get("calibration")),  # absent before hybrid search
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ArtifactError(f"{meta_path}: malformed field ({type(exc).__name__}: {exc})") from exc


def _object(value: Any) -> dict[str, Any]:
    """A JSON object from profile.json."""
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, got {type(value).__name__}")
    return dict(value)


def _optional_dict(value: Any) -> dict[str, Any] | None:
    """A JSON object or null from profile.json."""
    if value is None:
        return None
    return _object(value)


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
