"""Procrustes and interpolation: orthogonality, recovery, padding, SLERP geometry, degenerate pairs, reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from service.compat.interpolation import adaptive_alpha, angle, nlerp, slerp
from service.compat.procrustes import align, fit_rotation, normalize_rows, pad, thin_rotation

SHAPES = [(12, 8), (8, 12), (10, 10)]  # (d_new, d_old): both padding directions and none


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _random_orthogonal(d: int, rng: np.random.Generator) -> np.ndarray:
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return (q * np.sign(np.diag(r))).astype(np.float32)


# -- the paper's reference (000_..., "Implementation"), rewritten here from its formulas --------------


def ref_procrustes(v_new: torch.Tensor, u_old: torch.Tensor) -> torch.Tensor:
    p, _, qt = torch.linalg.svd(v_new.T @ u_old, full_matrices=False)
    return p @ qt


def ref_slerp(u: torch.Tensor, v: torch.Tensor, alpha: float, eps: float = 1e-7) -> torch.Tensor:
    u, v = F.normalize(u, dim=-1), F.normalize(v, dim=-1)
    theta = torch.acos((u * v).sum(-1, keepdim=True).clamp(-1 + eps, 1 - eps))
    q = (torch.sin((1 - alpha) * theta) * u + torch.sin(alpha * theta) * v) / torch.sin(theta)
    return F.normalize(q, dim=-1)


@pytest.mark.parametrize(("d_new", "d_old"), SHAPES)
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7, 1.0])
def test_matches_reference_procrustes_and_slerp(d_new: int, d_old: int, alpha: float) -> None:
    rng = np.random.default_rng(d_new * 100 + d_old)
    n, d = 300, max(d_new, d_old)
    old = normalize_rows(rng.standard_normal((n, d_old)))
    new = normalize_rows(
        np.hstack([old, rng.standard_normal((n, 4))])[:, :d_new] + 0.5 * rng.standard_normal((n, d_new))
    )
    r = fit_rotation(new, old)
    pad_t = lambda x: F.pad(torch.from_numpy(x).double(), (0, d - x.shape[1]))  # noqa: E731
    r_ref = ref_procrustes(pad_t(new), pad_t(old)).numpy()
    # Only the [d_new, d_old] block is determined; the rest is a free orthogonal completion.
    np.testing.assert_allclose(r[:d_new, :d_old], r_ref[:d_new, :d_old], atol=1e-5)
    q_ref = ref_slerp(pad_t(old), pad_t(new) @ torch.from_numpy(r_ref), alpha).numpy()
    q = slerp(pad(old, d), align(new, r, d_old), alpha)
    np.testing.assert_allclose(q[:, :d_old], q_ref[:, :d_old], atol=1e-5)
    # Scores on the padded gallery equal scores on the old coordinates.
    gallery = normalize_rows(rng.standard_normal((50, d_old)))
    np.testing.assert_allclose(q @ pad(gallery, d).T, q[:, :d_old] @ gallery.T, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(SHAPES), st.integers(min_value=0, max_value=2**31 - 1))
def test_rotation_is_orthogonal(shape: tuple[int, int], seed: int) -> None:
    d_new, d_old = shape
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 40))  # also fewer pairs than dims: rank-deficient cross-covariance
    r = fit_rotation(rng.standard_normal((n, d_new)), rng.standard_normal((n, d_old)))
    d = max(shape)
    assert r.shape == (d, d) and r.dtype == np.float32
    np.testing.assert_allclose(r.T @ r, np.eye(d), atol=1e-5)
    np.testing.assert_allclose(r @ r.T, np.eye(d), atol=1e-5)


def test_recovers_known_rotation_equal_dims() -> None:
    rng = np.random.default_rng(0)
    q = _random_orthogonal(16, rng)
    new = rng.standard_normal((200, 16)).astype(np.float32)
    r = fit_rotation(new, new @ q)
    np.testing.assert_allclose(r, q, atol=1e-5)


def test_recovers_known_rotation_into_bigger_old_space() -> None:
    rng = np.random.default_rng(1)
    q = _random_orthogonal(12, rng)
    new = rng.standard_normal((200, 7)).astype(np.float32)
    old = pad(new, 12) @ q  # the new space embeds isometrically in the old one
    r = fit_rotation(new, old)
    np.testing.assert_allclose(r[:7], q[:7], atol=1e-5)
    np.testing.assert_allclose(align(new, r, 12), normalize_rows(old), atol=1e-5)


def test_thin_rotation_handles_rank_deficiency() -> None:
    m = np.zeros((6, 4))
    m[0, 0] = 1.0  # rank 1: the Gram route would divide by zero
    r = thin_rotation(m)
    np.testing.assert_allclose(r.T @ r, np.eye(4), atol=1e-6)
    assert r[0, 0] == pytest.approx(1.0, abs=1e-6)


def test_pad() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = pad(x, 5)
    assert out.shape == (2, 5) and out.dtype == np.float32
    np.testing.assert_array_equal(out[:, :3], x)
    np.testing.assert_array_equal(out[:, 3:], 0)
    assert pad(x, 3).shape == (2, 3)
    with pytest.raises(AssertionError):
        pad(x, 2)


# -- interpolation ----------------------------------------------------------------------------------

rows = arrays(
    np.float32,
    st.tuples(st.integers(1, 6), st.integers(2, 7)),
    elements=st.floats(-10, 10, width=32, allow_nan=False, allow_infinity=False),
).filter(lambda a: bool(np.all(np.linalg.norm(a.astype(np.float64), axis=1) > 1e-3)))


@settings(max_examples=60, deadline=None)
@given(rows, st.data(), st.floats(0, 1))
def test_blends_are_unit_and_finite(u: np.ndarray, data: st.DataObject, alpha: float) -> None:
    noise = data.draw(arrays(np.float32, u.shape, elements=st.floats(-(2**-10), 2**-10, width=32)))
    other = data.draw(rows.filter(lambda a: a.shape == u.shape) | st.just(-u) | st.just(u) | st.just(u + noise))
    if not np.all(np.linalg.norm(other.astype(np.float64), axis=1) > 1e-3):
        other = u
    cos = np.sum(_unit(u.astype(np.float64)) * _unit(other.astype(np.float64)), axis=1)
    adaptive = nlerp(u, other, adaptive_alpha(cos, 0.5, 2.0, 0.3))
    for out in (slerp(u, other, alpha), nlerp(u, other, alpha), adaptive):
        assert out.dtype == np.float32 and out.shape == u.shape
        assert np.isfinite(out).all()
        np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize("case", ["identical", "opposite", "nearly_identical", "nearly_opposite"])
@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.5, 1.0])
def test_degenerate_pairs(case: str, alpha: float) -> None:
    rng = np.random.default_rng(3)
    u = _unit(rng.standard_normal((5, 8))).astype(np.float32)
    eps = 1e-7 * rng.standard_normal((5, 8)).astype(np.float32)
    v = {"identical": u, "opposite": -u, "nearly_identical": u + eps, "nearly_opposite": -u + eps}[case]
    for fn in (slerp, nlerp):
        q = fn(u, v, alpha)
        assert np.isfinite(q).all()
        np.testing.assert_allclose(np.linalg.norm(q, axis=1), 1.0, atol=1e-6)
    q = slerp(u, v, alpha)
    if case.endswith("identical"):
        np.testing.assert_allclose(q, u, atol=1e-5)
    else:
        # Documented rule: travel from u towards -u along a deterministic orthogonal direction.
        np.testing.assert_allclose(np.sum(q * u, axis=1), np.cos(alpha * np.pi), atol=1e-4)
        np.testing.assert_array_equal(q, slerp(u, v, alpha))


def test_opposite_fallback_direction_is_orthogonal() -> None:
    u = _unit(np.random.default_rng(4).standard_normal((4, 6))).astype(np.float32)
    mid = slerp(u, -u, 0.5)
    np.testing.assert_allclose(np.sum(mid * u, axis=1), 0.0, atol=1e-6)
    np.testing.assert_allclose(nlerp(u, -u, 0.5), mid, atol=1e-6)


def test_slerp_endpoints_and_constant_speed() -> None:
    rng = np.random.default_rng(5)
    u = rng.standard_normal((20, 9)).astype(np.float32)
    v = rng.standard_normal((20, 9)).astype(np.float32)
    np.testing.assert_allclose(slerp(u, v, 0.0), _unit(u), atol=1e-6)
    np.testing.assert_allclose(slerp(u, v, 1.0), _unit(v), atol=1e-6)
    theta = angle(u, v)
    for a in np.linspace(0, 1, 11):
        q = slerp(u, v, float(a))
        np.testing.assert_allclose(angle(u, q), a * theta, atol=1e-5)
        np.testing.assert_allclose(angle(q, v), (1 - a) * theta, atol=1e-5)


def test_per_row_alpha_and_nlerp_matches_linear_blend() -> None:
    rng = np.random.default_rng(6)
    u = _unit(rng.standard_normal((4, 5))).astype(np.float32)
    v = _unit(rng.standard_normal((4, 5))).astype(np.float32)
    alphas = np.array([0.0, 0.2, 0.7, 1.0], dtype=np.float32)
    q = slerp(u, v, alphas)
    for i, a in enumerate(alphas):
        np.testing.assert_allclose(q[i], slerp(u[i : i + 1], v[i : i + 1], float(a))[0], atol=1e-6)
    np.testing.assert_allclose(nlerp(u, v, 0.3), _unit(0.7 * u + 0.3 * v), atol=1e-6)


def test_adaptive_alpha_rule() -> None:
    cos = np.array([0.2, 0.5, 0.8, 0.95])
    np.testing.assert_allclose(adaptive_alpha(cos, 0.5, 2.0, 0.5), [0.0, 0.5, 1.0, 1.0])
    np.testing.assert_allclose(adaptive_alpha(cos, 0.4, 0.0, 0.5), 0.4)
