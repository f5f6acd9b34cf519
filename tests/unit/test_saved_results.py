"""Saved eval / compare results (compat/saved.py): what a file must be for the operator page to show it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.compat.saved import COMPARE_KIND, EVAL_KIND, FORMAT_VERSION, read_document
from service.errors import ArtifactError

ROW = {"method": "old", "alpha": 0.0, "recall@1": 0.5}
EVAL = {"kind": EVAL_KIND, "format_version": FORMAT_VERSION, "profile_id": "abc", "rows": [ROW]}


def write(folder: Path, content: object) -> Path:
    path = folder / "saved.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_a_saved_eval_of_the_served_profile_is_read(tmp_path: Path) -> None:
    assert read_document(write(tmp_path, EVAL), EVAL_KIND, "abc", "api.ui_eval") == EVAL


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (None, "no such file"),
        ("{not json", "not readable JSON"),
        ([ROW], "a list (what `--json` prints, without the profile's id), not 'nobackfill-eval'"),
        ({"old_model": "x"}, "no kind, not 'nobackfill-eval'"),
        ({**EVAL, "kind": COMPARE_KIND}, "kind 'nobackfill-profile-compare', not 'nobackfill-eval'"),
        ({**EVAL, "format_version": 99}, "format_version 99, not 1"),
        ({**EVAL, "profile_id": "other"}, "scores profile 'other', but this service serves 'abc'"),
        ({**EVAL, "rows": []}, "`rows` must be a non-empty list of eval rows"),
    ],
)
def test_anything_else_is_refused_in_one_line_naming_the_setting(tmp_path: Path, content: object, why: str) -> None:
    path = tmp_path / "saved.json" if content is None else write(tmp_path, content)
    with pytest.raises(ArtifactError) as refused:
        read_document(path, EVAL_KIND, "abc", "api.ui_eval")
    assert refused.value.message.startswith(f"api.ui_eval={path}: ") and why in refused.value.message
    assert "\n" not in refused.value.message


def test_a_comparison_needs_an_outcome_and_a_served_profile(tmp_path: Path) -> None:
    compare = {"kind": COMPARE_KIND, "format_version": FORMAT_VERSION, "profile_id": "abc", "outcome": "pass"}
    assert read_document(write(tmp_path, compare), COMPARE_KIND, "abc", "api.ui_compare")["outcome"] == "pass"
    with pytest.raises(ArtifactError, match="outcome` must be pass, fail, undecided or refused"):
        read_document(write(tmp_path, {**compare, "outcome": "maybe"}), COMPARE_KIND, "abc", "api.ui_compare")
    with pytest.raises(ArtifactError, match="no profile is served"):
        read_document(write(tmp_path, compare), COMPARE_KIND, None, "api.ui_compare")
