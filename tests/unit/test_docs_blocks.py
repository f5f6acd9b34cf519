"""Every shell block of the README and docs/real-models.md says how `make test-docs` runs it, and the marks parse.

`make test-docs` (tests/docs/run_docs.py) runs them from a fresh clone; this checks, in no time, that a block
added without a mark, a mark that does not parse, or a rule that names no command of its block is caught
before that long run.  Pure Python, no subprocess.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("run_docs", ROOT / "tests" / "docs" / "run_docs.py")
assert _spec is not None and _spec.loader is not None
run_docs = importlib.util.module_from_spec(_spec)
sys.modules["run_docs"] = run_docs  # dataclasses look their module up while the class is built
_spec.loader.exec_module(run_docs)


@pytest.mark.parametrize("path", run_docs.DOCUMENTS)
def test_every_shell_block_of_the_document_is_marked(path: str) -> None:
    found = run_docs.blocks(path, (ROOT / path).read_text())
    assert found, f"{path} has no shell block"
    for block in found:
        assert block.run or block.reason, block.where


def test_the_readme_runs_the_demo_serves_it_and_asks_it_over_http() -> None:
    found = run_docs.blocks("README.md", (ROOT / "README.md").read_text())
    served = [rule for block in found for rule in block.rules if rule.kind == "serve"]
    assert any(rule.matches("make demo   # set up .venv") for rule in served)
    asks = [block for block in found if block.run and 'curl -s "$BASE/v1/search"' in block.text]
    assert asks and "BASE=http://127.0.0.1:8000" in asks[0].text


MARKDOWN = """\
Intro.

<!-- docs: run; serve "make demo" until http://127.0.0.1:8000/readyz; skip "make test": CI runs it -->
```bash
make demo   # serves
make test
nobackfill fit SUPPORT \\
    --out PROFILE
```

```
output, not a command
```

  <!-- docs: skip: placeholders -->
  ```bash
  nobackfill eval PROFILE_DIR TEST_DIR
  ```
"""


def test_marks_rules_and_commands_are_read_as_documented() -> None:
    first, second = run_docs.blocks("doc.md", MARKDOWN)
    assert (first.line, first.run, [rule.kind for rule in first.rules]) == (4, True, ["serve", "skip"])
    assert run_docs.commands(first.text)[2] == "nobackfill fit SUPPORT \\\n    --out PROFILE"
    assert (second.run, second.reason, second.text) == (False, "placeholders", "nobackfill eval PROFILE_DIR TEST_DIR")
    script = run_docs.script(first, 1)
    # The server runs in the background and is waited for; the skipped command is echoed, not run.
    assert "{\nmake demo   # serves\n} >" in script and "docs_wait_ready http://127.0.0.1:8000/readyz $!" in script
    assert "echo 'docs: not run (CI runs it): make test'" in script
    assert "\nnobackfill fit SUPPORT \\\n    --out PROFILE\n" in script


def test_a_block_marked_stop_the_server_stops_the_earlier_blocks_server_first() -> None:
    # loadtest/run.sh load-tests whatever answers on its port: without the stop it would test the cut-over
    # server an earlier block left running instead of starting the service it names.
    (block,) = run_docs.blocks("doc.md", "<!-- docs: run; stop the server -->\n```bash\nloadtest/run.sh\n```\n")
    script = run_docs.script(block, 1)
    assert script.index("docs_stop_server") < script.index("loadtest/run.sh")
    (plain,) = run_docs.blocks("doc.md", "<!-- docs: run -->\n```bash\nloadtest/run.sh\n```\n")
    assert "docs_stop_server" not in run_docs.script(plain, 1)


@pytest.mark.parametrize(
    ("markdown", "message"),
    [
        ("```bash\nls\n```\n", "doc.md:1: a bash block without a `<!-- docs: ... -->` mark"),
        ("<!-- docs: maybe -->\n```bash\nls\n```\n", "doc.md:2: a mark starts with `run` or `skip: REASON`"),
        ("<!-- docs: skip: -->\n```bash\nls\n```\n", "doc.md:2: `docs: skip:` needs a reason"),
        ('<!-- docs: run; skip "make test": slow -->\n```bash\nmake test-unit\n```\n', "no command of the block"),
        ('<!-- docs: run; serve "x" until http://example.com/ -->\n```bash\nx\n```\n', "is neither"),
        ("<!-- docs: run -->\n```bash\nls\n", "a fence that is never closed"),
    ],
)
def test_a_missing_or_broken_mark_is_refused_with_its_place(markdown: str, message: str) -> None:
    with pytest.raises(run_docs.MarkError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_docs.blocks("doc.md", markdown)
