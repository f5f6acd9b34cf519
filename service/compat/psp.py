"""PSP / LSP heads (001_...): backward-compatible features from the outputs of classifier-trained encoders.

A model trained with softmax cross-entropy on one-hot labels pushes its softmax outputs toward the
vertices e_c of the probability simplex, which depend on the label set only, not on the model.
- PSP: h = normalise(P_kk softmax(z)), with the centring matrix P_kk = I - 11^T / C.  Centring moves
  the simplex to the origin; its vertices v_c = e_c - 1/C become a regular simplex whose prototypes
  are pairwise at arccos(-1 / (C - 1)) > pi/2, the same for every model trained on those C classes.
- LSP: h = normalise(z), the logits themselves.  The paper does not centre them: under its
  unconstrained-features analysis the logits already point along the centred prototypes.
- An update that adds classes (C_t > C_k) moves the simplex centre and rotates every old prototype
  (by arccos(sqrt((C_k - 1) / C_k * C_t / (C_t - 1))), 19.5 degrees for 5 -> 10).  The data-free
  correction P_tk = [P_kk | 0] (C_k x C_t) keeps the old classes' coordinates of a new-model vector,
  drops the new classes' ones and re-centres over the old classes; it maps every updated prototype
  e_c - 1/C_t exactly onto its old counterpart e_c - 1/C_k.  New-model queries go through P_tk (in
  place of P_tt for PSP; on top of the raw logits for LSP), the old gallery is untouched.
- Top-k: softmax preserves the order of the logits, so zeroing all but the k largest entries of
  each row (before centring) keeps the gallery sparse while keeping what ranks; for LSP the same
  is done on the logits.
Old class c must be output `class_map[c]` of the new model (identity by default): the label-to-index
mapping has to survive the update, and a known reordering is undone by this map.

All functions are numpy, vectorised over rows, compute in float64 and return float32; zero rows (e.g.
an exactly uniform softmax, which centring sends to 0) come back as zero rows, never NaN.
Errors: ValueError for inconsistent class counts or modes; AssertionError for malformed shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from service.rows import F32, F64, normalize_rows

# Which class space a query and the gallery meet in: probabilities (psp) or logits (lsp); not vocabulary.Mode.
ClassSpace = Literal["psp", "lsp"]
MODES: tuple[ClassSpace, ...] = ("psp", "lsp")
_EPS = 1e-12  # below this a centred row is rounding noise (e.g. a uniform softmax)


def centering_matrix(c: int) -> F64:
    """P_kk = I - 11^T / C (C x C): the orthogonal projection onto the sum-zero hyperplane."""
    if c < 2:
        raise ValueError(f"a simplex needs at least two classes, got {c}")
    out: F64 = np.eye(c) - np.full((c, c), 1.0 / c)
    return out


def correction_matrix(c_old: int, c_new: int, class_map: Sequence[int] | None = None) -> F64:
    """P_tk (C_k x C_t): pick the old classes' outputs of the new model, then centre them with P_kk."""
    cols = _class_columns(c_old, c_new, class_map)
    select = np.zeros((c_old, c_new))
    select[np.arange(c_old), cols] = 1.0
    out: F64 = centering_matrix(c_old) @ select
    return out


def prototypes(c: int) -> F32:
    """Unit class prototypes normalise(P_kk e_c) as rows [C, C]: a regular simplex centred at 0."""
    return _unit(centering_matrix(c))


def prototype_rotation(c_old: int, c_new: int) -> float:
    """Angle (radians) an old prototype turns through when the label set grows from C_k to C_t classes."""
    if not 2 <= c_old <= c_new:
        raise ValueError(f"need 2 <= C_k <= C_t, got {c_old}, {c_new}")
    return float(np.arccos(np.sqrt((c_old - 1) / c_old * c_new / (c_new - 1))))


def softmax(logits: npt.NDArray[np.floating]) -> F64:
    """Row-wise softmax in float64 (max-shifted, so large logits do not overflow)."""
    z = _rows(logits)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    out: F64 = e / e.sum(axis=1, keepdims=True)
    return out


