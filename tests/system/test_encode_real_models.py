"""`nobackfill encode` and `nobackfill support build` with real weights: the packaged all-MiniLM-L6-v2 and a
tiny random static model (tests/support/tiny_models.py).  The same commands with the synthetic models:
tests/integration/test_encode_cli.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.bulk.encode import load_encoder
from service.bulk.pairs import read_pairs
from service.bulk.support import EncodeOptions, ModelSource, build_support
from service.compat.io import load_split
from service.encoders.identity import weights_fingerprint
from tests.support.cli import cli, run_cli, write_pairs
from tests.support.tiny_models import packaged_minilm, tiny_static

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_encode_with_the_packaged_minilm(tmp_path: Path) -> None:
    """Real all-MiniLM-L6-v2 through backend sentence-transformers, as a user would run it."""
    model = packaged_minilm()
    texts = ["how do I sort a list in python", "the cat sat on the mat", "sorting a python list", "a dog on a rug"]
    src = write_pairs(tmp_path / "docs.jsonl", [{"body": t, "doc": 100 + i} for i, t in enumerate(texts)])
    out, ids = tmp_path / "emb.npy", tmp_path / "ids.npy"
    backend = ("--backend", "sentence-transformers", "--path", model, "--model-id", "all-MiniLM-L6-v2")
    fields = ("--field", "body", "--id-field", "doc", "--ids-out", ids)
    run_cli(
        "encode", *backend, "--input", src, *fields, "--out", out, "--device", "cpu", "--threads", 1, "--batch-size", 3
    )
    rows = np.load(out)
    assert rows.shape == (4, 384) and rows.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-5)
    sims = rows @ rows.T
    assert sims[0, 2] > 0.6 and sims[0, 2] > sims[0, 1] + 0.3  # a real model: paraphrases are close
    np.testing.assert_array_equal(np.load(ids), [100, 101, 102, 103])
    meta = json.loads(out.with_suffix(".json").read_text())
    assert (meta["backend"], meta["model_id"], meta["dim"]) == ("sentence-transformers", "all-MiniLM-L6-v2", 384)
    assert meta["fingerprint"] == weights_fingerprint(model)
    # --cpu-bf16 as the service's setting: bfloat16 compute, float32 rows within a cosine of 0.999 of those.
    out16 = tmp_path / "emb16.npy"
    args = ("--input", src, "--field", "body", "--out", out16, "--device", "cpu", "--threads", 1, "--cpu-bf16")
    assert cli("encode", *backend, *args).returncode == 0  # in this process: no second interpreter to start
    rows16 = np.load(out16)
    assert rows16.dtype == np.float32 and ((rows16 * rows).sum(axis=1) > 0.999).all()


@pytest.mark.usefixtures("torch_one_thread")
def test_support_build_with_two_real_models_feeds_fit(tmp_path: Path) -> None:
    """Old: a tiny static model; new: the packaged MiniLM.  fit records both identities with fingerprints."""
    old_dir = tiny_static(tmp_path / "static-old", dim=24)
    words = ["numpy", "arrays", "sorting", "lists", "cats", "dogs", "python", "models", "graphs", "queues"]
    rows: list[dict[str, Any] | str] = [
        {"query": f"{a} and {b}", "target": f"a note about {a} with {b}", "target_id": i * 10 + j}
        for i, a in enumerate(words)
        for j, b in enumerate(words)
    ]
    pairs = read_pairs(write_pairs(tmp_path / "pairs.jsonl", rows), "text", "text", skip_bad=False)
    support = tmp_path / "support"
    models = build_support(
        pairs,
        ModelSource("sentence-transformers", old_dir),
        ModelSource("sentence-transformers", packaged_minilm(), model_id="all-MiniLM-L6-v2"),
        support,
        query_modality="text",
        target_modality="text",
        options=EncodeOptions(device="cpu", batch_size=32, threads=1, progress=False),
    )
    assert models["old"] == {
        "backend": "sentence-transformers",
        "model_id": "static-old",
        "fingerprint": weights_fingerprint(old_dir),
        "dim": 24,
    }
    assert models["new"]["fingerprint"] == weights_fingerprint(packaged_minilm()) and models["new"]["dim"] == 384
    split = load_split(support, require_new_target=True)
    assert (split.old_dim, split.new_dim, len(split.old_query), len(split.old_target)) == (24, 384, 100, 100)
    old_encoder, _ = load_encoder("sentence-transformers", old_dir, device="cpu", threads=1)
    np.testing.assert_allclose(split.old_query[:5], old_encoder.encode([r["query"] for r in rows[:5]]), atol=1e-6)  # type: ignore[index]

    assert cli("fit", support, "--out", tmp_path / "profile", "--folds", 2).returncode == 0
    profile = json.loads((tmp_path / "profile" / "profile.json").read_text())
    assert (profile["old_model_id"], profile["new_model_id"]) == ("static-old", "all-MiniLM-L6-v2")
    assert profile["models"] == {"old": models["old"], "new": models["new"]}
