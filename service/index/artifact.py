"""On-disk layout of a gallery folder: `index.faiss` plus `gallery.json`, and the file fingerprint.

The fingerprint is the sha256 of `index.faiss`; `gallery.json` is written last, so a folder without
it is an interrupted build, never a gallery.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm  # type: ignore[import-untyped]

from service.errors import ArtifactError

INDEX_NAME = "index.faiss"
META_NAME = "gallery.json"
FORMAT_VERSION = 1
_HASH_BLOCK = 8 << 20
_PROGRESS_MIN_BYTES = 256 << 20
_EDGE_BYTES = 1 << 20


def sha256_file(path: Path, progress: bool | None = None) -> str:
    """Hex sha256 of a file, read in 8 MiB blocks; a progress bar for big files on a terminal (None = auto)."""
    size = path.stat().st_size
    show = (size >= _PROGRESS_MIN_BYTES and sys.stderr.isatty()) if progress is None else progress
    digest = hashlib.sha256()
    with (
        path.open("rb") as f,
        tqdm(total=size, unit="B", unit_scale=True, desc=f"sha256 {path.name}", disable=not show) as bar,
    ):
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def edges_sha256(path: Path) -> str:
    """Hex sha256 of the first and last MiB of a file: the cheap check of `Gallery.load(verify="size")`."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as f:
        digest.update(f.read(_EDGE_BYTES))
        f.seek(max(0, size - _EDGE_BYTES))
        digest.update(f.read(_EDGE_BYTES))
    return digest.hexdigest()


def write_meta(folder: Path, meta: dict[str, Any]) -> None:
    """Write gallery.json durably (temp file, fsync, rename) so it is either complete or absent."""
    tmp = folder / (META_NAME + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(folder / META_NAME)


def read_meta(folder: Path) -> dict[str, Any]:
    """Read and sanity-check gallery.json; ArtifactError when it is missing, unreadable or foreign."""
    if not folder.is_dir():
        raise ArtifactError(f"gallery {folder}: no such folder")
    path = folder / META_NAME
    if not path.is_file():
        raise ArtifactError(f"gallery {folder}: no {META_NAME} (not a gallery, or an interrupted build)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"gallery {folder}: unreadable {META_NAME} ({exc})") from exc
    if not isinstance(meta, dict):
        raise ArtifactError(f"gallery {folder}: {META_NAME} is not a JSON object")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"gallery {folder}: format version {meta.get('format_version')!r}, this build reads {FORMAT_VERSION}"
        )
    missing = [key for key in ("d", "nlist", "M", "nbits", "ntotal", "sha256", "index_bytes") if key not in meta]
    if missing:
        raise ArtifactError(f"gallery {folder}: {META_NAME} lacks {', '.join(missing)}")
    return meta
