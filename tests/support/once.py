"""A session fixture's folder built once per test run, not once per xdist worker.

`make test` runs two xdist workers, and each used to build the session's synthetic world and distil the
real models for itself: the same minutes of CPU twice, on a 2-core box.  Under xdist the workers of one
run share the parent of their base temp folder (pytest-N/, with popen-gw0/ and popen-gw1/ in it), so the
first worker to ask builds the folder there under a file lock and the others wait for it, then read it.
Without xdist that parent is shared by earlier runs too, so the folder stays in the run's own temp.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

BUILT = ".built"  # written last: a folder a killed build left behind has none and is built again


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """`name`'s folder, after build(folder) ran in it once for this run (a folder that exists, empty)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        return folder
    folder = tmp_path_factory.getbasetemp().parent / name
    with FileLock(f"{folder}.lock"):
        if not (folder / BUILT).exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a worker's failed build left: start clean
            folder.mkdir()
            build(folder)
            (folder / BUILT).touch()
    return folder
