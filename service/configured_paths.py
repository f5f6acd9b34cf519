"""The folders the settings name, checked before anything loads: everything missing is said in one line."""

from __future__ import annotations

from pathlib import Path

from service.errors import ArtifactError
from service.settings import Settings, env_name

DEMO_HINT = (
    "set them to your own artifacts (`nobackfill gallery build`, `nobackfill fit`), or run `make demo`: it builds "
    "a small synthetic world in artifacts/demo/, which `make serve` then serves"
)


def missing_paths(settings: Settings) -> list[str]:
    """One clause per configured folder that does not exist, naming its environment variable."""
    wanted: list[tuple[tuple[str, str], Path | None]] = []
    if not settings.cut_over:  # after it the finished segment is the gallery, and there is no profile
        if settings.index.backend == "faiss":
            wanted.append((("index", "gallery_dir"), settings.index.gallery_dir))
        wanted.append((("compat", "profile_dir"), settings.compat.profile_dir))
        wanted.append((("old", "path"), _path(settings.old.path)))
        wanted.append((("compat", "hubness_dir"), settings.compat.hubness_dir))
    wanted.append((("new", "path"), _path(settings.new.path)))
    wanted.append((("index", "item_store"), settings.index.item_store))
    missing = [(loc, path) for loc, path in wanted if path is not None and not path.exists()]
    return [f"{env_name(*loc)}={path}: no such folder" for loc, path in missing]


def refuse_missing(settings: Settings) -> None:
    """ArtifactError naming every missing folder at once; the demo hint when the gallery or profile is one of them."""
    missing = missing_paths(settings)
    if not missing:
        return
    core = (env_name("index", "gallery_dir"), env_name("compat", "profile_dir"))
    hint = f" ({DEMO_HINT})" if any(clause.startswith(core) for clause in missing) else ""
    raise ArtifactError("; ".join(missing) + hint)


def _path(value: str | Path | None) -> Path | None:
    """An encoder's path setting as a Path (None when unset)."""
    return None if not value else Path(value).expanduser()
