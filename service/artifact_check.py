"""The startup and reload check: configured encoders, profile and gallery must describe one upgrade.

Every disagreement becomes one clause naming the artifact (its setting and path) and what it says;
the clauses are joined into one line, so `nobackfill serve` refuses to start with one readable error.

    gallery   its dim == the old encoder's; its old model id and weights fingerprint, when
              `gallery build` recorded them, == the old encoder's (a FAISS gallery in gallery.json,
              a Milvus collection in its `nobackfill.gallery` property: the same block)
    profile   old_dim / new_dim == the encoders'; old / new model ids == the encoders';
              fingerprints, when `fit` recorded them (from models.json), == the encoders'
    profile vs gallery   the old model the profile was fitted for == the one that made the gallery
              (checked directly too: an `external` old encoder only declares an id, so the two
              artifacts may both agree with it by name and still disagree on weights)
A fingerprint is compared only when both sides know one (synthetic and external encoders have none).
"""

from __future__ import annotations

from typing import Any

from service.compat.profile import CompatProfile
from service.encoders.base import Encoder, fingerprint_of
from service.errors import ArtifactError
from service.index.base import GalleryBackend, setting_line
from service.settings import EncoderSettings, Settings
from service.vocabulary import Role

UNKNOWN_MODEL = "unknown"


def encoder_line(settings: EncoderSettings, role: Role) -> str:
    """The environment variables that chose an encoder, as the user would set them."""
    prefix = f"NOBACKFILL_{role.upper()}__"
    line = f"{prefix}BACKEND={settings.backend}"
    return line + (f" {prefix}PATH={settings.path}" if settings.path else "")


def _short(fingerprint: str) -> str:
    return fingerprint[:12] + "..."


def _recorded(block: Any) -> tuple[str | None, str | None]:
    """(model id, fingerprint) of an identity block from an artifact; None for what it does not say."""
    if not isinstance(block, dict):
        return None, None
    model_id, fingerprint = block.get("model_id"), block.get("fingerprint")
    return (
        str(model_id) if model_id and model_id != UNKNOWN_MODEL else None,
        str(fingerprint) if fingerprint else None,
    )


def check_compatible(
    profile: CompatProfile, old: Encoder, new: Encoder, gallery: GalleryBackend, settings: Settings | None = None
) -> None:
    """Refuse, in one ArtifactError line, encoders / profile / gallery that disagree on dims or model identity."""
    settings = settings or Settings()
    encoders = {
        "old": (old, f"old encoder {old.model_id!r} ({encoder_line(settings.old, Role.old)})"),
        "new": (new, f"new encoder {new.model_id!r} ({encoder_line(settings.new, Role.new)})"),
    }
    profile_name = f"profile {profile.profile_id} (NOBACKFILL_COMPAT__PROFILE_DIR={settings.compat.profile_dir})"
    gallery_name = f"gallery ({setting_line(settings.index)})"  # a folder, or a Milvus collection
    # gallery.json: "old_model" (identity from OUT.json) since `encode`; only "old_model_id" before.
    gallery_block = gallery.meta.get("old_model") or {"model_id": gallery.meta.get("old_model_id")}
    models = profile.models or {}
    profile_old = {"model_id": profile.old_model_id, **(models.get("old") or {})}
    checks = [
        ("old", gallery_name, gallery.dim, gallery_block),
        ("old", profile_name, profile.old_dim, profile_old),
        ("new", profile_name, profile.new_dim, {"model_id": profile.new_model_id, **(models.get("new") or {})}),
    ]
    problems = []
    for role, artifact, dim, block in checks:
        encoder, encoder_name = encoders[role]
        clauses = _disagreements(encoder, dim, *_recorded(block))
        if clauses:
            problems.append(f"{encoder_name} vs the {artifact}: {', '.join(clauses)}")
    between = _between_artifacts(_recorded(profile_old), _recorded(gallery_block))
    if between:
        problems.append(f"the {profile_name} vs the {gallery_name}: {', '.join(between)}")
    if problems:
        raise ArtifactError("encoders, profile and gallery disagree: " + "; ".join(problems))


def _disagreements(encoder: Encoder, dim: int, model_id: str | None, fingerprint: str | None) -> list[str]:
    """What an artifact records (dim, model id, weights sha256) that the encoder is not; unknowns pass."""
    clauses = []
    if encoder.dim != dim:
        clauses.append(f"{encoder.dim}-d rows where it holds {dim}-d")
    if model_id is not None and model_id != encoder.model_id:
        clauses.append(f"model {encoder.model_id!r} where it was made by {model_id!r}")
    actual = fingerprint_of(encoder)
    if fingerprint is not None and actual is not None and fingerprint != actual:
        clauses.append(f"weights sha256 {_short(actual)} where it records {_short(fingerprint)}")
    return clauses


def _between_artifacts(
    profile_old: tuple[str | None, str | None], gallery_old: tuple[str | None, str | None]
) -> list[str]:
    """Where the profile's old model and the gallery's differ (id, then weights), unknowns passing."""
    clauses = []
    (p_id, p_fp), (g_id, g_fp) = profile_old, gallery_old
    if p_id is not None and g_id is not None and p_id != g_id:
        clauses.append(f"fitted for old model {p_id!r} where the gallery was made by {g_id!r}")
    if p_fp is not None and g_fp is not None and p_fp != g_fp:
        clauses.append(f"old weights sha256 {_short(p_fp)} where the gallery records {_short(g_fp)}")
    return clauses
