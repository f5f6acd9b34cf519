"""The one reader of a JSON file that must hold an object (gallery.json, items.json, shard.json, profile.json ...).

    read_json_object(path, what)
        missing            ->  "<what>: missing"
        not readable       ->  "<what>: unreadable (<the OS's reason>)"
        not JSON           ->  "<what>: not valid JSON (<the parser's reason>)"
        JSON, not {...}    ->  "<what>: expected a JSON object, got <list / string / ...>"

Each is one line in the caller's error type (ArtifactError unless told), so an artifact's description
that is deleted, truncated or hand-edited is refused the same way wherever it is read.  The callers
check the object's fields themselves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

from service.errors import ArtifactError, NobackfillError

_KINDS = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean", type(None): "null"}


def read_json_object(
    path: Path, what: str, *, error: type[NobackfillError] = ArtifactError, finite: bool = False
) -> dict[str, Any]:
    """The JSON object in `path`; `error` in one line starting with `what` (how to name the file) otherwise.

    finite: refuse the NaN / Infinity literals Python's json writes and reads, as any other bad token
    (a profile's numbers must be finite; most descriptions hold none).
    """

    def no_constants(token: str) -> NoReturn:
        raise ValueError(f"{token} is not a JSON number")

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{what}: missing") from None
    except UnicodeDecodeError as exc:
        raise error(f"{what}: not valid JSON ({exc})") from exc
    except OSError as exc:
        raise error(f"{what}: unreadable ({exc.strerror or exc})") from exc
    try:
        data = json.loads(text, parse_constant=no_constants) if finite else json.loads(text)
    except ValueError as exc:  # json.JSONDecodeError is one
        raise error(f"{what}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise error(f"{what}: expected a JSON object, got {_KINDS.get(type(data), type(data).__name__)}")
    return data
