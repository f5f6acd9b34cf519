"""Property tests of the served Procrustes heads (heads.transform): no NaN on any finite non-zero input.

Hypothesis draws an orthogonal R (random, or the identity), both padding directions (d_old < d_new and
d_old > d_new) and pairs that are generic, within a hair of theta = 0 or theta = pi (exactly, inside
the 1e-3 fallback band, or just outside it), or mapped wholly past the old coordinates.  Every mode
must return finite unit rows [n, d_old]; alpha 0 must give the old query; a SLERP path near pi must
turn through the old coordinates (no jump from u to -u).  The reproductions from issue 12 come first.
NOBACKFILL_BLEND_EXAMPLES=N scales the example counts (the long run in docs/reliability.md).
"""

from __future__ import annotations

import os

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.compat.heads import transform
from service.compat.interpolation import slerp
from service.compat.procrustes import pad
from service.compat.profile import CompatProfile
from service.rows import normalize_rows

F32 = npt.NDArray[np.float32]
MODES = ("old", "aligned", "slerp", "nlerp", "adaptive")
EXAMPLES = int(os.environ.get("NOBACKFILL_BLEND_EXAMPLES", "150"))


def _profile(
    r: npt.NDArray[np.floating], d_old: int, d_new: int, alpha: float = 0.5, **adaptive: float
) -> CompatProfile:
    params = {"slerp": {"alpha": alpha}, "nlerp": {"alpha": alpha}, "adaptive": {"a": 0.5, "b": 1.0, "c_ref": 0.0}}
    params["adaptive"].update(adaptive)
    return CompatProfile(
        "slerp", "o", "n", d_old, d_new, {"text": alpha}, {"text": params}, "both", 2, {}, {"R": r.astype(np.float32)}
    )


def _orthogonal(d: int, rng: np.random.Generator) -> F32:
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return (q * np.sign(np.diag(r))).astype(np.float32)


def _check_rows(q: F32, n: int, d_old: int) -> None:
    assert q.shape == (n, d_old) and q.dtype == np.float32
    assert np.isfinite(q).all()
    np.testing.assert_allclose(np.linalg.norm(q.astype(np.float64), axis=1), 1.0, atol=1e-5)


# -- the reproductions from issue 12 ---------------------------------------------------------------


def test_identity_r_with_wider_new_space_gives_no_nan() -> None:
    # v = pad(new) I has nothing in the first d_old coordinates: `aligned` and alpha = 1 used to be NaN.
    prof = _profile(np.eye(6), 4, 6, alpha=1.0)
    old = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    new = np.array([[0, 0, 0, 0, 1.0, 1.0]], np.float32)
    u = normalize_rows(old)
    for mode in ("aligned", "nlerp", "slerp"):
        q = transform(prof, mode, old, new, "text").queries
        np.testing.assert_allclose(q, u, atol=1e-6)  # documented rule: the old query stands in
    np.testing.assert_array_equal(transform(prof, "aligned", None, new, "text").queries, [[1, 0, 0, 0]])


@pytest.mark.parametrize(("d_old", "d_new"), [(4, 6), (6, 4), (5, 5)])
def test_opposite_pair_turns_through_the_old_space(d_old: int, d_new: int) -> None:
    # v = -u exactly: alpha 0.5 used to jump from u to -u (NaN at 0.5) when padding was present.
    d = max(d_old, d_new)
    rng = np.random.default_rng(0)
    r = _orthogonal(d, rng)
    if d_new >= d_old:
        old = rng.standard_normal((3, d_old)).astype(np.float32)
        new = (-pad(old, d) @ r.T)[:, :d_new]
    else:
        new = rng.standard_normal((3, d_new)).astype(np.float32)
        old = -(pad(new, d) @ r)
    prof = _profile(r, d_old, d_new)
    u = normalize_rows(old).astype(np.float64)
    for alpha in (0.25, 0.5, 0.75):
        q = transform(prof, "slerp", old, new, "text", alpha=alpha).queries
        np.testing.assert_allclose(np.sum(q * u, axis=1), np.cos(alpha * np.pi), atol=2e-3)


def test_padded_antipodal_fallback_axis_stays_in_the_leading_block() -> None:
    u = normalize_rows(np.random.default_rng(1).standard_normal((4, 5)))
    up = pad(u, 8)
    for alpha in np.linspace(0, 1, 9):
        q = slerp(up, -up, float(alpha), axes=5)
        np.testing.assert_array_equal(q[:, 5:], 0.0)
        np.testing.assert_allclose(np.sum(q[:, :5] * u, axis=1), np.cos(alpha * np.pi), atol=1e-6)


# -- properties -------------------------------------------------------------------------------------

CASES = ("generic", "near_zero", "exact_zero", "near_pi", "band_pi", "exact_pi", "lost")


