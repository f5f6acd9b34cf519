"""Reading and validating the inputs of `nobackfill encode`: what counts as one input, and what is bad.

An input file is read as one of three kinds:
    lines   a text file, one input per line (UTF-8; a leading BOM and CR-LF line ends are fine)
    jsonl   one JSON object per line, the input under --field; chosen by a `.jsonl` suffix or by
            giving --field (a `.jsonl` file without --field is refused: the key cannot be guessed)
    folder  images only: the image files of a folder (by suffix, hidden files ignored), sorted by name
For --modality image the value of a line / field is an image path, relative ones resolved against
the folder of the file that lists them.

Blank lines (empty or whitespace only, a trailing one included) hold no input: they are skipped and
counted, and the inputs are numbered without them.  Bad inputs (each reported as FILE:LINE, lines
counted from 1): a line that is not UTF-8, a JSONL line that is not a JSON object, lacks the field
or whose value is not a non-empty string (or, with --id-field, whose id is not an integer), an image
that cannot be read or is not an image PIL can identify.  Images are checked here, before any model runs, so a bad file
deep in a folder is refused up front instead of after an hour of encoding.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from service.errors import InputError
from service.vocabulary import Modality

Kind = Literal["lines", "jsonl", "folder"]
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".gif", ".bmp", ".webp", ".tif", ".tiff"})
INT64_MAX = 2**63 - 1
SKIP_HINT = "(use --skip-bad to skip bad inputs)"


@dataclass(frozen=True)
class InputSpec:
    """Where the inputs are and how to read them."""

    path: Path
    kind: Kind
    modality: Modality
    field: str | None = None
    id_field: str | None = None


@dataclass(frozen=True)
class Item:
    """One usable input: its line (1-based; for a folder, its position), its value, its id if any."""

    line: int
    value: str  # text, or the resolved path of an image file
    id: int | None = None


@dataclass(frozen=True)
class Bad:
    """One refused input: where it is (FILE:LINE or the image file) and why."""

    line: int
    where: str
    reason: str

    def message(self) -> str:
        """One line for the user."""
        return f"{self.where}: {self.reason}"


@dataclass
class Scan:
    """The result of checking every input once: how many are usable, the bad ones skipped, the blank lines."""

    count: int = 0
    skipped: list[Bad] = field(default_factory=list)
    blank: int = 0


@dataclass(frozen=True)
class Blank:
    """A blank line: no input, and no error."""

    line: int


def input_spec(path: Path, modality: Modality, field_name: str | None, id_field: str | None) -> InputSpec:
    """Decide how to read `path` (see the module docstring); InputError for a combination that cannot work."""
    if path.is_dir():
        if modality != "image":
            raise InputError(f"{path}: is a folder; a folder of image files needs --modality image")
        if field_name is not None or id_field is not None:
            raise InputError(f"{path}: --field / --id-field apply to a JSONL file, not a folder")
        return InputSpec(path, "folder", modality)
    if not path.is_file():
        raise InputError(f"{path}: no such file or folder")
    if field_name is None and path.suffix.lower() == ".jsonl":
        raise InputError(f"{path}: a JSONL file needs --field KEY naming the input in each object")
    if field_name is None:
        if id_field is not None:
            raise InputError(f"{path}: --id-field applies to a JSONL file (give --field too)")
        return InputSpec(path, "lines", modality)
    return InputSpec(path, "jsonl", modality, field_name, id_field)


def read_items(spec: InputSpec, *, check_images: bool) -> Iterator[Item | Bad | Blank]:
    """Every line of `spec` in order, as an Item, a Bad or a Blank; images are opened only with `check_images`."""
    if spec.kind == "folder":
        yield from _folder_items(spec.path, check_images)
        return
    for line, text in read_lines(spec.path):
        where = f"{spec.path}:{line}"
        if text is None:
            yield Bad(line, where, "not valid UTF-8")
        elif not text.strip():
            yield Blank(line)
        elif spec.kind == "lines":
            yield _value_item(line, where, text, spec, None, check_images)
        else:
            yield _json_item(line, where, text, spec, check_images)


def scan(spec: InputSpec, *, skip_bad: bool) -> Scan:
    """Check every input once (images included); the first bad one is an InputError unless `skip_bad`."""
    result = Scan()
    for item in read_items(spec, check_images=True):
        if isinstance(item, Item):
            result.count += 1
        elif isinstance(item, Blank):
            result.blank += 1
        elif skip_bad:
            result.skipped.append(item)
        else:
            raise InputError(f"{item.message()} {SKIP_HINT}")
    return result


def image_check(path: Path) -> str | None:
    """Why `path` is not a usable image file, or None when PIL can identify it (headers only, cheap)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with path.open("rb") as f, Image.open(f) as image:
            image.verify()
    except UnidentifiedImageError:
        return "not an image file (PIL cannot identify it)"
    except OSError as exc:
        return f"cannot read ({exc.strerror or exc})"
    except Exception as exc:  # PIL raises many types (SyntaxError, ValueError, ...) for a corrupt file
        return f"corrupt image ({type(exc).__name__}: {exc})"
    return None


