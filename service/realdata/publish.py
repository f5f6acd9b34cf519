"""Write a folder atomically: build it in a hidden sibling, then rename it onto its name.

    check_output(out, marker, force)      refuse a foreign folder always, one of ours without force
    with staging(out, marker, force) as tmp:
        ... write files into tmp, the `marker` file last ...
    # on success: tmp renamed to out (an old `out` moved aside first, deleted after)
    # on any error: tmp deleted, `out` untouched

The marker is the file that says "this folder is ours and complete" (corpus.json, the model's
build record): a folder without it is never replaced, even with --force, so a typo in --out
cannot wipe a user's folder.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from service.atomic_dir import replace_dir, sibling_dir
from service.errors import InputError


def check_output(out: Path, marker: str, force: bool) -> None:
    """Refuse `out` when it holds something we did not write, or something we did without force."""
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir() or out.is_symlink():
        raise InputError(f"{out} exists and is not a folder; refusing to overwrite it")
    if (out / marker).is_file():
        if not force:
            raise InputError(f"{out} already exists; pass --force to replace it")
        return
    if any(out.iterdir()):
        raise InputError(f"{out} exists, is not empty and was not written by nobackfill; refusing to overwrite it")


@contextmanager
def staging(out: Path, marker: str, force: bool) -> Iterator[Path]:
    """A fresh hidden sibling of `out` to write into; renamed onto `out` when the block succeeds."""
    check_output(out, marker, force)
    tmp = sibling_dir(out)
    try:
        yield tmp
        if not (tmp / marker).is_file():
            raise RuntimeError(f"internal: {marker} was not written into {tmp}")
        _replace(tmp, out, marker, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace(tmp: Path, out: Path, marker: str, force: bool) -> None:
    """Rename `tmp` onto `out` (an old `out` is moved aside first and deleted only once tmp is in place)."""
    check_output(out, marker, force)  # again: something may have appeared while we were writing
    replace_dir(tmp, out)
