"""Publish a finished folder under its final name with renames, so readers see the old one or the new one.

    check_output(out, force, marker=...)      may `out` be written? (the one --out / --force check)
    with staging(out, force=..., marker=...) as tmp:
        ... write everything into tmp, the marker file last ...
    # on success: tmp renamed onto out (replace_dir); on any error: tmp deleted, `out` untouched

    tmp = sibling_dir(final)          a fresh hidden folder beside `final` (same file system: renames are atomic)
    replace_dir(tmp, final)
        no `final`, or an empty one   -> rename tmp to final
        an existing `final`           -> rename it aside, rename tmp to final, then delete the old one
                                         (restored if the second rename fails)

The marker is the file that says "this folder is ours and complete" (gallery.json, items.json, the
model's build record): a folder without it is never replaced, even with --force, so a typo in --out
cannot wipe a user's folder.  Outputs without a marker (a profile, an ONNX export) replace any folder
with --force, as they always have.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

from service.errors import InputError, NobackfillError


def check_output(
    out: Path,
    force: bool,
    *,
    marker: str | Collection[str] = (),
    what: str = "a folder nobackfill wrote",
    error: type[NobackfillError] = InputError,
) -> None:
    """Refuse `out` unless it is absent or empty, or (with force) holds one of our folders; `error` in one line.

    marker: the file (any of the files) whose presence says the folder is ours; none: any folder is ours.
    what: what the folder holds when it is ours, for the messages ("a gallery").
    """
    markers = (marker,) if isinstance(marker, str) else tuple(marker)
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir() or out.is_symlink():
        # A link would be renamed aside and its target left behind; a file is no folder of ours.
        raise error(f"{out}: exists and is not a folder; refusing to overwrite it")
    if not any(out.iterdir()):
        return
    ours = not markers or any((out / name).is_file() for name in markers)
    if not ours:
        # Even --force only replaces a folder we wrote: never wipe one we did not.
        raise error(f"{out}: exists, is not empty and is not {what}; refusing to overwrite it")
    if not force:
        held = f"already holds {what}" if markers else "exists and is not empty"
        raise error(f"{out}: {held} (use --force to replace it)")


@contextmanager
def staging(
    out: Path,
    *,
    force: bool | None = None,
    marker: str | Collection[str] = (),
    what: str = "a folder nobackfill wrote",
    error: type[NobackfillError] = InputError,
) -> Iterator[Path]:
    """A fresh hidden sibling of `out` to write into: renamed onto `out` when the block succeeds, deleted when not.

    force: None when the caller checked `out` already; otherwise check_output runs before the sibling
    is made and again just before the rename (something may have appeared at `out` meanwhile).
    marker: the block must have written it (one of them), or nothing is published.
    """
    markers = (marker,) if isinstance(marker, str) else tuple(marker)
    if force is not None:
        check_output(out, force, marker=markers, what=what, error=error)
    tmp = sibling_dir(out)
    try:
        yield tmp
        if markers and not any((tmp / name).is_file() for name in markers):
            raise RuntimeError(f"internal: {' or '.join(markers)} was not written into {tmp}")
        if force is not None:
            check_output(out, force, marker=markers, what=what, error=error)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
