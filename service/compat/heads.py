"""The query transform every caller shares (HTTP service and `nobackfill eval`), so results are identical.

transform() computes u = normalise(pad(old)), v = normalise(pad(new) @ R), blends them in the padded
space (as the paper does: the angle theta counts every coordinate of v), then keeps the first d_old
coordinates and renormalises.  The dropped coordinates meet only zeros in the padded gallery, so
inner-product ranking on the old gallery is exactly the padded ranking.  Past d_old, v matters only
through its norm, so procrustes_blend.py computes the same blends from the [d_new, d_old] block of R alone.

Modes: `old` (u), `aligned` (v), `slerp`, `nlerp` (the profile's alpha for the query modality, or an
explicit alpha), `adaptive` (per-query alpha = clip(a + b (cos - c_ref), 0, 1); an explicit alpha
replaces the base a).  An explicit alpha is refused for `old` and `aligned`, whose weight is fixed.

Heads without R (see profile.py for which profile serves what):
- `adapter`: v = h(new), the MKP adapter's unit output in the old space; needs only the new query.
- `adapter+slerp`: SLERP(u, h(new); alpha) in the old space itself (no padding: h already outputs
  d_old coordinates), alpha cross-fitted per modality like the slerp head, or explicit.
- `psp` / `lsp`: the new query is the new model's LOGITS [n, C_t]; psp.query_features turns them
  into unit rows [n, C_k] comparable with the old model's PSP / LSP gallery features.  Logits are
  read as given: PSP's softmax depends on their scale, so they must not be normalised beforehand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from service.compat import procrustes_blend, psp
from service.compat.interpolation import adaptive_alpha, geometry, slerp_on
from service.compat.profile import CompatProfile
from service.errors import InputError, UnsupportedMode
from service.rows import normalize_rows
from service.vocabulary import ALPHA_MODES, HeadFamily, Mode

Array = npt.NDArray[np.float32]
# transform_in_chunks' rows per call: the blends' float64 temporaries stay ~100 MB at d = 768.
CHUNK_ROWS = 16384


@dataclass(frozen=True)
class Transformed:
    """Queries ready for the old gallery, with the angle between endpoints and the weight used."""

    queries: Array  # [n, d_old], unit rows
    theta: Array  # [n] radians between u and v (0 where one endpoint is absent)
    alpha: float  # the weight on v; for `adaptive` the mean of the per-query weights
    row_alpha: Array  # [n] per-query weight on v


def _check_rows(x: npt.NDArray[np.floating] | None, dim: int, name: str, needed: bool, mode: str) -> Array | None:
    """Validate one side of the input: shape, finiteness, no zero rows."""
    if x is None:
        if needed:
            raise InputError(f"mode {mode!r} needs the {name} query embeddings")
        return None
    arr = np.asarray(x, dtype=np.float32)
    if arr.ndim != 2 or arr.shape[1] != dim:
        raise InputError(f"{name} embeddings have shape {arr.shape}, expected [n, {dim}]")
    if len(arr):
        # One pass over the rows for the common case (a NaN / inf makes its row's norm non-finite);
        # the detailed checks run only to word the error.
        norms2 = np.einsum("ij,ij->i", arr, arr)
        if not (norms2.min() > 0 and norms2.max() < math.inf):
            if not np.isfinite(arr).all():
                raise InputError(f"{name} embeddings contain NaN/inf")
            if not np.any(arr != 0, axis=1).all():
                raise InputError(f"{name} embeddings contain an all-zero row")
            raise InputError(f"{name} embeddings have values too large to normalise in float32")
    return arr


def _mode_params(profile: CompatProfile, mode: str, modality: str) -> dict[str, float]:
    """The fitted parameters of a blend mode for a query modality."""
    try:
        return profile.params[modality][mode]
    except KeyError:
        fitted = ", ".join(sorted(profile.params)) or "none"
        raise UnsupportedMode(
            f"profile {profile.profile_id} has no {mode} weight for {modality!r} queries (fitted: {fitted}); "
            "pass an explicit alpha"
        ) from None


def transform(
    profile: CompatProfile,
    mode: str,
    old: npt.NDArray[np.floating] | None,
    new: npt.NDArray[np.floating] | None,
    modality: str,
    alpha: float | None = None,
) -> Transformed:
    """Turn old / new query embeddings into unit queries [n, d_old] for the old gallery."""
    if mode not in profile.modes():
        served = ", ".join(profile.modes())
        raise UnsupportedMode(f"unknown mode {mode!r}; profile {profile.profile_id} serves {served}")
    if alpha is not None:
        if mode not in ALPHA_MODES:
            raise InputError(f"an explicit alpha applies to {', '.join(ALPHA_MODES)}, not to mode {mode!r}")
        if not (math.isfinite(alpha) and 0.0 <= alpha <= 1.0):
            raise InputError(f"alpha must be within [0, 1], got {alpha}")
    reads = Mode(mode)
    u_raw = _check_rows(old, profile.old_dim, "old", needed=reads.reads_old, mode=mode)
    v_raw = _check_rows(new, profile.new_dim, "new", needed=reads.reads_new, mode=mode)
    if u_raw is not None and v_raw is not None and len(u_raw) != len(v_raw):
        raise InputError(f"{len(u_raw)} old rows but {len(v_raw)} new rows")
    if profile.family is HeadFamily.classes:
        assert v_raw is not None
        return _class_head(profile, mode, v_raw)
    if profile.family is HeadFamily.adapter:
        return _adapter_head(profile, mode, u_raw, v_raw, modality, alpha)
    return _rotation_head(profile, mode, u_raw, v_raw, modality, alpha)


def transform_in_chunks(
    profile: CompatProfile,
    mode: str,
    old: npt.NDArray[np.floating] | None,
    new: npt.NDArray[np.floating] | None,
    modality: str,
    alpha: float | None = None,
    chunk: int = CHUNK_ROWS,
) -> Transformed:
    """transform() over chunks of rows, joined: the same result, with the blends' temporaries bounded on big sets.

    For `adaptive` the joined alpha is the mean of every row's weight (in float64).
    """
    n = len(old) if old is not None else len(new) if new is not None else 0
    parts = [
        transform(profile, mode, _rows(old, s, chunk), _rows(new, s, chunk), modality, alpha)
        for s in range(0, max(n, 1), chunk)
    ]
    row_alpha = np.concatenate([p.row_alpha for p in parts])
    return Transformed(
        queries=np.concatenate([p.queries for p in parts]),
        theta=np.concatenate([p.theta for p in parts]),
        alpha=float(row_alpha.astype(np.float64).mean()) if mode == "adaptive" else parts[0].alpha,
        row_alpha=row_alpha,
    )


def _rows(x: npt.NDArray[np.floating] | None, start: int, chunk: int) -> npt.NDArray[np.floating] | None:
    """Rows start..start+chunk of x (None stays None)."""
    return None if x is None else x[start : start + chunk]


def _rotation_head(
    profile: CompatProfile, mode: str, u_raw: Array | None, v_raw: Array | None, modality: str, alpha: float | None
) -> Transformed:
    """old, aligned, slerp, nlerp and adaptive of a Procrustes profile (see procrustes_blend.py)."""
    padded = profile.dim > profile.old_dim
    pair = None
    if u_raw is not None and v_raw is not None:
        pair = procrustes_blend.Pair.of(u_raw, v_raw, profile.rotation_block, padded)
    n = len(u_raw) if u_raw is not None else len(v_raw) if v_raw is not None else 0
    theta = pair.theta.astype(np.float32) if pair is not None else np.zeros(n, np.float32)
    if mode == "old":
        assert u_raw is not None
        return Transformed(normalize_rows(u_raw), theta, 0.0, np.zeros(n, np.float32))
    if mode == "aligned":
        assert v_raw is not None
        q = pair.aligned() if pair is not None else procrustes_blend.aligned(v_raw, profile.rotation_block)
        return Transformed(q, theta, 1.0, np.ones(n, np.float32))
    assert pair is not None
    if mode == "adaptive":
        params = _mode_params(profile, mode, modality)
        a = alpha if alpha is not None else params["a"]
        row_alpha = adaptive_alpha(pair.cos, a, params["b"], params["c_ref"])
        used = float(row_alpha.astype(np.float64).mean()) if n else float(a)
        return Transformed(pair.nlerp(row_alpha.astype(np.float64)), theta, used, row_alpha)
    used = float(alpha) if alpha is not None else _mode_params(profile, mode, modality)["alpha"]
    q = pair.slerp(used) if mode == "slerp" else pair.nlerp(np.full(n, used))
    return Transformed(q, theta, used, np.full(n, used, np.float32))


def _class_head(profile: CompatProfile, mode: str, logits: Array) -> Transformed:
    """psp / lsp: new-model logits [n, C_t] -> unit old-class features [n, C_k] (zero rows stay zero)."""
    head: psp.ClassSpace = "psp" if mode == "psp" else "lsp"
    try:
        q = psp.query_features(logits, profile.old_classes, head, profile.top_k, profile.class_map)
    except ValueError as exc:  # class counts were checked at load; this is a caller's problem
        raise InputError(f"mode {mode!r}: {exc}") from exc
    n = len(q)
    return Transformed(queries=q, theta=np.zeros(n, np.float32), alpha=1.0, row_alpha=np.ones(n, np.float32))


def _adapter_head(
    profile: CompatProfile, mode: str, u_raw: Array | None, v_raw: Array | None, modality: str, alpha: float | None
) -> Transformed:
    """old, adapter and adapter+slerp of an adapter profile, all in the old space (no padding)."""
    n = len(u_raw) if u_raw is not None else len(v_raw) if v_raw is not None else 0
    zeros = np.zeros(n, np.float32)
    if mode == "old":
        assert u_raw is not None
        return Transformed(queries=normalize_rows(u_raw), theta=zeros, alpha=0.0, row_alpha=zeros)
    assert v_raw is not None
    v = profile.adapter_model.apply(v_raw)
    if mode == "adapter":
        return Transformed(queries=v, theta=zeros, alpha=1.0, row_alpha=np.ones(n, np.float32))
    assert u_raw is not None
    u = normalize_rows(u_raw)
    used = float(alpha) if alpha is not None else _mode_params(profile, mode, modality)["alpha"]
    g = geometry(u, v)
    q = normalize_rows(slerp_on(g, used))
    return Transformed(queries=q, theta=g.theta.astype(np.float32), alpha=used, row_alpha=np.full(n, used, np.float32))
