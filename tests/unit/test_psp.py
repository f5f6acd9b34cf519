"""PSP / LSP heads: the centred simplex, the P_tk correction, top-k sparsification, shapes and finiteness."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from service.compat.psp import (
    centering_matrix,
    correction_matrix,
    gallery_features,
    lsp_features,
    prototype_rotation,
    prototypes,
    psp_features,
    query_features,
    softmax,
    top_k_rows,
)

FAST = settings(max_examples=40, deadline=None)


@FAST
@given(st.integers(min_value=2, max_value=64))
def test_centering_matrix_is_the_projection_onto_the_sum_zero_plane(c: int) -> None:
    p = centering_matrix(c)
    assert np.allclose(p, p.T)
    assert np.allclose(p @ p, p)
    assert np.allclose(p @ np.ones(c), 0.0)
    assert np.linalg.matrix_rank(p) == c - 1


@FAST
@given(st.integers(min_value=2, max_value=64))
def test_prototypes_form_a_regular_simplex_centred_at_the_origin(c: int) -> None:
    v = prototypes(c).astype(np.float64)
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-6)
    assert np.allclose(v.sum(axis=0), 0.0, atol=1e-6)
    cos = v @ v.T
    off = cos[~np.eye(c, dtype=bool)]
    # Every pair sits at arccos(-1 / (C - 1)), past pi/2 for C > 2.
    assert np.allclose(off, -1.0 / (c - 1), atol=1e-6)
    assert np.allclose(np.arccos(np.clip(off, -1, 1)), math.acos(-1.0 / (c - 1)), atol=1e-3)


def test_psp_of_a_confident_output_is_its_class_prototype() -> None:
    c = 7
    logits = 60.0 * np.eye(c)  # softmax ~ one-hot
    assert np.allclose(psp_features(logits), prototypes(c), atol=1e-6)


@FAST
@given(st.integers(min_value=2, max_value=20), st.integers(min_value=1, max_value=20))
def test_p_tk_maps_every_updated_prototype_onto_its_old_counterpart(c_old: int, extra: int) -> None:
    c_new = c_old + extra
    p_tk = correction_matrix(c_old, c_new)
    assert p_tk.shape == (c_old, c_new)
    updated = centering_matrix(c_new)[:, :c_old].T  # rows: P_tt e_c for the old classes c
    mapped = updated @ p_tk.T
    mapped /= np.linalg.norm(mapped, axis=1, keepdims=True)
    assert np.allclose(mapped, prototypes(c_old), atol=1e-6)
    # Without the correction the old prototype is off by the angle the paper predicts (Eq. 6).
    old_padded = np.zeros((c_old, c_new))
    old_padded[:, :c_old] = prototypes(c_old)
    cos = np.sum(old_padded * (updated / np.linalg.norm(updated, axis=1, keepdims=True)), axis=1)
    assert np.allclose(np.arccos(np.clip(cos, -1, 1)), prototype_rotation(c_old, c_new), atol=1e-6)


def test_prototype_rotation_matches_the_papers_examples() -> None:
    assert math.degrees(prototype_rotation(2, 3)) == pytest.approx(30.0, abs=1e-9)
    assert math.degrees(prototype_rotation(5, 10)) == pytest.approx(19.47, abs=0.01)
    assert prototype_rotation(4, 4) == 0.0


def test_corrected_queries_equal_the_matrix_form_and_ignore_the_new_centring() -> None:
    rng = np.random.default_rng(0)
    z = rng.normal(scale=3.0, size=(50, 10))
    via_matrix = softmax(z) @ correction_matrix(5, 10).T
    via_matrix /= np.linalg.norm(via_matrix, axis=1, keepdims=True)
    got = query_features(z, 5, "psp")  # 10 new classes over 5 old: through P_tk
    assert np.allclose(got, via_matrix, atol=1e-6)
    # P_tk after P_tt is the same map: the old-class re-centring cancels the new centring.
    p = softmax(z) @ centering_matrix(10)
    again = p @ correction_matrix(5, 10).T
    assert np.allclose(again / np.linalg.norm(again, axis=1, keepdims=True), via_matrix, atol=1e-9)
    # A confident new-model output of an old class lands on the old prototype.
    confident = 60.0 * np.eye(10)[:5]
    assert np.allclose(query_features(confident, 5, "psp"), prototypes(5), atol=1e-6)


def test_lsp_follows_the_papers_definition() -> None:
    z = np.array([[2.0, 1.0, 1.0], [0.0, 0.0, 3.0]])
    # LSP is the normalised logit vector itself: no centring.
    assert np.allclose(lsp_features(z), z / np.linalg.norm(z, axis=1, keepdims=True), atol=1e-7)
    assert np.allclose(gallery_features(z, "lsp"), lsp_features(z))
    # With added classes the new logits go through P_tk: old-class columns, centred.
    z_new = np.array([[2.0, 1.0, 1.0, 9.0]])
    v = z_new[:, :3] - z_new[:, :3].mean()
    assert np.allclose(query_features(z_new, 3, "lsp"), v / np.linalg.norm(v), atol=1e-7)


def test_same_label_set_needs_no_correction() -> None:
    rng = np.random.default_rng(1)
    z = rng.normal(size=(20, 6))
    assert np.array_equal(query_features(z, 6, "psp"), psp_features(z))
    assert np.array_equal(query_features(z, 6, "lsp"), lsp_features(z))


def test_class_map_undoes_a_known_reordering() -> None:
    rng = np.random.default_rng(2)
    z = rng.normal(size=(30, 8))
    perm = rng.permutation(8)
    shuffled = np.empty_like(z)
    shuffled[:, perm] = z  # old class c is output perm[c] of the shuffled model
    for mode in ("psp", "lsp"):
        want = query_features(z, 5, mode)
        got = query_features(shuffled, 5, mode, class_map=perm[:5].tolist())
        assert np.allclose(got, want, atol=1e-6)


@FAST
@given(
    hnp.arrays(np.float64, st.tuples(st.integers(1, 8), st.integers(3, 12)), elements=st.floats(-30, 30)),
    st.integers(min_value=1, max_value=12),
)
def test_top_k_keeps_unit_norm_and_at_most_k_entries(z: np.ndarray, k: int) -> None:
    kept = top_k_rows(softmax(z), k)
    assert np.all((kept > 0).sum(axis=1) <= k)
    for mode in ("psp", "lsp"):
        feats = gallery_features(z, mode, top_k=k)
        norms = np.linalg.norm(feats, axis=1)
        assert np.all(np.isfinite(feats))
        # Unit rows, except a row with nothing left after centring / an all-zero logit row.
        assert np.all((np.abs(norms - 1.0) < 1e-5) | (norms == 0.0))


def test_top_k_on_psp_keeps_the_top_class_and_its_norm() -> None:
    rng = np.random.default_rng(3)
    z = rng.normal(scale=4.0, size=(100, 20))
    full, sparse = psp_features(z), psp_features(z, top_k=3)
    assert np.allclose(np.linalg.norm(sparse, axis=1), 1.0, atol=1e-6)
    assert np.array_equal(full.argmax(axis=1), sparse.argmax(axis=1))
    # Ties are broken toward the lowest index, so the kept set is deterministic.
    assert np.array_equal(top_k_rows(np.array([[1.0, 1.0, 1.0]]), 2), np.array([[1.0, 1.0, 0.0]]))


@FAST
@given(
    hnp.arrays(
        np.float64,
        st.tuples(st.integers(1, 6), st.integers(6, 12)),
        elements=st.floats(-1e4, 1e4) | st.just(0.0),
    ),
    st.sampled_from(["psp", "lsp"]),
)
def test_shapes_and_no_nan_even_for_extreme_or_degenerate_logits(z: np.ndarray, mode: str) -> None:
    q = query_features(z, 5, mode)  # type: ignore[arg-type]
    g = gallery_features(z[:, :5], mode)  # type: ignore[arg-type]
    assert q.shape == (len(z), 5) and g.shape == (len(z), 5)
    assert q.dtype == np.float32 and g.dtype == np.float32
    assert np.all(np.isfinite(q)) and np.all(np.isfinite(g))


def test_uniform_softmax_gives_a_zero_row_not_nan() -> None:
    out = psp_features(np.zeros((2, 4)))
    assert np.array_equal(out, np.zeros((2, 4), dtype=np.float32))


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        query_features(np.zeros((1, 3)), 5)  # the new model has fewer classes
    with pytest.raises(ValueError):
        query_features(np.zeros((1, 6)), 5, "cosine")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        query_features(np.zeros((1, 6)), 3, class_map=[0, 0, 1])
    with pytest.raises(ValueError):
        centering_matrix(1)
    with pytest.raises(ValueError):
        top_k_rows(np.ones((1, 3)), 0)
