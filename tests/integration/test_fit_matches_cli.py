"""The fitting library's profile is the profile `nobackfill fit` writes, bit for bit (the command in process).

The library alone: tests/unit/test_fitting.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from service.compat.fit_options import FitOptions
from service.compat.fitting import fit_profile
from service.compat.profile import CompatProfile, load_profile
from service.vocabulary import Criterion, Head
from tests.support.cli import cli


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


def test_fit_profile_is_the_profile_the_command_writes(standin_fit_supports: dict[str, Path]) -> None:
    folders = standin_fit_supports
    out = folders["root"] / "cli-nlerp"
    args = ("--folds", 3, "--head", "nlerp", "--criterion", "r1", "--eval-queries", 50, "--seed", 2)
    done = cli("fit", folders["text"], "--out", out, *args)
    assert done.returncode == 0, done.stderr
    options = FitOptions(head=Head.nlerp, folds=3, criterion=Criterion.r1, eval_queries=50, seed=2)
    outcome = fit_profile({"text": folders["text"]}, options)
    _same_profile(outcome.profile, load_profile(out))
    assert outcome.head_why is None and list(outcome.reports) == ["text"] and len(outcome.panels) == 1
    assert outcome.reports["text"]["support_recall"] == outcome.profile.fit_report["support_recall"]


def test_automatic_head_over_two_folders_matches_the_command(standin_fit_supports: dict[str, Path]) -> None:
    folders = standin_fit_supports
    out = folders["root"] / "cli-multi"
    done = cli("fit", "--support", f"text={folders['text']}", "--support", f"image={folders['image']}", "--out", out)
    assert done.returncode == 0, done.stderr
    outcome = fit_profile({"text": folders["text"], "image": folders["image"]}, FitOptions())
    _same_profile(outcome.profile, load_profile(out))
    assert list(outcome.reports) == list(outcome.supports) == ["text", "image"]
    assert [title.split(", ")[1] for _, title in outcome.panels] == ["text queries", "image queries"]
    assert outcome.head_why is not None and f"head {outcome.profile.head}: {outcome.head_why}" in done.stdout
