"""Artifacts built by one user are readable by another (the image serves as uid 10001): writers honour the umask."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tests.support.cli import cli
from tests.support.world import WORLD_GALLERY_SIZE, World


def unreadable(root: Path) -> list[str]:
    """Paths under `root` (itself included) that others could not read (or, for folders, enter)."""
    found = []
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        needed = 0o055 if path.is_dir() else 0o044
        if mode & needed != needed:
            found.append(f"{path.relative_to(root.parent)} {mode:o}")
    return found


def test_every_artifact_is_readable_by_others_under_the_usual_umask(world: World, tmp_path: Path) -> None:
    previous = os.umask(0o022)
    try:
        profile, items, segment, hub = tmp_path / "profile", tmp_path / "items", tmp_path / "segment", tmp_path / "hub"
        assert cli("fit", world.support_dir, "--out", profile, "--folds", 3).returncode == 0
        assert cli("synth", "items", "--size", WORLD_GALLERY_SIZE, "--out", items).returncode == 0
        done = cli(
            "backfill", "run", "--segment", segment, "--input", items, "--gallery", world.gallery_dir,
            "--backend", "synthetic-new", "--profile", world.profile_dir, "--limit", 500,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        done = cli("gallery", "hubness", world.gallery_dir, profile, "--queries", world.support_dir, "--out", hub)
        assert done.returncode == 0, done.stderr
    finally:
        os.umask(previous)
    for artifact in (world.gallery_dir, profile, items, segment, hub):
        assert unreadable(artifact) == [], artifact
