"""Publish a finished folder under its final name with renames, so readers see the old one or the new one.

    tmp = sibling_dir(final)          a fresh hidden folder beside `final` (same file system: renames are atomic)
    ... write everything into tmp ...
    replace_dir(tmp, final)
        no `final`, or an empty one   -> rename tmp to final
        an existing `final`           -> rename it aside, rename tmp to final, then delete the old one
                                         (restored if the second rename fails)
Callers decide beforehand whether replacing `final` is allowed (--force and the like).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Collection
from pathlib import Path

from service.errors import InputError


def sibling_dir(final: Path) -> Path:
    """Create a fresh hidden folder beside `final` to build it in; InputError naming the folder on failure."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
    except OSError as exc:
        raise InputError(f"cannot write to {final.parent}: {exc.strerror or exc}") from exc
    return tmp


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename the complete folder `tmp` onto `final`; an old `final` is deleted only once `tmp` is in place."""
    if final.is_dir() and not any(final.iterdir()):
        final.rmdir()
    if not final.exists():
        os.rename(tmp, final)
        return
    old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def readable_by_others(folder: Path, keep: Collection[str] = ()) -> None:
    """Give `folder` and its files the modes the umask allows (mkdtemp makes 0700, mkstemp / safetensors 0600).

    keep: files whose mode is not ours to change (a hard link to a user's own file).
    """
    # An artifact built by one user must be readable by the service's (the image runs as uid 10001).
    mask = _umask()
    os.chmod(folder, 0o777 & ~mask)
    for path in folder.iterdir():
        if path.is_file() and path.name not in keep:
            os.chmod(path, 0o666 & ~mask)


def _umask() -> int:
    """The process's umask, read without changing it (os.umask would, for every thread, for a moment)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022
