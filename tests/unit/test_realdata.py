"""The real upgrade's data (service/realdata/): docstring pairs, in process.

Docstring extraction and cleaning on small sources written here, the same on the installed numpy
(fast, and real), and the split.  The corpus folder through the CLI: tests/integration/test_realworld_corpus.py;
the two real models: tests/system/test_realworld_models.py.
"""

from __future__ import annotations

import importlib
import textwrap
from pathlib import Path

import numpy as np
import pytest

from service.errors import InputError
from service.realdata import corpus, docstrings, models

# ------------------------------------------------------------------------------------ cleaning rules


def test_split_stops_at_numpydoc_section() -> None:
    doc = textwrap.dedent(
        """\
        Compute the arithmetic mean along the specified axis.

        Returns the average of the array elements.  The average is taken
        over the flattened array by default.

        Parameters
        ----------
        a : array_like
        """
    )
    assert docstrings.split_docstring(doc) == (
        "Compute the arithmetic mean along the specified axis.",
        "Returns the average of the array elements. The average is taken over the flattened array by default.",
    )


@pytest.mark.parametrize(
    "stop",
    [
        "Args:\n    x: the input",
        "Returns:\n    the value",
        ":param x: the input",
        ":returns: the value",
        ">>> f(1)\n2",
        ".. versionadded:: 1.2",
        "Example::\n\n    f(1)",
        "```python\nf(1)\n```",
        "    f(1)  # an indented code block",
        "### Parameters",
        "> [!WARNING]\n> deprecated",
    ],
)
def test_split_stops_at_every_kind_of_section(stop: str) -> None:
    doc = f"Summary of what the function does.\n\nFirst paragraph of the description is kept.\n\n{stop}\n\nNever this."
    pair = docstrings.split_docstring(doc)
    assert pair == ("Summary of what the function does.", "First paragraph of the description is kept.")


def test_split_needs_both_parts_and_skips_a_signature_line() -> None:
    assert docstrings.split_docstring("Only a summary here.") is None
    assert docstrings.split_docstring("Summary line.\n\nParameters\n----------\nx : int") is None
    pair = docstrings.split_docstring(
        "inner(a, b, /)\n\nInner product of two arrays.\n\nOrdinary inner product of vectors."
    )
    assert pair == ("Inner product of two arrays.", "Ordinary inner product of vectors.")


def test_clean_text_removes_markup_and_line_breaks() -> None:
    raw = (
        "See :func:`~numpy.linalg.norm` and :py:class:`torch.Tensor`, ``x + 1``, `interp`, "
        "[`~utils.ModelOutput`], [`PreTrainedModel`], `the docs <https://x.org>`_, "
        "[a link](https://y.org), **bold**,\n\ttabs\u2028and\x1cseparators\x00 here, intervals [0, 1]."
    )
    assert docstrings.clean_text(raw) == (
        "See norm and torch.Tensor, x + 1, interp, ModelOutput, PreTrainedModel, the docs, a link, bold, "
        "tabs and separators here, intervals [0, 1]."
    )


def test_a_role_at_line_start_is_not_a_field_list() -> None:
    doc = "Summary of the fused module here.\n\nWe combined the interface of Conv2d and\n:class:`BatchNorm2d` in one."
    assert docstrings.split_docstring(doc) == (
        "Summary of the fused module here.",
        "We combined the interface of Conv2d and BatchNorm2d in one.",
    )


def test_truncate_cuts_at_a_word_boundary() -> None:
    text = "alpha beta gamma delta"
    assert docstrings.truncate(text, 100) == text
    assert docstrings.truncate(text, 12) == "alpha beta"
    assert docstrings.truncate("x" * 50, 10) == "x" * 10
    long = docstrings.split_docstring("A summary of four words.\n\n" + "word " * 400)
    assert long is not None and len(long[1]) <= docstrings.MAX_TARGET_CHARS


