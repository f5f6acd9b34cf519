"""On-disk layout of a gallery folder: `index.faiss`, `gallery.json`, `manifest.json`, and the fingerprint.

The fingerprint is the sha256 of `index.faiss`, recorded in `gallery.json`.  `gallery.json` is
written after the index, then `manifest.json` (service/manifest.py: size and sha256 of every other
file, gallery.json included), so a folder without them is an interrupted build, never a gallery.
gallery.json says `"manifest": "manifest.json"` from then on: deleting the manifest of such a
gallery is refused, while galleries built before manifests (no such key) load with one warning --
rebuilding a 10^7-row gallery to upgrade the service is not an option, and their index is still
checked against gallery.json's sha256; what they lack is a check of gallery.json's own bytes.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from service.errors import ArtifactError
from service.json_file import read_json_object
from service.manifest import MANIFEST_NAME, verify_manifest, write_json_durably, write_manifest

INDEX_NAME = "index.faiss"
META_NAME = "gallery.json"
FORMAT_VERSION = 1
_EDGE_BYTES = 1 << 20

log = logging.getLogger(__name__)


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
    """Write gallery.json, then manifest.json, durably (temp file, fsync, rename); adds meta["manifest"]."""
    meta["manifest"] = MANIFEST_NAME
    write_json_durably(folder / META_NAME, meta)
    # The index was hashed for gallery.json already; a 10^7-row gallery should not be read twice.
    write_manifest(folder, known={str(meta.get("index_file", INDEX_NAME)): str(meta["sha256"])})


def read_checked_meta(folder: Path) -> dict[str, Any]:
    """read_meta after the manifest check of every file but the index (whose digest Gallery.load checks)."""
    if not folder.is_dir():
        raise ArtifactError(f"gallery {folder}: no such folder")
    signed = verify_manifest(folder, size_only=(INDEX_NAME,))
    meta = read_meta(folder)
    if signed is None:
        if meta.get("manifest"):
            raise ArtifactError(f"{folder / MANIFEST_NAME}: missing (gallery.json says this gallery has one)")
        log.warning("gallery %s: built without %s; gallery.json itself is not checksummed", folder, MANIFEST_NAME)
    elif signed.get(INDEX_NAME, meta["sha256"]) != meta["sha256"]:
        # The manifest checked the index by size only; its digest must be the one Gallery.load checks.
        raise ArtifactError(f"{folder / MANIFEST_NAME}: sha256 of {INDEX_NAME} differs from gallery.json's")
    return meta


def read_meta(folder: Path) -> dict[str, Any]:
    """Read and sanity-check gallery.json; ArtifactError when it is missing, unreadable or foreign."""
    if not folder.is_dir():
        raise ArtifactError(f"gallery {folder}: no such folder")
    path = folder / META_NAME
    if not path.is_file():
        raise ArtifactError(f"gallery {folder}: no {META_NAME} (not a gallery, or an interrupted build)")
    meta = read_json_object(path, f"gallery {folder}: {META_NAME}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"gallery {folder}: format version {meta.get('format_version')!r}, this build reads {FORMAT_VERSION}"
        )
    missing = [key for key in ("d", "nlist", "M", "nbits", "ntotal", "sha256", "index_bytes") if key not in meta]
    if missing:
        raise ArtifactError(f"gallery {folder}: {META_NAME} lacks {', '.join(missing)}")
    return meta
