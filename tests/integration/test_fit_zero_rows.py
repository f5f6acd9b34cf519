"""All-zero rows in support / test folders: dropped and counted by `fit` and `eval`, refused with --strict."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from service.compat.io import load_split
from tests.support.cli import Done, cli
from tests.support.upgrade_standin import make_world, write_split


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A support and a test split of one stand-in upgrade, each with a few all-zero rows written in."""
    root = tmp_path_factory.mktemp("zero")
    world = make_world(16, 24, 8)
    support = write_split(root / "support", 400, world, seed=1)
    test = write_split(root / "test", 200, world, seed=2)
    _zero(support / "old_query.npy", [3, 10, 11])  # a lexical old model: no known token
    _zero(support / "new_query.npy", [10])  # pair 10 is zero on both sides: still one pair
    _zero(support / "old_target.npy", [5])
    _zero(test / "old_query.npy", [0, 1])
    return {"root": root, "support": support, "test": test}


def _zero(path: Path, rows: list[int]) -> None:
    a = np.load(path)
    a[rows] = 0.0
    np.save(path, a)


def _only_error_line(done: Done) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


def test_load_split_drops_the_pairs_and_counts_per_file(folders: dict[str, Path]) -> None:
    split = load_split(folders["support"])
    assert split.zero_rows == {"old_query.npy": 3, "new_query.npy": 1, "old_target.npy": 1}
    assert len(split.old_query) == len(split.new_query) == len(split.query_ids) == 400 - 3
    assert split.new_target is not None
    assert len(split.old_target) == len(split.new_target) == len(split.target_ids) == 400 - 1
    # The ids travel with their rows, so relevance is unchanged for the rows that stay.
    assert 3 not in split.query_ids and 10 not in split.query_ids and 5 not in split.target_ids
    assert np.any(split.old_query != 0, axis=1).all() and np.any(split.old_target != 0, axis=1).all()


def test_fit_drops_zero_rows_warns_once_and_records_the_counts(folders: dict[str, Path]) -> None:
    out = folders["root"] / "profile"
    done = cli("fit", folders["support"], "--out", out, "--folds", 3)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, done.stderr
    assert "5 all-zero row(s) (3 in old_query.npy, 1 in new_query.npy, 1 in old_target.npy)" in warnings[0]
    meta = json.loads((out / "profile.json").read_text())
    expected = {"old_query.npy": 3, "new_query.npy": 1, "old_target.npy": 1}
    assert meta["fit_report"]["zero_rows_dropped"] == expected
    assert meta["fit_report"]["support_queries"] == 397


def test_fit_strict_refuses_zero_rows_and_writes_nothing(folders: dict[str, Path]) -> None:
    out = folders["root"] / "strict-profile"
    line = _only_error_line(cli("fit", folders["support"], "--out", out, "--strict"))
    assert "old_query.npy: 3 all-zero row(s) (first: row 3; --strict refuses them)" in line
    assert not out.exists()


def test_nan_still_refused_without_strict(folders: dict[str, Path]) -> None:
    bad = folders["root"] / "nan"
    shutil.copytree(folders["support"], bad)
    a = np.load(bad / "new_target.npy")
    a[7, 2] = np.nan
    np.save(bad / "new_target.npy", a)
    line = _only_error_line(cli("fit", bad, "--out", folders["root"] / "nan-profile"))
    assert "new_target.npy: 1 row(s) with NaN/inf values (first: row 7)" in line


def test_eval_drops_zero_rows_and_says_so(folders: dict[str, Path]) -> None:
    profile = folders["root"] / "eval-profile"
    assert cli("fit", folders["support"], "--out", profile, "--folds", 3).returncode == 0
    done = cli("eval", profile, folders["test"], "--json")
    assert done.returncode == 0, done.stderr
    assert "dropped the pairs of 2 all-zero row(s) (2 in old_query.npy)" in done.stderr
    rows = json.loads(done.stdout)
    assert rows and all(0.0 <= r["recall@1"] <= 1.0 for r in rows)
    table = cli("eval", profile, folders["test"])
    assert "2 in old_query.npy" in table.stdout.replace("\n", " ")
    line = _only_error_line(cli("eval", profile, folders["test"], "--strict"))
    assert "old_query.npy: 2 all-zero row(s)" in line


def test_a_split_with_no_usable_query_is_refused(folders: dict[str, Path]) -> None:
    empty = folders["root"] / "all-zero"
    shutil.copytree(folders["test"], empty)
    _zero(empty / "new_query.npy", list(range(200)))
    line = _only_error_line(cli("fit", empty, "--out", folders["root"] / "none"))
    assert "every query pair has an all-zero row" in line