@pytest.mark.parametrize(
    ("query", "target", "reason"),
    [
        ("Compute the mean.", "The mean is the sum divided by the number of elements.", "short_query"),
        ("Compute " + "very " * 40 + "long.", "The mean is the sum divided by the number of elements.", "long_query"),
        ("Compute the arithmetic mean.", "It is the sum over the count.", "short_target"),
        ("Count the elements in a set.", "For more information, see https://redis.io/commands/zcount", "short_target"),
        (
            "Compute the arithmetic mean of values.",
            "Compute the arithmetic mean of values, again and more.",
            "repeats_query",
        ),
        ("Compute the arithmetic mean of values.", "The mean is the sum divided by the number of elements.", None),
    ],
)
def test_reject_reason(query: str, target: str, reason: str | None) -> None:
    assert corpus.reject_reason(query, target) == reason


# ------------------------------------------------------------------------------------ extraction

_CORE = '''
"""Module docstring: not a pair."""

def mean(values):
    """Compute the arithmetic mean of the values.

    The mean is the sum of the values divided by how many there are, a measure of central tendency.

    Parameters
    ----------
    values : list
    """
    def helper():
        """Nested helpers are not documented API at all.

        They never appear in the corpus because they are not reachable by users.
        """


def _private(values):
    """A private function that nobody should ever query.

    Its description is long enough to be kept if it were public, which it is not.
    """


class Scaler:
    """Scale numbers into the unit interval for display.

    The scaler remembers the smallest and the largest value it has seen and maps them to zero and one.
    """

    def fit(self, values):
        """Learn the smallest and largest value of the data.

        Both bounds are stored on the instance so that transform can use them later on new values.
        """

    def __repr__(self):
        """Dunder methods are private names and are skipped here.

        Even though this description is long enough to pass the other filters of the corpus.
        """

    def _helper(self):
        """A private method is skipped like a private function.

        Even though this description is long enough to pass the other filters of the corpus.
        """
'''

_DUPLICATES = '''
def average(values):
    """Compute the arithmetic mean of the values.

    A second function documented with the same summary: the first occurrence wins the query.
    """


def scale(values):
    """Map every number into the closed unit interval.

    The scaler remembers the smallest and the largest value it has seen and maps them to zero and one.
    """


def median(values):
    """Compute the middle value of the sorted values.

    The mean is the sum of the values divided by how many there are, unlike the median, which is robust.
    """


def report(values):
    """Print a short report about the values given.

    The report lists the count, the mean and the spread of the values on one line of text.
    """
'''

_TEST_FILE = '''
def test_mean():
    """Tests are never part of the corpus of docstring pairs.

    This docstring is long enough and public, and still must not appear anywhere in the corpus.
    """
'''


