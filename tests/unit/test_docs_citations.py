"""Every repo file a docstring or comment cites, and every relative link of README.md and docs/*.md, exists.

A citation is a path written in the text: `docs/backfill.md`, `service/index/milvus.py`,
`loadtest/bench_items.py`, `deploy/prometheus/alerts.yml`, or one relative to service/ such as
`query/search.py`.  Only paths that start with a folder of the repo (or of service/, or of the citing
file's own folder) are checked, and bare names only when they are Markdown files (`README.md`): a bare
`heads.py` or `gallery.json` is a name, not a citation.  Generated outputs the repo ignores
(`loadtest/report.md`, `artifacts/...`) are not expected to exist.  Pure Python, no subprocess.
"""

from __future__ import annotations

import ast
import fnmatch
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest


def _repo_root() -> Path:
    """The folder holding pyproject.toml above this file (the test may live in tests/ or tests/unit/)."""
    for folder in Path(__file__).resolve().parents:
        if (folder / "pyproject.toml").is_file():
            return folder
    raise RuntimeError("no pyproject.toml above this test")


ROOT = _repo_root()
SCANNED = ("service", "loadtest", "tests")
SKIPPED_PARTS = {".venv", "__pycache__", ".git", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
SUFFIXES = ("md", "py", "yml", "yaml", "sh", "json")
# A path: segments of word characters, dots and dashes joined by '/', ending in a cited suffix; not part of
# a longer path, a URL or a dotted name (nothing path-like right before it, no '/' or word character after).
CITATION = re.compile(rf"(?<![\w./~-])((?:[\w.-]+/)*[\w-][\w.-]*\.(?:{'|'.join(SUFFIXES)}))(?![\w/])")
# Outputs of the repo's own tools, ignored by git: citing them says where they are written, not that they exist.
GENERATED = ("artifacts/*", "data/*", "loadtest/results/*", "loadtest/report.md", "loadtest/*.csv", "build/*")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")


def cited_paths(text: str) -> list[str]:
    """The path-like strings of `text`, in order."""
    return [match.group(1) for match in CITATION.finditer(text)]


def _texts(source: str) -> Iterator[tuple[int, str]]:
    """(first line, text) of every docstring (module, class, function) and every comment of a Python source."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                yield node.body[0].lineno, docstring
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def _folders(root: Path) -> set[str]:
    """Names a checked citation may start with: the repo's top-level folders and service/'s sub-packages."""
    top = {p.name for p in root.iterdir() if p.is_dir() and p.name not in SKIPPED_PARTS}
    return top | {p.name for p in (root / "service").iterdir() if p.is_dir() and p.name not in SKIPPED_PARTS}


def _resolves(cited: str, citing_dir: Path, root: Path) -> bool:
    """Whether the cited path exists at the repo root, under service/, under docs/ (a bare .md) or beside the citer."""
    bases = [root, root / "service", citing_dir]
    if "/" not in cited:
        bases.append(root / "docs")
    return any((base / cited).exists() for base in bases)


def _checked(cited: str, citing_dir: Path, folders: set[str]) -> bool:
    """Whether `cited` is a citation of a repo file (rather than a bare name, a placeholder or an output)."""
    if any(fnmatch.fnmatch(cited, pattern) for pattern in GENERATED):
        return False
    first, _, rest = cited.partition("/")
    if not rest:
        return cited.endswith(".md")  # README.md: a document; heads.py, gallery.json: names
    if first in (".", ".."):
        return True
    own = {p.name for p in citing_dir.iterdir() if p.is_dir()} if citing_dir.is_dir() else set()
    return first in folders or first in own


def broken_citations(path: Path, root: Path = ROOT) -> list[str]:
    """'FILE:LINE: PATH' for each repo path cited in a docstring or comment of `path` that does not exist."""
    folders = _folders(root)
    try:
        shown = path.relative_to(root).as_posix()
    except ValueError:
        shown = str(path)
    found = []
    for line, text in _texts(path.read_text(encoding="utf-8")):
        for offset, text_line in enumerate(text.splitlines() or [text]):
            for cited in cited_paths(text_line):
                if _checked(cited, path.parent, folders) and not _resolves(cited, path.parent, root):
                    found.append(f"{shown}:{line + offset}: {cited}")
    return found


def broken_links(markdown: Path, root: Path = ROOT) -> list[str]:
    """'FILE:LINE: TARGET' for each relative Markdown link `](target)` of `markdown` whose file does not exist."""
    try:
        shown = markdown.relative_to(root).as_posix()
    except ValueError:
        shown = str(markdown)
    found = []
    for number, line in enumerate(markdown.read_text(encoding="utf-8").splitlines(), start=1):
        for match in MD_LINK.finditer(line):
            target = match.group(1).split("#", 1)[0]
            if not target or re.match(r"[a-z][a-z0-9+.-]*:", target):  # an anchor, http:, mailto:
                continue
            if not (markdown.parent / target).exists():
                found.append(f"{shown}:{number}: {target}")
    return found


def python_files(root: Path = ROOT) -> list[Path]:
    """Every .py file under the scanned folders, outside virtual environments and caches."""
    files = []
    for folder in SCANNED:
        for path in sorted((root / folder).rglob("*.py")):
            if not SKIPPED_PARTS.intersection(path.relative_to(root).parts):
                files.append(path)
    return files


def markdown_files(root: Path = ROOT) -> list[Path]:
    """README.md and docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def test_every_cited_repo_path_exists() -> None:
    files = python_files()
    assert len(files) > 100, "the scan found too few files: is ROOT right?"
    broken = [line for path in files for line in broken_citations(path)]
    assert not broken, "docstrings / comments cite files that do not exist:\n" + "\n".join(broken)


def test_every_markdown_link_resolves() -> None:
    broken = [line for path in markdown_files() for line in broken_links(path)]
    assert not broken, "README.md / docs link files that do not exist:\n" + "\n".join(broken)


def test_checker_names_each_broken_citation(tmp_path: Path) -> None:
    module = tmp_path / "cites.py"
    module.write_text(
        '"""See DESIGN.md section 2, docs/no-such-page.md and service/pipeline/parts.py."""\n'
        "\n\n"
        "def f() -> None:\n"
        '    """Relative to service/: query/search.py exists, query/nowhere.py does not."""\n'
        "\n\n"
        "# loadtest/bench_nothing.py; the name heads.py, https://example.com/x.md and artifacts/x.json are fine\n",
        encoding="utf-8",
    )
    assert broken_citations(module) == [
        f"{module}:1: DESIGN.md",
        f"{module}:1: docs/no-such-page.md",
        f"{module}:5: query/nowhere.py",
        f"{module}:8: loadtest/bench_nothing.py",
    ]


def test_checker_names_each_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# there\n", encoding="utf-8")
    page.write_text(
        "[ok](there.md#a) [web](https://example.com/x.md) [top](#top)\n[gone](missing.md) ![img](gone.png)\n",
        encoding="utf-8",
    )
    assert broken_links(page) == [f"{page}:2: missing.md", f"{page}:2: gone.png"]


@pytest.mark.parametrize(
    ("text", "paths"),
    [
        ("see `service/index/milvus.py` and docs/scale-out.md.", ["service/index/milvus.py", "docs/scale-out.md"]),
        ("http://host/docs/a.md, ./x.db, service.index.milvus, OUT.json", ["OUT.json"]),
        ("deploy/prometheus/alerts.yml (rules)", ["deploy/prometheus/alerts.yml"]),
    ],
)
def test_cited_paths(text: str, paths: list[str]) -> None:
    assert cited_paths(text) == paths
