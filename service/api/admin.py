"""Admin routes, mounted only when NOBACKFILL_API__ADMIN_KEY is set: reload a profile from under the profiles root.

The folder a caller names is resolved (symlinks and `..` followed) before it is compared with the
resolved root, and anything outside gets one fixed answer: whether that path exists, is a folder,
or is readable is never revealed.  Every refused reload is logged with its reason.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fastapi import APIRouter

from service.api.auth import AdminKey
from service.api.deps import PipelineDep
from service.api.schemas import ReloadRequest, error_responses
from service.errors import InputError
from service.settings import Settings

log = logging.getLogger("nobackfill")
router = APIRouter()

OUTSIDE_ROOT = "profile_dir must name a folder under the profiles root (api.profiles_root)"


def profiles_root(settings: Settings) -> Path:
    """The resolved folder that reloads may read: api.profiles_root, else the configured profile's parent."""
    root = settings.api.profiles_root or settings.compat.profile_dir.parent
    return root.resolve()


def resolve_under(root: Path, given: str) -> Path:
    """`given` (absolute, or relative to `root`) resolved; InputError that names nothing if it is outside `root`."""
    try:
        candidate = (root / given).resolve()
    except (OSError, RuntimeError, ValueError):  # a NUL byte, a name too long, a symlink loop
        raise InputError(OUTSIDE_ROOT) from None
    if not candidate.is_relative_to(root):
        raise InputError(OUTSIDE_ROOT)
    try:  # inside the root, so saying why it is unusable reveals nothing outside it
        candidate.is_dir()
    except OSError as exc:
        raise InputError(f"profile_dir cannot be read: {exc.strerror}") from None
    return candidate


@router.post("/v1/admin/reload-profile", responses=error_responses(400, 401, 413, 422, 500, 503, 504))
async def reload_profile(pipeline: PipelineDep, _: AdminKey, body: ReloadRequest | None = None) -> dict[str, Any]:
    """Swap in a profile atomically; on failure the current one keeps serving and a 4xx explains why."""
    current = "none" if pipeline.profile is None else pipeline.profile.profile_id
    requested = body.profile_dir if body and body.profile_dir else None
    try:
        path = None if requested is None else resolve_under(profiles_root(pipeline.settings), requested)
        profile = await pipeline.reload_profile(path)
    except Exception as exc:
        reason = getattr(exc, "message", None) or type(exc).__name__  # a foreign cause: its traceback is logged too
        log.warning(
            "admin reload of %r refused, keeping profile %s: %s", (requested or "(configured)")[:300], current, reason
        )
        raise
    log.info("admin reload: profile %s loaded (was %s)", profile.profile_id, current)
    return {
        "status": "reloaded",
        "profile_id": profile.profile_id,
        "head": profile.head,
        "alphas": profile.alphas,
    }