def top_k_rows(x: npt.NDArray[np.floating], k: int | None) -> F64:
    """Keep the k largest entries of each row, zero the others (ties: the lowest index wins); None = all."""
    a = _rows(x)
    if k is None or k >= a.shape[1]:
        return a
    if k < 1:
        raise ValueError(f"top_k must be >= 1, got {k}")
    # A stable descending order makes the kept set deterministic under ties.
    keep = np.argsort(-a, axis=1, kind="stable")[:, :k]
    out = np.zeros_like(a)
    np.put_along_axis(out, keep, np.take_along_axis(a, keep, axis=1), axis=1)
    return out


def psp_features(logits: npt.NDArray[np.floating], top_k: int | None = None) -> F32:
    """PSP of a model's own logits [n, C]: normalise(P_kk top_k(softmax(z))), unit rows [n, C]."""
    p = top_k_rows(softmax(logits), top_k)
    # P_kk p = p - mean(p) 1; subtracting the row mean avoids building the C x C matrix.
    return _unit(p - p.mean(axis=1, keepdims=True))


def lsp_features(logits: npt.NDArray[np.floating], top_k: int | None = None) -> F32:
    """LSP of a model's own logits [n, C]: normalise(top_k(z)), not centred (001_..., LSP definition)."""
    return _unit(top_k_rows(logits, top_k))


def query_features(
    new_logits: npt.NDArray[np.floating],
    old_classes: int,
    mode: ClassSpace = "psp",
    top_k: int | None = None,
    class_map: Sequence[int] | None = None,
) -> F32:
    """Queries for an old PSP / LSP gallery of C_k classes from new-model logits [n, C_t]: unit rows [n, C_k].

    Same label set (C_t == C_k, identity map): the plain PSP / LSP features.  More classes (or a class_map):
    P_tk, on the top-k softmax for PSP and on the logits for LSP.
    """
    mode = _check_mode(mode)
    c_new = _rows(new_logits).shape[1]
    if c_new == old_classes and class_map is None:
        return psp_features(new_logits, top_k) if mode == "psp" else lsp_features(new_logits, top_k)
    cols = _class_columns(old_classes, c_new, class_map)
    v = top_k_rows(softmax(new_logits) if mode == "psp" else new_logits, top_k)[:, cols]
    # P_tk v = P_kk (old-class columns of v): centre over the old classes only.
    return _unit(v - v.mean(axis=1, keepdims=True))


def gallery_features(old_logits: npt.NDArray[np.floating], mode: ClassSpace = "psp", top_k: int | None = None) -> F32:
    """Gallery rows [n, C_k] from the old model's logits: PSP or LSP as defined above."""
    mode = _check_mode(mode)
    return psp_features(old_logits, top_k) if mode == "psp" else lsp_features(old_logits, top_k)


def _check_mode(mode: str) -> ClassSpace:
    """Validate a head name."""
    if mode == "psp":
        return "psp"
    if mode == "lsp":
        return "lsp"
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _class_columns(c_old: int, c_new: int, class_map: Sequence[int] | None) -> npt.NDArray[np.int64]:
    """New-model output index of each old class; identity (0..C_k-1) by default."""
    if c_old < 2:
        raise ValueError(f"the old model needs at least two classes, got {c_old}")
    if c_new < c_old:
        raise ValueError(f"the new model has {c_new} classes, fewer than the old model's {c_old}")
    cols = np.arange(c_old, dtype=np.int64) if class_map is None else np.asarray(class_map, dtype=np.int64)
    if cols.shape != (c_old,):
        raise ValueError(f"class_map must name one new index per old class ({c_old}), got {cols.shape}")
    if cols.min() < 0 or cols.max() >= c_new or len(np.unique(cols)) != c_old:
        raise ValueError(f"class_map must hold {c_old} distinct indices in [0, {c_new})")
    return cols


def _rows(x: npt.NDArray[np.floating]) -> F64:
    """Validate [n, C] finite rows and return them as float64."""
    a = np.asarray(x, dtype=np.float64)
    assert a.ndim == 2, f"expected [n, C] rows, got shape {a.shape}"
    assert np.isfinite(a).all(), "logits contain NaN/inf"
    return a


def _unit(x: npt.NDArray[np.floating]) -> F32:
    """L2-normalise float64 rows to float32; rows at rounding-noise length (<= _EPS) become zero rows."""
    out: F32 = normalize_rows(x, np.float32, _EPS)
    return out
