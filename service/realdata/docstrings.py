"""Docstring pairs from an installed package's sources: summary (the query) -> description (the target).

A public function, class or method documented as

    Compute the arithmetic mean along the specified axis.      <- summary: the first paragraph

    Returns the average of the array elements. The average     <- description: the paragraphs after it,
    is taken over the flattened array by default ...              up to the first section header

    Parameters                                                  <- stop: numpydoc header (underlined),
    ----------                                                     Google header (`Args:`), reST field
                                                                   (`:param x:`), directive (`.. note::`),
                                                                   doctest `>>>`, code fence or block,
                                                                   Markdown heading or quote, table

gives the pair ("Compute the arithmetic mean along the specified axis.", "Returns the average ...").
A signature line some docstrings open with (`inner(a, b, /)`) is skipped.  Both sides are cleaned of
reST / Markdown markup and collapsed to one line.  Public means the def's name and those of its
enclosing classes have no leading underscore; the module's may (numpy.mean lives in numpy/_core).

Sources are parsed with `ast`, never imported (fast, and no package code runs); files are read in
sorted order, so the pairs are a pure function of the installed versions.  Which pairs are good
enough is corpus.py's decision.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import unicodedata
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Folders that hold tests, benchmarks or code vendored from other projects: not this package's docs.
SKIP_DIRS = frozenset(
    {"tests", "test", "testing", "benchmarks", "examples", "externals", "extern", "_vendor", "vendor"}
)
# Larger files are generated tables or bundled data, not documentation, and are slow to parse.
MAX_FILE_BYTES = 2_000_000
# MiniLM reads 256 word pieces (~1,000 characters); 600 keeps one to three sentences of description.
MAX_TARGET_CHARS = 600

_GOOGLE_HEADERS = (
    "args|arguments|parameters|params|other parameters|keyword args|keyword arguments|kwargs|returns?|"
    "return type|yields?|raises|raise|warns|warnings?|examples?|example usage|usage|notes?|see also|"
    "references?|attributes|methods|todo|shape|shapes|inputs?|outputs?|properties|type|"
    "class attributes|functions|classes|modules"
)
_HEADER_RE = re.compile(rf"^(?:{_GOOGLE_HEADERS})\s*:{{1,2}}\s*$", re.IGNORECASE)
_UNDERLINE_RE = re.compile(r"^\s*([-=~^*+#])\1{2,}\s*$")
_FIELD_RE = re.compile(r"^:\w+(?:\s+[^:`]+)?:(?:\s|$)")  # :param x:, :returns: (not a role, :class:`x`)
_ROLE_RE = re.compile(r":[\w:.+-]+:`([^`]*)`")  # :func:`~numpy.mean`, :py:class:`X`
_LITERAL_RE = re.compile(r"``([^`]*)``")
_DEFAULT_ROLE_RE = re.compile(r"`([^`<]*?)\s*(?:<[^`>]*>)?`_{0,2}")  # `text`, `title <url>`_
_MD_LINK_RE = re.compile(r"\[([^\]]+)\]\([^)]*\)")
_MD_REF_RE = re.compile(r"\[`(~?[^`\]]+)`\]")  # transformers' [`PreTrainedModel`], [`~utils.ModelOutput`]
_SIGNATURE_RE = re.compile(r"^[\w.]+\(.*\)\s*(?:->.*)?$")
_TITLED_TARGET_RE = re.compile(r"^(.*?)\s*<[^<>]+>$")  # `title <target>` inside a role


@dataclass(frozen=True)
class Docstring:
    """One public docstring: where it lives (module.Class.name) and its cleaned (query, target)."""

    source: str
    query: str
    target: str


def package_files(name: str) -> list[Path] | None:
    """The .py files of the installed top-level package `name`, sorted; None when it is not installed."""
    # find_spec on a top-level name locates the package without importing it.
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return [
            path for location in sorted(spec.submodule_search_locations) for path in _sorted_sources(Path(location))
        ]
    if spec.origin and spec.origin.endswith(".py"):
        return [Path(spec.origin)]
    return []  # an extension module: no Python sources to read


def _sorted_sources(root: Path) -> list[Path]:
    """source_files(root) ordered by relative path (rglob's order depends on the file system)."""
    return sorted(source_files(root), key=lambda path: path.relative_to(root).as_posix())


def source_files(root: Path) -> Iterator[Path]:
    """The .py files under `root` that are not tests, benchmarks, vendored code or oversized."""
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        if any(part in SKIP_DIRS for part in parts[:-1]):
            continue
        stem = path.stem
        if stem.startswith("test_") or stem.endswith("_test") or stem in {"conftest", "setup"}:
            continue
        try:
            if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
                continue
        except OSError:
            continue
        yield path


def module_name(path: Path, package_root: Path) -> str:
    """Dotted module name of `path` inside the package folder `package_root` (`numpy/linalg/_linalg.py`)."""
    parts = list(path.relative_to(package_root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def public_docstrings(source: bytes, module: str) -> Iterator[tuple[str, str]]:
    """(qualified name, raw docstring) of the public functions, classes and methods in one module's source.

    Raises SyntaxError / ValueError when the source does not parse (the caller skips that file).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences in old sources: not our concern
        tree = ast.parse(source)
    yield from _walk(tree.body, module)


def _walk(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, str]]:
    """Depth-first, in source order: public defs of this body, then the public defs of public classes."""
    for node in body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        if node.name.startswith("_"):
            continue  # private (and dunder) names are not documented API
        name = f"{prefix}.{node.name}"
        doc = ast.get_docstring(node, clean=True)
        if doc:
            yield name, doc
        if isinstance(node, ast.ClassDef):
            yield from _walk(node.body, name)


def split_docstring(doc: str) -> tuple[str, str] | None:
    """(summary, description) of a cleandoc'ed docstring, each one clean line; None if either is empty."""
    lines = doc.expandtabs().splitlines()
    paragraphs = _paragraphs(_before_sections(lines))
    while paragraphs and _SIGNATURE_RE.match(" ".join(paragraphs[0])):
        paragraphs.pop(0)  # `inner(a, b, /)`: a signature some docstrings open with, not a summary
    if len(paragraphs) < 2:
        return None
    query = clean_text(" ".join(paragraphs[0]))
    target = clean_text(" ".join(" ".join(p) for p in paragraphs[1:]))
    target = truncate(target, MAX_TARGET_CHARS)
    if not query or not target:
        return None
    return query, target


def _before_sections(lines: list[str]) -> list[str]:
    """The lines before the first section header, field list, directive, doctest or code block."""
    kept: list[str] = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        following = lines[i + 1] if i + 1 < len(lines) else ""
        after_blank = i > 0 and not lines[i - 1].strip()
        if (
            (stripped and _UNDERLINE_RE.match(following) and not _UNDERLINE_RE.match(line))  # numpydoc header
            or _UNDERLINE_RE.match(line)  # a table border or an over-lined title
            or _HEADER_RE.match(stripped)  # Google-style `Args:`
            or _FIELD_RE.match(stripped)  # reST `:param x:`
            or stripped.startswith((">", "..", "```", "<", "|", "+-", "#"))  # doctest, quote, directive, fence, tag,
            # table, Markdown heading
            or stripped.endswith("::")  # introduces a literal block
            or (after_blank and stripped and line.startswith("    "))  # an indented (code) block
        ):
            break
        kept.append(line)
    return kept


def _paragraphs(lines: list[str]) -> list[list[str]]:
    """Groups of consecutive non-blank lines."""
    paragraphs: list[list[str]] = []
    current: list[str] = []
    for line in lines:
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(current)
            current = []
    if current:
        paragraphs.append(current)
    return paragraphs


def _ref_text(match: re.Match[str]) -> str:
    """The readable part of a cross-reference: `title <target>` -> title, `~a.b.c` -> c (Sphinx's rule)."""
    text = match.group(1).strip()
    titled = _TITLED_TARGET_RE.match(text)
    if titled and titled.group(1):
        return titled.group(1)
    if text.startswith("~"):
        return text[1:].rsplit(".", 1)[-1]
    return text.lstrip("!.")


def clean_text(text: str) -> str:
    """Markup removed (roles, literals, links, bold), control characters dropped, whitespace collapsed."""
    text = _ROLE_RE.sub(_ref_text, text)
    text = _LITERAL_RE.sub(r"\1", text)
    text = _MD_LINK_RE.sub(r"\1", text)
    text = _MD_REF_RE.sub(_ref_text, text)
    text = _DEFAULT_ROLE_RE.sub(r"\1", text)
    text = text.replace("**", "")
    # str.split() also splits on \x1c-\x1f, \x85, \u2028 and \u2029, which line readers treat as line breaks.
    text = " ".join(text.split())
    return "".join(ch for ch in text if unicodedata.category(ch) not in {"Cc", "Cf", "Cs", "Co", "Cn"})


def truncate(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters at a word boundary (whole when it already fits)."""
    if len(text) <= limit:
        return text
    cut = text[: limit + 1].rsplit(" ", 1)[0]
    return cut if cut and len(cut) <= limit else text[:limit]


def package_docstrings(name: str) -> Iterator[Docstring]:
    """Every (query, target) the installed package `name` documents, in sorted file order."""
    files = package_files(name)
    if not files:
        return
    for path in files:
        root = _package_root(path, name)
        try:
            raw = path.read_bytes()
            found = list(public_docstrings(raw, module_name(path, root)))
        except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
            continue  # a file for another Python version, or unreadable: it documents nothing we can use
        for qualname, doc in found:
            pair = split_docstring(doc)
            if pair is not None:
                yield Docstring(qualname, *pair)


def _package_root(path: Path, name: str) -> Path:
    """The folder named `name` that holds `path` (the package's top folder); its parent for a lone module."""
    for parent in path.parents:
        if parent.name == name:
            return parent
    return path.parent / name
