"""read_json_object (json_file.py): one line for a missing, unreadable, malformed or non-object JSON file."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.errors import ArtifactError, InputError
from service.json_file import read_json_object


def test_an_object_is_read(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text('{"n": 1, "x": NaN}')
    data = read_json_object(tmp_path / "a.json", "the file")
    assert data["n"] == 1 and data["x"] != data["x"]  # NaN read back, as json.loads does


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "the file: missing"),
        ("{not json", "the file: not valid JSON (Expecting property name enclosed in double quotes"),
        (b"\xff\xfe", "the file: not valid JSON ("),
        ("[1, 2]", "the file: expected a JSON object, got a list"),
        ('"text"', "the file: expected a JSON object, got a string"),
        ("null", "the file: expected a JSON object, got null"),
    ],
)
def test_each_failure_is_one_line_naming_the_file(tmp_path: Path, content: str | bytes | None, message: str) -> None:
    path = tmp_path / "a.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ArtifactError) as caught:
        read_json_object(path, "the file")
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_a_folder_is_unreadable_and_the_error_type_is_the_callers(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"^the file: unreadable \(Is a directory\)$"):
        read_json_object(tmp_path, "the file", error=InputError)


def test_finite_refuses_nan_and_infinity_literals(tmp_path: Path) -> None:
    for literal in ("NaN", "Infinity", "-Infinity"):
        (tmp_path / "a.json").write_text(f'{{"alpha": {literal}}}')
        with pytest.raises(ArtifactError, match=f"not valid JSON \\({literal} is not a JSON number\\)"):
            read_json_object(tmp_path / "a.json", "the file", finite=True)
