"""The startup and reload check: configured encoders, profile and gallery must describe one upgrade.

Every disagreement becomes one clause naming the artifact (its setting and path) and what it says;
the clauses are joined into one line, so `nobackfill serve` refuses to start with one readable error.

    gallery   its dim == the old encoder's; its old model id and weights fingerprint, when
              `gallery build` recorded them, == the old encoder's
    profile   old_dim / new_dim == the encoders'; old / new model ids == the encoders';
              fingerprints, when `fit` recorded them (from models.json), == the encoders'
A fingerprint is compared only when both sides know one (synthetic and external encoders have none).
"""

from __future__ import annotations

from typing import Any, Literal

from service.compat.profile import CompatProfile
from service.encoders.base import Encoder, fingerprint_of
from service.errors import ArtifactError
from service.index.gallery import Gallery
from service.settings import EncoderSettings, Settings

UNKNOWN_MODEL = "unknown"


def encoder_line(settings: EncoderSettings, role: Literal["old", "new"]) -> str:
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
    profile: CompatProfile, old: Encoder, new: Encoder, gallery: Gallery, settings: Settings | None = None
) -> None:
    """Refuse, in one ArtifactError line, encoders / profile / gallery that disagree on dims or model identity."""
    settings = settings or Settings()
    where = {
        "old": f"old encoder {old.model_id!r} ({encoder_line(settings.old, 'old')})",
        "new": f"new encoder {new.model_id!r} ({encoder_line(settings.new, 'new')})",
        "profile": f"profile {profile.profile_id} (NOBACKFILL_COMPAT__PROFILE_DIR={settings.compat.profile_dir})",
        "gallery": f"gallery (NOBACKFILL_INDEX__GALLERY_DIR={settings.index.gallery_dir})",
    }
    problems: list[str] = []
    if gallery.dim != old.dim:
        problems.append(
            f"{where['old']} gives {old.dim}-d rows but the {where['gallery']} holds {gallery.dim}-d vectors"
        )
    for role, encoder, dim in (("old", old, profile.old_dim), ("new", new, profile.new_dim)):
        if encoder.dim != dim:
            problems.append(
                f"{where[role]} gives {encoder.dim}-d rows but the {where['profile']} expects {dim}-d {role} rows"
            )
    # gallery.json: "old_model" (identity from OUT.json) since `encode`; only "old_model_id" before.
    gallery_id, gallery_fp = _recorded(gallery.meta.get("old_model") or {"model_id": gallery.meta.get("old_model_id")})
    if gallery_id is not None and gallery_id != old.model_id:
        problems.append(f"the {where['gallery']} was built by old model {gallery_id!r}, not by the {where['old']}")
    _compare_fingerprints(problems, where["gallery"], gallery_fp, where["old"], old)
    models = profile.models or {}
    for role, encoder, fitted_id in (("old", old, profile.old_model_id), ("new", new, profile.new_model_id)):
        if fitted_id != encoder.model_id:
            problems.append(f"the {where['profile']} was fitted for {role} model {fitted_id!r}, not the {where[role]}")
        _, fitted_fp = _recorded(models.get(role))
        _compare_fingerprints(problems, where["profile"], fitted_fp, where[role], encoder)
    if problems:
        raise ArtifactError("encoders, profile and gallery disagree: " + "; ".join(problems))


def _compare_fingerprints(problems: list[str], artifact: str, recorded: str | None, who: str, encoder: Encoder) -> None:
    """Add a clause when the artifact's recorded weights fingerprint differs from the encoder's."""
    actual = fingerprint_of(encoder)
    if recorded is not None and actual is not None and recorded != actual:
        problems.append(f"the {artifact} records weights sha256 {_short(recorded)} but the {who} has {_short(actual)}")
