"""docs/architecture.md's layer table is the rule: every `service.*` import goes to a lower layer.

The table is read from the document itself, so the rule and its check cannot drift apart; a module
or package of service/ the table does not place fails here too (place it before it lands).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICE = ROOT / "service"
NAME = re.compile(r"^[a-z_]+(/|\.py)$")  # a package (`query/`) or a top-level module (`pipeline.py`)


def layers() -> dict[str, int]:
    """Package or module name -> its layer, from the table under "## Packages and layers"."""
    section = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").split("## Packages and layers")[1]
    table = section.split("```")[1]
    out: dict[str, int] = {}
    layer = None
    for line in table.splitlines():
        words = line.split()
        if words and words[0].isdigit():
            layer, words = int(words[0]), words[1:]
        if layer is None:
            continue
        for word in words:
            if NAME.match(word):
                out.setdefault(word.removesuffix("/").removesuffix(".py"), layer)
    out["__init__"] = out.get("__init__", 1)  # service/__init__.py (version, OpenMP): "service/__init__.py" in layer 1
    return out


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level part of service) of every service import in the module, in functions and TYPE_CHECKING too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = (
                [f"{node.module}.{alias.name}" for alias in node.names] if node.module == "service" else [node.module]
            )
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "service":
                top = parts[1] if len(parts) > 1 else "__init__"
                found.append((node.lineno, "__init__" if top.startswith("__") else top))
    return found


def owner(path: Path) -> str:
    """The package or top-level module a file of service/ belongs to."""
    first = path.relative_to(SERVICE).parts[0]
    return first.removesuffix(".py")


def test_the_table_places_every_package_and_module() -> None:
    table = layers()
    unplaced = sorted({owner(p) for p in SERVICE.rglob("*.py")} - set(table))
    assert unplaced == [], f"not in docs/architecture.md's layer table: {unplaced}"


def test_every_import_goes_to_a_lower_layer() -> None:
    table = layers()
    arrows = []
    for path in sorted(SERVICE.rglob("*.py")):
        me = owner(path)
        for line, other in imports(path):
            if other != me and other in table and table[other] >= table[me]:
                arrows.append(f"{path.relative_to(ROOT)}:{line} ({me}, layer {table[me]}) imports {other} "
                              f"(layer {table[other]})")  # fmt: skip
    assert arrows == [], "\n".join(arrows)


def test_the_reader_sees_the_table_it_checks() -> None:
    # The parse itself can fail: a table it misread would let every import through.
    table = layers()
    assert table["cli"] == 9 and table["pipeline"] == 6 and table["scoring"] == 5 and table["segment"] == 4
    assert table["compat"] == 3 and table["encoders"] == 2 and table["settings"] == 1 and table["errors"] == 0
    assert len(table) >= 25
