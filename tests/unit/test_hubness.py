"""The hubness correction: its bias, the re-rank it serves (against a brute-force CSLS), the sidecar's checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.compat.hubness import Hubness, augmented, biases, item_bias, load_hubness, write_hubness
from service.errors import ArtifactError


def unit(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def test_the_bias_is_half_the_mean_cosine_to_the_k_nearest_queries() -> None:
    rng = np.random.default_rng(0)
    items, queries = unit(rng.normal(size=(50, 8))), unit(rng.normal(size=(40, 8)))
    expected = np.sort(items @ queries.T, axis=1)[:, -5:].mean(axis=1) / 2
    assert np.allclose(item_bias(items, queries, k=5), expected, atol=1e-6)
    ids, bias = biases([(np.array([7, 3]), items[:2]), (np.array([5]), items[2:3])], queries, k=5)
    assert ids.tolist() == [3, 5, 7] and np.allclose(bias, expected[[1, 2, 0]], atol=1e-6)


def test_the_served_re_rank_is_csls_over_the_candidates() -> None:
    rng = np.random.default_rng(1)
    items, queries, mapped = (
        unit(rng.normal(size=(200, 16))),
        unit(rng.normal(size=(30, 16))),
        unit(rng.normal(size=(500, 16))),
    )
    bias = item_bias(items, mapped)
    hubness = Hubness(np.arange(200, dtype=np.int64), bias, {})
    scores = queries @ items.T
    order = np.argsort(-scores, axis=1)  # every item a candidate: the re-rank is the whole CSLS ranking
    got_s, got_i = hubness.correct(np.take_along_axis(scores, order, axis=1), order.astype(np.int64), 10)
    csls = 2 * scores - 2 * bias[None, :]  # 2 cos(x, y) - r(y), r(x) dropped (the same for every y)
    assert (got_i == np.argsort(-csls, axis=1, kind="stable")[:, :10]).all()
    assert np.allclose(got_s, np.take_along_axis(scores - bias[None, :], got_i, axis=1), atol=1e-6)
    q, t = augmented(queries, items, bias)  # what `eval` ranks with: the same scores
    assert np.allclose(q @ t.T, scores - bias[None, :], atol=1e-6)


def test_padding_stays_last_and_unknown_ids_take_no_bias() -> None:
    hubness = Hubness(np.array([1, 2], dtype=np.int64), np.array([0.5, 0.0], dtype=np.float32), {})
    scores = np.array([[0.9, 0.8, 0.0]], dtype=np.float32)
    got_s, got_i = hubness.correct(scores, np.array([[1, 9, -1]]), 3)
    assert got_i.tolist() == [[9, 1, -1]] and got_s[0, :2].tolist() == pytest.approx([0.8, 0.4])


def test_a_sidecar_of_another_gallery_or_profile_is_refused_in_one_line(tmp_path: Path) -> None:
    meta = {"gallery_fingerprint": "g" * 64, "profile_id": "p1", "k": 10}
    write_hubness(tmp_path / "hub", np.array([0, 1]), np.array([0.1, 0.2], dtype=np.float32), meta)
    assert load_hubness(tmp_path / "hub", "g" * 64, "p1").of(np.array([1, -1])).tolist() == pytest.approx([0.2, 0])
    with pytest.raises(ArtifactError, match="computed for gallery gggggggggggg"):
        load_hubness(tmp_path / "hub", "h" * 64, "p1")
    with pytest.raises(ArtifactError, match="computed for profile p1, not the served p2"):
        load_hubness(tmp_path / "hub", "g" * 64, "p2")
    (tmp_path / "hub" / "bias.npy").write_bytes(b"tampered")
    with pytest.raises(ArtifactError):
        load_hubness(tmp_path / "hub", "g" * 64, "p1")


def test_the_fit_check_finds_a_planted_hub_helps_and_says_when_it_cannot_tell(tmp_path: Path) -> None:
    from service.compat.fitting import hubness_check
    from service.compat.io import Split

    rng = np.random.default_rng(3)
    n, d = 600, 24
    shared = unit(rng.normal(size=(1, d)))  # a direction every mapped query leans to (anisotropy)
    targets = unit(rng.normal(size=(n, d)))
    queries = unit(targets + 0.6 * rng.normal(size=(n, d)).astype(np.float32) + 0.8 * shared)
    hubs = rng.choice(n, 30, replace=False)
    targets[hubs] = unit(targets[hubs] + 2.0 * shared)  # items leaning the same way: near every query, hubs
    ids = np.arange(n)
    split = Split(tmp_path, queries, queries, targets, None, ids, ids)
    check = hubness_check(queries, targets, split)
    assert check["decided"] and check["recall@1_with"] > check["recall@1_without"] and check["helps"]
    small = Split(tmp_path, queries[:12], queries[:12], targets, None, ids[:12], ids)
    assert not hubness_check(queries[:12], targets, small)["decided"]