@pytest.fixture()
def toy_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A package `nbf_toy_pkg` on sys.path with known docstrings, tests, a private module and a broken file."""
    root = tmp_path / "site" / "nbf_toy_pkg"
    (root / "tests").mkdir(parents=True)
    (root / "sub").mkdir()
    (root / "__init__.py").write_text('"""Toy package."""\n')
    (root / "core.py").write_text(_CORE)
    (root / "sub" / "__init__.py").write_text("")
    (root / "sub" / "_more.py").write_text(_DUPLICATES)  # private module, public functions: kept
    (root / "tests" / "test_core.py").write_text(_TEST_FILE)
    (root / "test_top.py").write_text(_TEST_FILE)
    (root / "broken.py").write_text("def f(:\n    pass\n")  # unparsable: skipped, not fatal
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    return "nbf_toy_pkg"


def test_extraction_on_a_toy_package(toy_package: str) -> None:
    found = list(docstrings.package_docstrings(toy_package))
    assert [d.source for d in found] == [
        "nbf_toy_pkg.core.mean",
        "nbf_toy_pkg.core.Scaler",
        "nbf_toy_pkg.core.Scaler.fit",
        "nbf_toy_pkg.sub._more.average",
        "nbf_toy_pkg.sub._more.scale",
        "nbf_toy_pkg.sub._more.median",
        "nbf_toy_pkg.sub._more.report",
    ]
    assert found[0].query == "Compute the arithmetic mean of the values."
    assert found[0].target.startswith("The mean is the sum of the values divided by how many there are")
    assert "Parameters" not in found[0].target


def test_collect_drops_duplicates_first_wins(toy_package: str) -> None:
    collected = corpus.collect([toy_package, "nbf_not_installed"])
    assert [p.source for p in collected.pairs] == [
        "nbf_toy_pkg.core.mean",
        "nbf_toy_pkg.core.Scaler",
        "nbf_toy_pkg.core.Scaler.fit",
        "nbf_toy_pkg.sub._more.report",
    ]
    assert [p.id for p in collected.pairs] == [0, 1, 2, 3]
    assert collected.dropped == {"duplicate_query": 1, "duplicate_target": 1, "near_duplicate_target": 1}
    assert collected.missing == ["nbf_not_installed"]
    assert (collected.packages[toy_package].found, collected.packages[toy_package].kept) == (7, 4)


# ------------------------------------------------------------------------------------ a real package


@pytest.fixture(scope="module")
def numpy_pairs() -> corpus.Collected:
    """numpy's docstring pairs (about 500; ~1 s)."""
    return corpus.collect(["numpy"])


def test_real_numpy_pairs_are_clean_and_deterministic(numpy_pairs: corpus.Collected) -> None:
    assert len(numpy_pairs.pairs) > 300
    assert numpy_pairs.packages["numpy"].version == np.__version__
    again = corpus.collect(["numpy"])
    assert again.pairs == numpy_pairs.pairs
    for p in numpy_pairs.pairs:
        for text in (p.query, p.target):
            assert text and text == text.strip() and len(text.splitlines()) == 1
            text.encode("utf-8")
        assert corpus.reject_reason(p.query, p.target) is None
        assert len(p.target) <= docstrings.MAX_TARGET_CHARS
        assert ">>>" not in p.target and "\nParameters" not in p.target
    assert len({" ".join(corpus.words(p.query)) for p in numpy_pairs.pairs}) == len(numpy_pairs.pairs)
    sources = {p.source for p in numpy_pairs.pairs}
    assert "numpy.lib._function_base_impl.interp" in sources  # np.interp, in a private module
    assert not any(".tests." in s or s.rsplit(".", 1)[-1].startswith("_") for s in sources)


def test_split_is_disjoint_and_seeded(numpy_pairs: corpus.Collected) -> None:
    pairs = numpy_pairs.pairs
    parts = corpus.split(pairs, support=200, test=100, distractors=50, seed=3)
    assert (len(parts.support), len(parts.test), len(parts.distractors)) == (200, 100, 50)
    ids = [p.id for p in (*parts.support, *parts.test, *parts.distractors)]
    assert len(set(ids)) == len(ids)
    assert parts == corpus.split(pairs, support=200, test=100, distractors=50, seed=3)
    assert parts.test != corpus.split(pairs, support=200, test=100, distractors=50, seed=4).test
    everything = corpus.split(pairs, support=200, test=100, distractors=None, seed=3)
    assert len(everything.distractors) == len(pairs) - 300
    assert [p.id for p in everything.gallery()] == sorted(p.id for p in (*everything.test, *everything.distractors))
    with pytest.raises(InputError, match="fewer than"):
        corpus.split(pairs, support=len(pairs), test=1, distractors=0, seed=0)


def test_missing_packaged_minilm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (models.packaged_minilm() / "model.safetensors").is_file()
    monkeypatch.setattr(models, "MINILM_PACKAGE", "nbf_no_such_package")
    with pytest.raises(InputError, match=r"pip install 'nobackfill\[real-demo\]'"):
        models.packaged_minilm()
