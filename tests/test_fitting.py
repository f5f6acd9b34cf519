"""The fitting library (service/compat/fitting.py): a profile from FitOptions in-process, the same one `fit` writes."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import cli
from upgrade_standin import make_world, write_split

from service.commands import fit as fit_command
from service.compat import selection
from service.compat.fit_options import FitOptions, check_options, parse_class_map
from service.compat.fitting import fit_profile
from service.compat.profile import CompatProfile, load_profile
from service.errors import InputError
from service.vocabulary import Criterion, FitOn, Head, HeadFamily

WORLD = make_world(32, 48, 24)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two support folders of one stand-in upgrade (their ids overlap, as text and image views would)."""
    root = tmp_path_factory.mktemp("fitting")
    return {
        "root": root,
        "text": write_split(root / "text", 400, WORLD, seed=1),
        "image": write_split(root / "image", 300, WORLD, seed=5),
    }


def _same_profile(fitted: CompatProfile, written: CompatProfile) -> None:
    """Everything but the creation time and the checksum (set on saving) agrees, tensors bit for bit."""
    ignore = ("created_at", "tensors_sha256")
    mine = {k: v for k, v in fitted.metadata().items() if k not in ignore}
    theirs = {k: v for k, v in written.metadata().items() if k not in ignore}
    assert _jsonable(mine) == _jsonable(theirs)
    assert fitted.tensors.keys() == written.tensors.keys()
    for name, tensor in fitted.tensors.items():
        assert np.array_equal(tensor, written.tensors[name]), name


def _jsonable(obj: Any) -> Any:
    """The value as profile.json stores it (enums as their text, tuples as lists)."""
    import json

    return json.loads(json.dumps(obj))


def test_fit_profile_is_the_profile_the_command_writes(folders: dict[str, Path]) -> None:
    out = folders["root"] / "cli-nlerp"
    args = ("--folds", 3, "--head", "nlerp", "--criterion", "r1", "--eval-queries", 50, "--seed", 2)
    done = cli("fit", folders["text"], "--out", out, *args)
    assert done.returncode == 0, done.stderr
    options = FitOptions(head=Head.nlerp, folds=3, criterion=Criterion.r1, eval_queries=50, seed=2)
    outcome = fit_profile({"text": folders["text"]}, options)
    _same_profile(outcome.profile, load_profile(out))
    assert outcome.head_why is None and list(outcome.reports) == ["text"] and len(outcome.panels) == 1
    assert outcome.reports["text"]["support_recall"] == outcome.profile.fit_report["support_recall"]


def test_automatic_head_over_two_folders_matches_the_command(folders: dict[str, Path]) -> None:
    out = folders["root"] / "cli-multi"
    done = cli("fit", "--support", f"text={folders['text']}", "--support", f"image={folders['image']}", "--out", out)
    assert done.returncode == 0, done.stderr
    outcome = fit_profile({"text": folders["text"], "image": folders["image"]}, FitOptions())
    _same_profile(outcome.profile, load_profile(out))
    assert list(outcome.reports) == list(outcome.supports) == ["text", "image"]
    assert [title.split(", ")[1] for _, title in outcome.panels] == ["text queries", "image queries"]
    assert outcome.head_why is not None and f"head {outcome.profile.head}: {outcome.head_why}" in done.stdout


def test_adapter_head_without_a_curve_has_no_plot(folders: dict[str, Path]) -> None:
    options = FitOptions(head=Head.adapter, same_set=True, fit_on=FitOn.query, adapter={"epochs": 1}, threads=1)
    outcome = fit_profile({"text": folders["text"]}, options)
    assert outcome.profile.family is HeadFamily.adapter and outcome.panels == []
    assert outcome.profile.adapter is not None and outcome.profile.adapter["config"]["epochs"] == 1
    assert outcome.profile.fit_report["selection"] == "none (the adapter head has no weight to choose)"


def test_dropped_zero_rows_reach_the_warning_callback(tmp_path: Path) -> None:
    support = write_split(tmp_path / "zero", 60, WORLD, seed=3)
    rows = np.load(support / "old_query.npy")
    rows[5] = 0.0
    np.save(support / "old_query.npy", rows)
    lines: list[str] = []
    outcome = fit_profile({"text": support}, FitOptions(folds=3), warn=lines.append)
    assert lines == [f"{support}: dropped the pairs of 1 all-zero row(s) (1 in old_query.npy) (--strict refuses them)"]
    assert outcome.profile.fit_report["zero_rows_dropped"] == {"old_query.npy": 1}
    with pytest.raises(InputError, match="all-zero"):
        fit_profile({"text": support}, FitOptions(folds=3, strict=True))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (FitOptions(adapter={"epochs": 3}, threads=2), "--epochs, --threads only apply to --head adapter"),
        (FitOptions(head=Head.adapter, top_k=2), "--top-k only apply to --head psp / lsp, not adapter"),
        (FitOptions(head=Head.psp, query_pairs=(Path("/nope"),)), "--head psp has no R to refit"),
    ],
)
def test_options_a_head_would_ignore_are_refused_before_any_file_is_read(options: FitOptions, message: str) -> None:
    with pytest.raises(InputError, match=message):
        check_options(options)
    with pytest.raises(InputError, match=message):
        fit_profile({"text": Path("/does/not/exist")}, options)


def test_class_map_text_or_sequence() -> None:
    assert parse_class_map("3, 0,1,") == [3, 0, 1] == parse_class_map((3, 0, 1))
    assert parse_class_map(None) is None
    with pytest.raises(InputError, match="--class-map must be comma-separated integers"):
        parse_class_map("a,b")


def test_no_support_folder_is_refused() -> None:
    with pytest.raises(InputError, match="no support set"):
        fit_profile({}, FitOptions())


def test_fit_options_defaults_are_the_commands() -> None:
    flags = inspect.signature(fit_command.fit).parameters
    defaults = FitOptions()
    for name in ("fit_on", "folds", "same_set", "eval_queries", "seed", "criterion", "eval_gallery", "strict"):
        assert getattr(defaults, name) == flags[name].default.default, name
    assert defaults.query_pairs_weight == flags["query_pairs_weight"].default.default
    assert defaults.head is None is flags["head"].default.default
    assert defaults.eval_queries == selection.MAX_EVAL_QUERIES
