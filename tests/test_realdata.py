"""The real upgrade's data and models (service/realdata/, `nobackfill realworld`).

Docstring extraction and cleaning on small sources written here, the same on the installed numpy
(fast, and real), the split, the corpus folder through the CLI, and the two real models: the packaged
all-MiniLM-L6-v2 and a static model2vec model distilled from it on a restricted vocabulary (seconds
instead of ~30 s; the full distillation is the same code with every word piece).
"""

from __future__ import annotations

import importlib
import json
import os
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import REAL_VOCAB_LIMIT as VOCAB_LIMIT
from conftest import run_cli

from service.errors import InputError
from service.realdata import corpus, docstrings, layout, models
from service.realdata.publish import staging

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the models load from local folders; never ask the Hub

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


# ------------------------------------------------------------------------------------ the corpus folder


def _read(folder: Path) -> dict[str, object]:
    return {
        "support": layout.read_jsonl(folder / layout.SUPPORT_JSONL),
        "test": layout.read_jsonl(folder / layout.TEST_JSONL),
        "gallery": layout.read_jsonl(folder / layout.GALLERY_JSONL),
        "lines": (folder / layout.GALLERY_TXT).read_text(encoding="utf-8").split("\n"),
        "ids": np.load(folder / layout.GALLERY_IDS),
        "meta": json.loads((folder / layout.CORPUS_JSON).read_text(encoding="utf-8")),
    }


def test_corpus_cli_writes_a_consistent_folder(tmp_path: Path) -> None:
    out = tmp_path / "corpus"
    args = ("realworld", "corpus", "--packages", "numpy", "--support", "200", "--test", "100", "--distractors", "50")
    done = run_cli(*args, "--out", out)
    assert "numpy" in done.stdout and "200 support, 100 test, gallery of 150" in done.stdout
    files = _read(out)
    support, test, gallery = files["support"], files["test"], files["gallery"]
    assert isinstance(support, list) and isinstance(test, list) and isinstance(gallery, list)
    assert (len(support), len(test), len(gallery)) == (200, 100, 150)
    assert set(support[0]) == {"query", "target", "query_id", "target_id"}
    for key in ("query", "target"):
        assert not {r[key] for r in support} & {r[key] for r in test}
    gallery_ids = [r["id"] for r in gallery]
    assert len(set(gallery_ids)) == len(gallery_ids) and gallery_ids == sorted(gallery_ids)
    ids = files["ids"]
    assert isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.tolist() == gallery_ids
    by_id = {r["id"]: r["text"] for r in gallery}
    assert all(by_id[r["target_id"]] == r["target"] for r in test)  # every test target is in the gallery
    assert not {r["target"] for r in support} & set(by_id.values())
    assert files["lines"] == [r["text"] for r in gallery] + [""]  # one text per line, final newline
    meta = files["meta"]
    assert isinstance(meta, dict)
    assert meta["sizes"] == {
        "pairs": meta["packages"]["numpy"]["kept"],
        "support": 200,
        "test": 100,
        "distractors": 50,
        "gallery": 150,
    }
    assert meta["packages"]["numpy"]["version"] == np.__version__
    assert [p.name for p in tmp_path.iterdir()] == ["corpus"]  # no temporary sibling left behind

    # `realworld texts` turns a search answer's ids into these texts.
    answer = tmp_path / "answer.json"
    first = test[0]
    hit = {"ids": [first["target_id"], -7], "scores": [0.9, 0.1], "mode": "slerp", "alpha": 0.5, "cache": "miss"}
    answer.write_text(json.dumps({"results": [hit]}))
    shown = run_cli("realworld", "texts", "--corpus", out, "--input", answer, "--width", "1000").stdout
    assert first["target"] in shown and "(not in this corpus)" in shown and "mode slerp" in shown
    answer.write_text(json.dumps({"error": {"code": "not_ready", "message": "loading"}}))
    refused = run_cli("realworld", "texts", "--corpus", out, "--input", answer, check=False)
    assert refused.returncode == 2 and "not_ready" in refused.stderr
    answer.unlink()

    # Deterministic: the same arguments give byte-identical files.
    run_cli(*args, "--out", tmp_path / "again")
    for name in (layout.SUPPORT_JSONL, layout.TEST_JSONL, layout.GALLERY_JSONL, layout.GALLERY_TXT, layout.GALLERY_IDS):
        assert (out / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name


def test_corpus_cli_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "corpus"
    args = ("realworld", "corpus", "--packages", "numpy", "--support", "20", "--test", "10", "--distractors", "5")
    run_cli(*args, "--out", out)
    refused = run_cli(*args, "--out", out, check=False)
    assert refused.returncode == 2 and "--force" in refused.stderr
    run_cli(*args, "--seed", "1", "--out", out, "--force")
    assert json.loads((out / layout.CORPUS_JSON).read_text())["seed"] == 1

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    refused = run_cli(*args, "--out", foreign, "--force", check=False)
    assert refused.returncode == 2 and "not written by nobackfill" in refused.stderr
    assert (foreign / "notes.txt").read_text() == "keep me"

    too_many = run_cli(
        "realworld", "corpus", "--packages", "numpy", "--support", str(10**6), "--out", tmp_path / "x", check=False
    )
    assert too_many.returncode == 2 and "fewer than" in too_many.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "mine"]


