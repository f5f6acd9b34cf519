"""The fitting library (service/compat/fitting.py): a profile from FitOptions in-process.

That it is the profile `nobackfill fit` writes: tests/integration/test_fit_matches_cli.py.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest

from service.commands import fit as fit_command
from service.compat import selection
from service.compat.fit_options import FitOptions, check_options, parse_class_map
from service.compat.fitting import fit_profile
from service.errors import InputError
from service.vocabulary import FitOn, Head, HeadFamily
from tests.support.upgrade_standin import make_world, write_split

WORLD = make_world(32, 48, 24)


def test_adapter_head_without_a_curve_has_no_plot(standin_fit_supports: dict[str, Path]) -> None:
    options = FitOptions(head=Head.adapter, same_set=True, fit_on=FitOn.query, adapter={"epochs": 1}, threads=1)
    outcome = fit_profile({"text": standin_fit_supports["text"]}, options)
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