def _pair(case: str, d_old: int, d_new: int, r: F32, n: int, eps: float, rng: np.random.Generator) -> tuple[F32, F32]:
    """Old and new rows [n, d_old], [n, d_new] whose padded angle under R is what `case` says."""
    d = max(d_old, d_new)
    old = rng.standard_normal((n, d_old))
    new = rng.standard_normal((n, d_new))
    sign = {"near_zero": 1.0, "exact_zero": 1.0, "near_pi": -1.0, "band_pi": -1.0, "exact_pi": -1.0}.get(case)
    noise = {"near_zero": eps, "near_pi": eps, "band_pi": min(eps, 1e-5)}.get(case, 0.0)
    # The noise is relative to the row's length: a short row with absolute noise would not be "near" at all.
    if sign is not None and d_new >= d_old:  # every padded v is reachable: pick new so that v = +-u
        base = sign * (pad(old, d) @ r.T)[:, :d_new]
        new = base + noise * np.linalg.norm(base, axis=1, keepdims=True) * rng.standard_normal((n, d_new))
    elif sign is not None:  # v spans a d_new-dim subspace of the old space: pick u = +-v
        base = sign * (pad(new, d) @ r)
        old = base + noise * np.linalg.norm(base, axis=1, keepdims=True) * rng.standard_normal((n, d_old))
    elif case == "lost" and d_new > d_old:  # v wholly past the old coordinates
        v = np.hstack([np.zeros((n, d_old)), rng.standard_normal((n, d - d_old))])
        new = v @ r.T
    scale = 10.0 ** rng.uniform(-3, 3, size=(n, 1))  # any finite non-zero length
    return (old * scale).astype(np.float32), (new / scale).astype(np.float32)


dims = st.tuples(st.integers(2, 9), st.integers(2, 9))


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    dims,
    st.sampled_from(CASES),
    st.sampled_from(["random", "identity"]),
    st.integers(0, 2**32 - 1),
    st.floats(0, 1),
    st.floats(1e-9, 1e-2),
    st.tuples(st.floats(0, 1), st.floats(-5, 5), st.floats(-1, 1)),
)
def test_every_mode_gives_finite_unit_old_space_rows(
    dims: tuple[int, int],
    case: str,
    kind: str,
    seed: int,
    alpha: float,
    eps: float,
    adaptive: tuple[float, float, float],
) -> None:
    d_old, d_new = dims
    rng = np.random.default_rng(seed)
    d = max(d_old, d_new)
    r = _orthogonal(d, rng) if kind == "random" else np.eye(d, dtype=np.float32)
    n = 4
    old, new = _pair(case, d_old, d_new, r, n, eps, rng)
    a, b, c_ref = adaptive
    prof = _profile(r, d_old, d_new, alpha, a=a, b=b, c_ref=c_ref)
    u = normalize_rows(old)
    for mode in MODES:
        out = transform(prof, mode, old, None if mode == "old" else new, "text")
        _check_rows(out.queries, n, d_old)
        assert np.isfinite(out.theta).all() and np.all((out.theta >= 0) & (out.theta <= np.pi + 1e-6))
    # alpha = 0 is the old system, whatever the pair.
    still = _profile(r, d_old, d_new, a=0.0, b=0.0)
    for mode in ("slerp", "nlerp", "adaptive"):
        q = transform(still, mode, old, new, "text", alpha=None if mode == "adaptive" else 0.0).queries
        np.testing.assert_allclose(q, u, atol=1e-6)
    if case == "lost" and d_new > d_old:  # v has no direction in the gallery's space: u stands in
        np.testing.assert_allclose(transform(prof, "aligned", old, new, "text").queries, u, atol=1e-6)


@settings(max_examples=max(1, EXAMPLES // 2), deadline=None)
@given(dims, st.sampled_from(["exact_pi", "band_pi", "near_pi"]), st.integers(0, 2**32 - 1), st.floats(1e-9, 1e-2))
def test_slerp_near_pi_is_continuous_in_alpha(dims: tuple[int, int], case: str, seed: int, eps: float) -> None:
    # Near pi the arc from u to -u must turn through the old coordinates: consecutive alphas move the
    # query by at most the arc step, and u . q falls steadily from 1 to -1 (no jump from u to -u).
    # Just outside the fallback band with padding (d_new > d_old), v's padding is real and the padded
    # arc may truly leave the old coordinates, so that combination is not claimed.
    d_old, d_new = dims
    if case == "near_pi" and d_new > d_old:
        case = "band_pi"
    rng = np.random.default_rng(seed)
    r = _orthogonal(max(d_old, d_new), rng)
    old, new = _pair(case, d_old, d_new, r, 3, eps, rng)
    prof = _profile(r, d_old, d_new)
    u = normalize_rows(old).astype(np.float64)
    grid = np.linspace(0, 1, 41)
    path = np.stack([transform(prof, "slerp", old, new, "text", alpha=float(a)).queries for a in grid]).astype(
        np.float64
    )
    steps = np.arccos(np.clip(np.sum(path[1:] * path[:-1], axis=2), -1, 1))
    assert steps.max() <= np.pi * (grid[1] - grid[0]) * 1.05 + 1e-3
    along = np.sum(path * u[None], axis=2)
    assert np.all(np.diff(along, axis=0) <= 1e-4)
    np.testing.assert_allclose(along[0], 1.0, atol=1e-5)
    assert np.all(along[-1] < -0.99)
