"""An artifact folder's manifest: manifest.json lists every other file with its size and sha256.

    {"manifest_version": 1, "algorithm": "sha256",
     "files": {"profile.json": {"bytes": 1874, "sha256": "9f2c..."},
               "tensors.safetensors": {"bytes": 590104, "sha256": "41d0..."}}}

The metadata file of an artifact (profile.json, gallery.json) is listed like any other, so an edit to
it is caught as surely as a flipped byte in the tensors.  write_manifest runs last, in the folder
that is about to be published, and writes the file durably (temp file, fsync, rename).
verify_manifest refuses, in one ArtifactError line naming the file:
- a listed file that is missing, or whose size differs (checked first: cheap, and it names a
  truncation as such), or whose sha256 differs;
- a file the manifest does not list (added after the artifact was written);
- a manifest.json that is not what write_manifest writes.
Paths are relative POSIX paths; a listed path may not leave the folder.  Files named in
`size_only` are checked for size alone: a caller that verifies a big file's digest itself (the
gallery's index.faiss, per its verify setting) does not pay for hashing it twice, and must compare
the digest returned for it with its own.
The manifest catches corruption, truncation and edits by anyone who does not rewrite it; it is no
signature: whoever can write the folder can write a new manifest too (the field checks of the
loaders still apply then).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Collection, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from service.errors import ArtifactError
from service.progress import progress_bar

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
_BLOCK = 8 << 20
_PROGRESS_MIN_BYTES = 256 << 20


def sha256_of(path: Path, progress: bool | None = False) -> str:
    """Hex sha256 of a file, read in 8 MiB blocks; a progress bar if asked (None: big files on a terminal)."""
    size = path.stat().st_size
    show = (size >= _PROGRESS_MIN_BYTES and sys.stderr.isatty()) if progress is None else progress
    digest = hashlib.sha256()
    with (
        path.open("rb") as f,
        progress_bar(total=size, unit="B", unit_scale=True, desc=f"sha256 {path.name}", enabled=show) as bar,
    ):
        while block := f.read(_BLOCK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def write_json_durably(path: Path, data: Any) -> None:
    """Write data as indented JSON through a temp file, fsync and one rename: complete or absent.

    The temp file is this process's own (`.NAME.PID.tmp`): two processes writing one path at once
    (parts of a backfill creating their segment) never write into each other's file.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def _files(folder: Path) -> list[str]:
    """Every regular file under folder except the manifest, as sorted relative POSIX paths."""
    found = (p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return sorted(name for name in found if name != MANIFEST_NAME)


def write_manifest(folder: Path, known: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Hash every file of folder into manifest.json (known: name -> sha256 already computed); returns it."""
    known = known or {}
    files = {
        name: {"bytes": (folder / name).stat().st_size, "sha256": known.get(name) or sha256_of(folder / name)}
        for name in _files(folder)
    }
    manifest = {"manifest_version": MANIFEST_VERSION, "algorithm": "sha256", "files": files}
    write_json_durably(folder / MANIFEST_NAME, manifest)
    return manifest


def read_manifest(folder: Path) -> dict[str, dict[str, Any]] | None:
    """The `files` table of folder/manifest.json, checked for shape; None when the folder has none."""
    path = folder / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path}: unreadable ({str(exc).splitlines()[0]})") from exc
    if not isinstance(manifest, dict) or manifest.get("manifest_version") != MANIFEST_VERSION:
        raise ArtifactError(f"{path}: not a version-{MANIFEST_VERSION} manifest")
    if manifest.get("algorithm") != "sha256":
        raise ArtifactError(f"{path}: algorithm {manifest.get('algorithm')!r}, this build checks sha256")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(_entry_ok(name, entry) for name, entry in files.items()):
        raise ArtifactError(f"{path}: malformed file table")
    return files


def _entry_ok(name: Any, entry: Any) -> bool:
    """A relative path inside the folder with an integer size and a 64-hex-digit sha256."""
    if not isinstance(name, str) or not isinstance(entry, dict):
        return False
    parts = PurePosixPath(name).parts
    inside = bool(parts) and not PurePosixPath(name).is_absolute() and ".." not in parts
    size, digest = entry.get("bytes"), entry.get("sha256")
    return (
        inside
        and isinstance(size, int)
        and not isinstance(size, bool)
        and size >= 0
        and isinstance(digest, str)
        and len(digest) == 64
        and all(c in "0123456789abcdef" for c in digest)
    )


def verify_manifest(folder: Path, size_only: Collection[str] = ()) -> dict[str, str] | None:
    """Check every file of folder against its manifest; returns name -> sha256, or None without a manifest.

    A file this process may not read is an ArtifactError line naming it and the uid, not a traceback.
    """
    try:
        return _verified(folder, size_only)
    except PermissionError as exc:
        where = exc.filename or folder
        raise ArtifactError(
            f"{where}: not readable by uid {os.getuid()}, which loads it; make the artifact readable "
            f"(chmod -R a+rX {folder}) or rebuild it: artifacts are written with the umask's modes"
        ) from exc


def _verified(folder: Path, size_only: Collection[str]) -> dict[str, str] | None:
    """verify_manifest's checks."""
    files = read_manifest(folder)
    if files is None:
        return None
    for name in _files(folder):
        if name not in files:
            raise ArtifactError(f"{folder / name}: not in {MANIFEST_NAME} (added after the artifact was written)")
    for name, entry in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            raise ArtifactError(f"{path}: missing (listed in {MANIFEST_NAME})")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise ArtifactError(
                f"{path}: {size:,} bytes, {MANIFEST_NAME} says {entry['bytes']:,} (truncated or replaced)"
            )
        if name in size_only:
            continue
        digest = sha256_of(path)
        if digest != entry["sha256"]:
            raise ArtifactError(
                f"{path}: sha256 {digest[:12]}... does not match {MANIFEST_NAME} ({entry['sha256'][:12]}...); "
                "the file is corrupt or was edited"
            )
    return {name: str(entry["sha256"]) for name, entry in files.items()}