def test_staging_leaves_nothing_on_failure(tmp_path: Path) -> None:
    out = tmp_path / "folder"
    with pytest.raises(ZeroDivisionError), staging(out, "done.json", force=False) as tmp:
        (tmp / "half.txt").write_text("half written")
        raise ZeroDivisionError
    assert list(tmp_path.iterdir()) == []
    with staging(out, "done.json", force=False) as tmp:
        (tmp / "done.json").write_text("{}")
    assert [p.name for p in out.iterdir()] == ["done.json"]


# ------------------------------------------------------------------------------------ the models

SIMILAR = ("How do I compute the average of an array?", "Return the arithmetic mean of the array elements.")
UNRELATED = "The train to the coast leaves every morning at nine."


@pytest.fixture(scope="module")
def built_models(real_models: tuple[Path, str]) -> tuple[Path, str]:
    """The session's `nobackfill realworld models` run (conftest.real_models): (the models folder, its output)."""
    return real_models


def _unit_rows(folder: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    rows = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)
    assert isinstance(rows, np.ndarray)
    return rows


def test_models_cli_writes_both_folders(built_models: tuple[Path, str]) -> None:
    out, stdout = built_models
    old, new = out / "minilm-static-256", out / "all-MiniLM-L6-v2"
    assert f"{old}  dim 256" in stdout and f"{new}  dim 384" in stdout
    for folder in (old, new):
        assert (folder / models.BUILD_JSON).is_file() and (folder / "model.safetensors").is_file()
    assert sorted(p.name for p in out.iterdir()) == ["all-MiniLM-L6-v2", "minilm-static-256"]


def test_static_model_loads_with_sentence_transformers(built_models: tuple[Path, str]) -> None:
    rows = _unit_rows(built_models[0] / "minilm-static-256", [*SIMILAR, UNRELATED])
    assert rows.shape == (3, 256)
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-3)
    record = json.loads((built_models[0] / "minilm-static-256" / models.BUILD_JSON).read_text())
    assert record["options"]["vocab_limit"] == VOCAB_LIMIT and record["options"]["pca_dims"] == 256


def test_packaged_minilm_has_real_weights(built_models: tuple[Path, str]) -> None:
    rows = _unit_rows(built_models[0] / "all-MiniLM-L6-v2", [*SIMILAR, UNRELATED])
    assert rows.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-3)
    similar, unrelated = float(rows[0] @ rows[1]), float(rows[0] @ rows[2])
    assert similar > 0.4 > unrelated + 0.2, (similar, unrelated)  # random weights would give ~equal scores


def test_models_are_cached_and_options_checked(built_models: tuple[Path, str]) -> None:
    out = built_models[0]
    stamp = {p: (p / models.BUILD_JSON).stat().st_mtime_ns for p in out.iterdir()}
    built = models.build_models(out, vocab_limit=VOCAB_LIMIT)  # complete: reused, nothing rewritten
    assert (built.old.name, built.new.name) == ("minilm-static-256", "all-MiniLM-L6-v2")
    assert {p: (p / models.BUILD_JSON).stat().st_mtime_ns for p in out.iterdir()} == stamp
    with pytest.raises(InputError, match="--force"):
        models.build_models(out, vocab_limit=VOCAB_LIMIT + 1)
    with pytest.raises(InputError, match="cannot be reduced"):
        models.distill_static(models.packaged_minilm(), out / "tiny", vocab_limit=10)


def test_missing_packaged_minilm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (models.packaged_minilm() / "model.safetensors").is_file()
    monkeypatch.setattr(models, "MINILM_PACKAGE", "nbf_no_such_package")
    with pytest.raises(InputError, match=r"pip install 'nobackfill\[real-demo\]'"):
        models.packaged_minilm()


def test_cli_lists_realworld() -> None:
    assert "realworld" in run_cli("--help").stdout
