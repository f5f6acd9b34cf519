"""Publishing an artifact folder (atomic_dir.py): the one --out / --force check, and staging that leaves nothing.

A write that fails half-way must leave `out` as it was and no hidden sibling beside it: the item
store and the hubness sidecar (which used to leave its `.NAME.tmp-XXXX` behind) are made to fail
mid-write here; the profile's is test_compat_profile.py's test_atomic_save_never_half_writes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.atomic_dir import check_output, staging
from service.compat.hubness import write_hubness
from service.errors import ArtifactError, InputError
from service.items.store import write_item_store
from service.vocabulary import Modality


def names(folder: Path) -> list[str]:
    """Every entry of `folder`, hidden ones included."""
    return sorted(p.name for p in folder.iterdir())


def test_an_absent_or_empty_output_is_always_allowed(tmp_path: Path) -> None:
    check_output(tmp_path / "new", force=False, marker="done.json")
    (tmp_path / "empty").mkdir()
    check_output(tmp_path / "empty", force=False, marker="done.json")


def test_a_folder_of_ours_is_replaced_only_with_force(tmp_path: Path) -> None:
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "done.json").write_text("{}")
    with pytest.raises(InputError, match=r"^.*ours: already holds a thing \(use --force to replace it\)$"):
        check_output(ours, force=False, marker="done.json", what="a thing")
    check_output(ours, force=True, marker="done.json", what="a thing")


def test_a_folder_without_the_marker_is_never_replaced_even_with_force(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    for force in (False, True):
        with pytest.raises(InputError, match="is not empty and is not a thing; refusing to overwrite it"):
            check_output(foreign, force=force, marker=("done.json", "other.json"), what="a thing")


def test_without_a_marker_any_folder_is_replaced_with_force(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("x")
    with pytest.raises(ArtifactError, match=r"exists and is not empty \(use --force to replace it\)"):
        check_output(out, force=False, error=ArtifactError)
    check_output(out, force=True)


def test_a_file_or_a_link_is_no_folder_to_replace(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    for out in (tmp_path / "file", tmp_path / "link"):
        with pytest.raises(InputError, match="exists and is not a folder; refusing to overwrite it"):
            check_output(out, force=True)


def test_staging_publishes_only_a_folder_with_its_marker(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="done.json was not written"), staging(out, marker="done.json") as tmp:
        (tmp / "half.txt").write_text("x")
    assert names(tmp_path) == []
    with staging(out, marker="done.json") as tmp:
        (tmp / "done.json").write_text("{}")
    assert names(tmp_path) == ["out"] and names(out) == ["done.json"]


def test_staging_leaves_nothing_on_failure(tmp_path: Path) -> None:
    out = tmp_path / "folder"
    with pytest.raises(ZeroDivisionError), staging(out, force=False, marker="done.json") as tmp:
        (tmp / "half.txt").write_text("half written")
        raise ZeroDivisionError
    assert list(tmp_path.iterdir()) == []
    with staging(out, force=False, marker="done.json") as tmp:
        (tmp / "done.json").write_text("{}")
    assert [p.name for p in out.iterdir()] == ["done.json"]


def test_staging_checks_again_before_the_rename(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(InputError, match="refusing to overwrite it"), staging(out, force=True, marker="d") as tmp:
        (tmp / "d").write_text("{}")
        out.mkdir()  # someone else's folder appears while we write
        (out / "theirs.txt").write_text("x")
    assert names(tmp_path) == ["out"] and names(out) == ["theirs.txt"]


def test_a_failed_item_store_write_leaves_no_sibling_and_keeps_the_old_store(tmp_path: Path) -> None:
    out = tmp_path / "items"
    write_item_store(out, [(1, "a"), (2, "b")], Modality.text, "test")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(InputError, match="appears twice"):
        write_item_store(out, [(1, "a"), (1, "again")], Modality.text, "test", force=True)
    assert names(tmp_path) == ["items"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_failed_hubness_write_leaves_no_sibling(tmp_path: Path) -> None:
    out = tmp_path / "hub"
    unserialisable = {"gallery_fingerprint": "g" * 64, "profile_id": "p1", "k": object()}
    with pytest.raises(TypeError):  # json.dumps fails after both .npy files are written
        write_hubness(out, np.array([0, 1]), np.array([0.1, 0.2], dtype=np.float32), unserialisable)
    assert names(tmp_path) == []
