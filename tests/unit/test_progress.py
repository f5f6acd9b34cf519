"""Progress in a file or pipe is whole lines, a few of them, never a redrawn bar."""

from __future__ import annotations

import io

import pytest

from service.progress import PlainLines, progress_bar


@pytest.mark.parametrize("leave", [True, False])
def test_a_bar_in_a_file_writes_a_few_whole_lines(leave: bool) -> None:
    out = io.StringIO()
    bar = progress_bar(total=10_000, desc="encode", unit="input", file=out, leave=leave)
    assert isinstance(bar, PlainLines)
    for _ in range(10_000):
        bar.update(1)
    bar.close()
    bar.close()  # a second close (a `with` block after an explicit one) writes nothing more
    text = out.getvalue()
    lines = text.split("\n")
    assert "\r" not in text and text.endswith("\n") and lines[-1] == ""
    assert 1 <= len(lines) - 1 <= 3 and all(line.startswith("encode:") for line in lines[:-1]), text
    if leave:
        assert "10000/10000" in lines[-2]


def test_a_disabled_bar_writes_nothing() -> None:
    out = io.StringIO()
    with progress_bar(total=10, desc="x", unit="it", file=out, enabled=False) as bar:
        bar.update(10)
    assert out.getvalue() == ""
