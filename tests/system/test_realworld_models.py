"""The real upgrade's two models (`nobackfill realworld models`): the packaged all-MiniLM-L6-v2 and a static
model2vec model distilled from it on a restricted vocabulary (seconds instead of ~30 s; the full distillation
is the same code with every word piece).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from service.errors import InputError
from service.realdata import models
from tests.support.world import REAL_VOCAB_LIMIT as VOCAB_LIMIT

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the models load from local folders; never ask the Hub

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
    assert "LOAD REPORT" not in stdout and "UNEXPECTED" not in stdout  # transformers' report of the MiniLM load
    # Bars redrawn into a pipe: model2vec's while distilling, transformers' while loading the weights.
    assert "Encoding tokens" not in stdout and "Loading weights" not in stdout and "\r" not in stdout


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
