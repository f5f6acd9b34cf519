"""A setting's names and how a refusal speaks of it: its env var, its YAML key, its value cut short or hidden,
the closest spelling of a typo, and one clause per bad setting of a pydantic ValidationError.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ValidationError

ENV_PREFIX = "NOBACKFILL_"
NESTED = "__"
# A value quoted in a refusal is cut to this many characters (the line stays one readable line).
_QUOTED_CHARS = 80


def env_name(*loc: str | int) -> str:
    """The env var of a setting: ("index", "nprobe") -> NOBACKFILL_INDEX__NPROBE."""
    return ENV_PREFIX + NESTED.join(str(part).upper() for part in loc)


def problems(exc: ValidationError, root: type[BaseModel]) -> list[str]:
    """One clause per bad setting of a ValidationError (the first error of each), never a line break."""
    clauses: dict[tuple[str | int, ...], str] = {}
    for error in exc.errors():
        loc = tuple(error["loc"])
        if loc in clauses:  # the other branches of one union: the first says enough
            continue
        if not loc:  # a model validator's own clause (unknown section, contradictions)
            clauses[loc] = error["msg"]
        elif error["type"] == "extra_forbidden":  # its value is not shown: it may be a mistyped secret
            close = closest(str(loc[-1]), _fields_at(root, loc[:-1]))
            hint = f"; did you mean {env_name(*loc[:-1], close)}?" if close else ""
            what = "setting" if len(loc) > 1 else "settings section"
            clauses[loc] = f"{_named(loc)} is no {what}{hint}"
        else:
            msg = str(error["msg"])
            clauses[loc] = f"{_named(loc)}={_quoted(loc, error.get('input'))}: {msg[:1].lower()}{msg[1:]}"
    return [" ".join(clause.split()) for clause in clauses.values()]


def _named(loc: tuple[str | int, ...]) -> str:
    """A setting by its env var and its YAML key: NOBACKFILL_INDEX__NPROBE (index.nprobe)."""
    return f"{env_name(*loc)} ({'.'.join(str(part) for part in loc)})"


def _quoted(loc: tuple[str | int, ...], value: Any) -> str:
    """The value a refusal names, cut short; a secret (a key, a token, a URL that may hold a password) is not shown."""
    name = str(loc[-1])
    if name.endswith(("_key", "_token", "_url")):
        return "<hidden>"
    text = repr(value)
    return text if len(text) <= _QUOTED_CHARS else text[: _QUOTED_CHARS - 3] + "..."


def _fields_at(root: type[BaseModel], loc: tuple[str | int, ...]) -> list[str]:
    """The field names of the section at `loc` (the sections themselves at ()); [] where there is no model."""
    model: Any = root
    for part in loc:
        is_model = isinstance(model, type) and issubclass(model, BaseModel)
        field = model.model_fields.get(str(part)) if is_model else None
        model = field.annotation if field is not None else None
    return list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice `word` most likely meant to spell (a typo's fix), or None when none is close."""
    close = difflib.get_close_matches(word.lower(), list(choices), n=1, cutoff=0.6)
    return close[0] if close else None
