"""Hidden temporary siblings and the renames that publish them: a failed run leaves nothing behind.

Everything is written next to its final name (same folder, so the rename is atomic on one file
system) as `.NAME.<random>.tmp`; the `.tmp` suffix keeps a half-written `.npy` out of every
`*.npy` glob (a folder of shards passed to `gallery build --from-npy`, say).  Publishing renames the
temporaries over the final names only once all of them are complete; a file that describes another
(OUT.json beside OUT.npy) is renamed last, so its presence says the data beside it is whole.
Folders created for an output are removed again when the run fails, so even they do not linger.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from service.errors import InputError


def refuse_existing(paths: list[Path], force: bool) -> None:
    """InputError when any of `paths` exists and `force` is off, or exists and is a folder."""
    for path in paths:
        if path.is_dir():
            raise InputError(f"{path}: exists and is a folder")
        if path.exists() and not force:
            raise InputError(f"{path}: exists (use --force to replace it)")


def make_parents(path: Path) -> list[Path]:
    """Create the missing folders above `path`; returns them deepest first, for `remove_empty` on failure."""
    missing = list(itertools.takewhile(lambda folder: not folder.exists(), path.parents))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create {path.parent}: {exc.strerror or exc}") from exc
    return missing


def remove_empty(folders: list[Path]) -> None:
    """Remove folders `make_parents` created, deepest first, as long as they are empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _sibling(final: Path) -> Path:
    """A fresh hidden name beside `final`."""
    return final.parent / f".{final.name}.{uuid.uuid4().hex[:8]}.tmp"


def temp_file(final: Path) -> Path:
    """Create an empty hidden sibling of `final` to write into; InputError naming the folder on failure."""
    # Not tempfile.mkstemp: its 0600 mode would survive the rename; open() honours the umask like np.save.
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = _sibling(final)
        tmp.open("xb").close()
    except OSError as exc:
        raise InputError(f"cannot write to {final.parent}: {exc.strerror or exc}") from exc
    return tmp


def temp_json(final: Path, content: dict[str, Any]) -> Path:
    """Write `content` as indented JSON into a hidden sibling of `final`; returns the sibling."""
    tmp = temp_file(final)
    try:
        tmp.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def discard(path: Path) -> None:
    """Remove a temporary file or folder, quietly (it is only ever one of ours)."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def publish_files(moves: list[tuple[Path, Path]]) -> None:
    """Rename each (temporary, final) pair in order; a stale final of the last one goes first.

    The last pair is the description of the others (OUT.json): removing an old one before the new
    data lands means a crash between the renames leaves data without a description, never new
    data beside a stale description.
    """
    if moves:
        moves[-1][1].unlink(missing_ok=True)
    for tmp, final in moves:
        os.replace(tmp, final)
