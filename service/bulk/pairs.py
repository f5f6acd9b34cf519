"""Reading and validating the pairs file of `nobackfill support build`.

One JSON object per line: {"query": ..., "target": ...}, plus optional integer ids:
    target_id   the target's id; rows with the same target_id share ONE target row (several queries
                may retrieve the same target), so their target values must be equal
    query_id    the id of what the query should retrieve, in the support layout's sense
                (service/compat/io.py: query i is relevant to target j when query_ids[i] ==
                target_ids[j]); it names the target when target_id is absent, and must equal
                target_id when both are given
Rows without ids (all rows or none) get the ids 0..n-1, each query paired with its own target row.
Values are texts, or for an image modality image paths relative to the pairs file's folder.

Bad rows (FILE:LINE, 1-based): empty, not UTF-8, not a JSON object, a missing / empty / non-string
query or target, an id that is not an integer, query_id != target_id, a target_id reused with
another target, an unreadable image.  The first is an InputError; with skip_bad they are dropped
(the whole pair) and listed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.bulk.inputs import SKIP_HINT, Bad, image_check, int_id, read_lines, resolve_image, text_value
from service.errors import InputError
from service.vocabulary import Modality


@dataclass
class Pairs:
    """The usable pairs: one query row per pair, deduplicated targets, their ids and source lines."""

    path: Path
    queries: list[str] = field(default_factory=list)
    query_ids: list[int] = field(default_factory=list)
    query_lines: list[int] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    target_ids: list[int] = field(default_factory=list)
    target_lines: list[int] = field(default_factory=list)
    skipped: list[Bad] = field(default_factory=list)
    blank: int = 0  # blank lines: no pair, no error


@dataclass(frozen=True)
class _Row:
    """One parsed pair: values and its id (None when the row has none)."""

    query: str
    target: str
    key: int | None


def read_pairs(path: Path, query_modality: Modality, target_modality: Modality, *, skip_bad: bool) -> Pairs:
    """Parse and check every row of `path` (images opened); InputError on the first bad row unless `skip_bad`."""
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    pairs = Pairs(path)
    index_of: dict[int, int] = {}  # target id -> target row
    with_ids: bool | None = None
    for line, text in read_lines(path):
        if text is not None and not text.strip():
            pairs.blank += 1
            continue
        where = f"{path}:{line}"
        row = _parse(text, path, query_modality, target_modality)
        if isinstance(row, _Row) and row.key is not None and row.key in index_of:
            seen = index_of[row.key]
            if pairs.targets[seen] != row.target:
                row = f"target_id {row.key} is given another target on line {pairs.target_lines[seen]}"
        if isinstance(row, str):
            bad = Bad(line, where, row)
            if not skip_bad:
                raise InputError(f"{bad.message()} {SKIP_HINT}")
            pairs.skipped.append(bad)
            continue
        if with_ids is None:
            with_ids = row.key is not None
        elif with_ids != (row.key is not None):
            raise InputError(f"{where}: {'no' if with_ids else 'an'} id, unlike the rows before it (ids: all or none)")
        key = len(pairs.queries) if row.key is None else row.key
        if key not in index_of:
            index_of[key] = len(pairs.targets)
            pairs.targets.append(row.target)
            pairs.target_ids.append(key)
            pairs.target_lines.append(line)
        pairs.queries.append(row.query)
        pairs.query_ids.append(key)
        pairs.query_lines.append(line)
    if not pairs.queries:
        raise InputError(f"{path}: no usable pairs ({len(pairs.skipped)} skipped)")
    return pairs


def _parse(text: str | None, path: Path, query_modality: Modality, target_modality: Modality) -> _Row | str:
    """One line as a _Row, or the reason it is bad."""
    if text is None:
        return "not valid UTF-8"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not valid JSON ({exc.msg} at column {exc.colno})"
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    values: dict[str, str] = {}
    for name, modality in (("query", query_modality), ("target", target_modality)):
        value = text_value(obj.get(name))
        if value is None:
            return f"{name!r} is missing or not a non-empty string (got {obj.get(name)!r:.40})"
        values[name] = value if modality == "text" else str(resolve_image(value.strip(), path))
        if modality == "image" and (reason := image_check(Path(values[name]))):
            return f"{name} image {values[name]}: {reason}"
    key = _key(obj)
    return key if isinstance(key, str) else _Row(values["query"], values["target"], key)


def _key(obj: dict[str, Any]) -> int | None | str:
    """The row's id from target_id / query_id (see the module docstring), or the reason it is bad."""
    ids: dict[str, int] = {}
    for name in ("target_id", "query_id"):
        if obj.get(name) is not None:
            value = int_id(obj[name])
            if value is None:
                return f"{name} is not a 64-bit integer (got {obj[name]!r:.40})"
            ids[name] = value
    if len(ids) == 2 and ids["target_id"] != ids["query_id"]:
        return (
            f"query_id {ids['query_id']} != target_id {ids['target_id']} (a query's id is the id of the target "
            "it should retrieve)"
        )
    return next(iter(ids.values()), None)