def image_b64(path: Path) -> str:
    """The file's bytes, base64-encoded: what an encoder takes as one image input (as `image_b64` over HTTP)."""
    try:
        return base64.b64encode(path.read_bytes()).decode("ascii")
    except OSError as exc:
        raise InputError(f"cannot read image {path} ({exc.strerror or exc})") from exc


def encoder_input(value: str, modality: str) -> str:
    """An item's stored value as an encoder takes it: the text itself, or an image path's file as base64.

    The one conversion of an item for the new model, whoever encodes it: `encode`, `backfill run` and
    the cascade on the query path (InputError when an image cannot be read).
    """
    return image_b64(Path(value)) if modality == "image" else value


def text_value(value: Any) -> str | None:
    """`value` when it is a non-blank string, else None."""
    return value if isinstance(value, str) and value.strip() else None


def int_id(value: Any) -> int | None:
    """`value` when it is an int64-sized integer (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int) or not -INT64_MAX - 1 <= value <= INT64_MAX:
        return None
    return value


def resolve_image(value: str, listed_in: Path) -> Path:
    """An image path from a list file: absolute, or relative to the list file's folder."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else listed_in.parent / path


def read_lines(path: Path) -> Iterator[tuple[int, str | None]]:
    """(1-based line number, text or None when not UTF-8) of every line; the final newline ends no line."""
    try:
        with path.open("rb") as f:
            for number, raw in enumerate(f, start=1):
                raw = raw.rstrip(b"\n").rstrip(b"\r")
                if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]  # a BOM is an editor's artefact, not part of the first input
                try:
                    yield number, raw.decode("utf-8")
                except UnicodeDecodeError:
                    yield number, None
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from exc


def _value_item(line: int, where: str, value: str, spec: InputSpec, item_id: int | None, check: bool) -> Item | Bad:
    """An Item for a text input, or for an image path once the image checks out."""
    if spec.modality == "text":
        return Item(line, value, item_id)
    path = resolve_image(value.strip(), spec.path)
    reason = image_check(path) if check else None
    return Bad(line, where, f"image {path}: {reason}") if reason else Item(line, str(path), item_id)


def _json_item(line: int, where: str, text: str, spec: InputSpec, check: bool) -> Item | Bad:
    """Parse one JSONL line into an Item (its --field value and --id-field id) or a Bad."""
    assert spec.field is not None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        return Bad(line, where, f"not valid JSON ({exc.msg} at column {exc.colno})")
    if not isinstance(row, dict):
        return Bad(line, where, f"expected a JSON object, got {type(row).__name__}")
    if spec.field not in row:
        return Bad(line, where, f"no field {spec.field!r}")
    value = text_value(row[spec.field])
    if value is None:
        return Bad(line, where, f"field {spec.field!r} is not a non-empty string (got {row[spec.field]!r:.40})")
    item_id = None
    if spec.id_field is not None:
        item_id = int_id(row.get(spec.id_field))
        if item_id is None:
            return Bad(line, where, f"id field {spec.id_field!r} is missing or not a 64-bit integer")
    return _value_item(line, where, value, spec, item_id, check)


def _folder_items(folder: Path, check: bool) -> Iterator[Item | Bad]:
    """The folder's image files sorted by name (positions from 1), each checked when `check`."""
    try:
        names = sorted(
            p.name
            for p in folder.iterdir()
            if not p.name.startswith(".") and p.suffix.lower() in IMAGE_SUFFIXES and not p.is_dir()
        )
    except OSError as exc:
        raise InputError(f"{folder}: cannot list ({exc.strerror or exc})") from exc
    for position, name in enumerate(names, start=1):
        path = folder / name
        reason = image_check(path) if check else None
        yield Bad(position, str(path), reason) if reason else Item(position, str(path))
