"""`gallery build --features psp|lsp` turns a classifier's old-model logits into a PSP/LSP gallery."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from service.compat.psp import gallery_features
from service.index.gallery import Gallery
from tests.support.cli import run_cli


def test_psp_gallery_from_logits_matches_the_features(tmp_path: Path) -> None:
    logits = np.random.default_rng(0).normal(size=(2000, 10)).astype(np.float32) * 3
    np.save(tmp_path / "logits.npy", logits)
    out = tmp_path / "psp-gallery"
    args = ("--from-npy", tmp_path / "logits.npy", "--features", "psp", "--nlist", 4, "--pq-m", 5)
    run_cli("gallery", "build", "--out", out, *args)
    gallery = Gallery.load(out)
    assert gallery.dim == 10 and gallery.ntotal == 2000
    features = gallery_features(logits, "psp")
    _, ids = gallery.search(features[:50], 1, 4)
    # Softmax saturates, so rows have near-twins: check the row found is as good as the exact best.
    found = np.einsum("ij,ij->i", features[:50], features[ids[:, 0]])
    assert found.mean() > 0.97 and found.min() > 0.85
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logits.npy", "psp-gallery"]  # no temp file left


def test_nan_logits_are_refused_and_leave_nothing(tmp_path: Path) -> None:
    logits = np.ones((500, 10), dtype=np.float32)
    logits[7, 3] = np.nan
    np.save(tmp_path / "logits.npy", logits)
    done = run_cli(
        "gallery",
        "build",
        "--out",
        tmp_path / "g",
        "--from-npy",
        tmp_path / "logits.npy",
        "--features",
        "lsp",
        check=False,
    )
    assert done.returncode == 2
    assert "NaN" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logits.npy"]
