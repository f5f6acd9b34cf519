"""Reading and validating a support / test folder of paired embeddings.

Layout (rows may be unnormalised; they are L2-normalised by whoever uses them):
    old_query.npy   [n, d_old]   queries through the old model
    new_query.npy   [n, d_new]   the same inputs, row for row, through the new model
    old_target.npy  [m, d_old]   the gallery side, old model
    new_target.npy  [m, d_new]   optional: the same targets through the new model
    query_ids.npy   [n] int64    optional; default 0..n-1
    target_ids.npy  [m] int64    optional; default 0..m-1 (so row i is relevant to row i)
Every problem raises InputError with one line naming the file.  Files load with allow_pickle=False.
Only numpy is imported here, so bad input is refused before torch loads.

All-zero rows are real data, not corruption: a lexical or static old model embeds any input with no
known token as zero.  Such a row has no direction, so by default the pair it belongs to is dropped
(a query pair when either side is zero, a target when its old row, or its new row, is zero) and the
count per file is kept in `Split.zero_rows`; `strict=True` refuses them instead.  NaN / inf rows are
always refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from service.encoders.identity import MODELS_JSON, ModelIdentity, read_models_json
from service.errors import InputError
from service.rows import F32

Array = npt.NDArray[np.float32]
IdArray = npt.NDArray[np.int64]

FILES = (
    "old_query.npy",
    "new_query.npy",
    "old_target.npy",
    "new_target.npy",
    "query_ids.npy",
    "target_ids.npy",
)


@dataclass(frozen=True)
class Split:
    """One validated folder of paired embeddings (support or test)."""

    path: Path
    old_query: Array
    new_query: Array
    old_target: Array
    new_target: Array | None
    query_ids: IdArray
    target_ids: IdArray
    zero_rows: dict[str, int] = field(default_factory=dict)  # file -> all-zero rows dropped (only files with some)

    @property
    def old_dim(self) -> int:
        """Dimension of the old model."""
        return int(self.old_query.shape[1])

    @property
    def new_dim(self) -> int:
        """Dimension of the new model."""
        return int(self.new_query.shape[1])

    def zero_rows_line(self) -> str | None:
        """One line saying how many all-zero rows were dropped from which file, or None when none were."""
        if not self.zero_rows:
            return None
        per_file = ", ".join(f"{n} in {name}" for name, n in self.zero_rows.items())
        return f"{self.path}: dropped the pairs of {sum(self.zero_rows.values())} all-zero row(s) ({per_file})"


def default_ids(n: int) -> IdArray:
    """Row numbers as ids: row i of the queries is relevant to row i of the targets."""
    return np.arange(n, dtype=np.int64)


def _load(path: Path) -> npt.NDArray[np.generic]:
    """np.load without pickle, every failure turned into a one-line InputError."""
    try:
        arr = np.load(path, allow_pickle=False)
    except FileNotFoundError as exc:
        raise InputError(f"{path}: missing") from exc
    except (ValueError, OSError, EOFError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"{path}: not a readable .npy array ({first})") from exc
    if not isinstance(arr, np.ndarray):
        raise InputError(f"{path}: not a single .npy array")
    return arr


def load_embeddings(path: Path, *, allow_zero: bool = False) -> Array:
    """Load a [rows, dim] float array, refusing empty and non-finite rows (and all-zero ones unless allowed)."""
    arr = _load(path)
    if arr.ndim != 2:
        raise InputError(f"{path}: expected a 2-d [rows, dim] array, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.floating):
        raise InputError(f"{path}: expected float embeddings, got dtype {arr.dtype}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise InputError(f"{path}: empty array of shape {arr.shape}")
    out = np.ascontiguousarray(arr, dtype=np.float32)
    finite = np.isfinite(out).all(axis=1)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise InputError(f"{path}: {len(bad)} row(s) with NaN/inf values (first: row {bad[0]})")
    # A zero row has no direction; float32 overflow to inf in the norm is caught as non-finite above.
    zero = _zero_rows(out)
    if zero.any() and not allow_zero:
        bad = np.flatnonzero(zero)
        raise InputError(f"{path}: {len(bad)} all-zero row(s) (first: row {bad[0]}; --strict refuses them)")
    return out


def _zero_rows(arr: Array) -> npt.NDArray[np.bool_]:
    """Mask of the rows that are all zero."""
    return np.logical_not(arr.any(axis=1))


def load_ids(path: Path, rows: int, paired_with: str) -> IdArray:
    """Load a 1-d integer id array with one id per row of its partner file."""
    arr = _load(path)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{path}: expected a 1-d integer array, got {arr.dtype} of shape {arr.shape}")
    if len(arr) != rows:
        raise InputError(f"{path}: {len(arr)} ids but {paired_with} has {rows} rows")
    return arr.astype(np.int64)


def _check_rows(a: npt.NDArray[np.generic], a_path: Path, b: npt.NDArray[np.generic], b_path: Path) -> None:
    """Paired files must have the same number of rows."""
    if a.shape[0] != b.shape[0]:
        raise InputError(f"{b_path}: {b.shape[0]} rows but {a_path.name} has {a.shape[0]}; rows must pair up")


def _check_dim(arr: Array, path: Path, dim: int, what: str) -> None:
    """The file's embedding width must be the model's."""
    if arr.shape[1] != dim:
        raise InputError(f"{path}: dimension {arr.shape[1]} does not match the {what} dimension {dim}")


def load_split(
    directory: Path | str,
    *,
    require_new_target: bool = False,
    old_dim: int | None = None,
    new_dim: int | None = None,
    strict: bool = False,
) -> Split:
    """Load and validate a support / test folder; dims are checked against a profile when given.

    All-zero rows drop their pair (counted per file in zero_rows), or are refused with `strict`.
    """
    root = Path(directory)
    if not root.is_dir():
        raise InputError(f"{root}: not a directory")
    paths = {name: root / name for name in FILES}
    for name in ("old_query.npy", "new_query.npy", "old_target.npy"):
        if not paths[name].is_file():
            raise InputError(f"{paths[name]}: missing")
    if require_new_target and not paths["new_target.npy"].is_file():
        raise InputError(f"{paths['new_target.npy']}: missing (needed to fit on target rows)")

    allow_zero = not strict
    old_query = load_embeddings(paths["old_query.npy"], allow_zero=allow_zero)
    new_query = load_embeddings(paths["new_query.npy"], allow_zero=allow_zero)
    _check_rows(old_query, paths["old_query.npy"], new_query, paths["new_query.npy"])
    old_target = load_embeddings(paths["old_target.npy"], allow_zero=allow_zero)
    _check_dim(old_target, paths["old_target.npy"], old_query.shape[1], "old_query.npy")
    new_target: Array | None = None
    if paths["new_target.npy"].is_file():
        new_target = load_embeddings(paths["new_target.npy"], allow_zero=allow_zero)
        _check_rows(old_target, paths["old_target.npy"], new_target, paths["new_target.npy"])
        _check_dim(new_target, paths["new_target.npy"], new_query.shape[1], "new_query.npy")
    if old_dim is not None:
        _check_dim(old_query, paths["old_query.npy"], old_dim, "profile's old")
    if new_dim is not None:
        _check_dim(new_query, paths["new_query.npy"], new_dim, "profile's new")

    n, m = old_query.shape[0], old_target.shape[0]
    query_ids = (
        load_ids(paths["query_ids.npy"], n, "old_query.npy") if paths["query_ids.npy"].is_file() else default_ids(n)
    )
    target_ids = (
        load_ids(paths["target_ids.npy"], m, "old_target.npy") if paths["target_ids.npy"].is_file() else default_ids(m)
    )
    split = Split(root, old_query, new_query, old_target, new_target, query_ids, target_ids)
    return split if strict else _without_zero_rows(split)


def _without_zero_rows(split: Split) -> Split:
    """The split minus every pair with an all-zero row; InputError when no query pair or target is left."""
    named = {"old_query.npy": split.old_query, "new_query.npy": split.new_query, "old_target.npy": split.old_target}
    if split.new_target is not None:
        named["new_target.npy"] = split.new_target
    zero = {name: _zero_rows(arr) for name, arr in named.items()}
    counts = {name: int(mask.sum()) for name, mask in zero.items() if mask.any()}
    if not counts:
        return split
    q_keep = ~(zero["old_query.npy"] | zero["new_query.npy"])
    t_keep = ~zero["old_target.npy"]
    if "new_target.npy" in zero:
        t_keep &= ~zero["new_target.npy"]
    if not q_keep.any() or not t_keep.any():
        side = "query" if not q_keep.any() else "target"
        raise InputError(f"{split.path}: every {side} pair has an all-zero row; nothing is left to use")
    new_target = None if split.new_target is None else split.new_target[t_keep]
    return Split(
        split.path,
        split.old_query[q_keep],
        split.new_query[q_keep],
        split.old_target[t_keep],
        new_target,
        split.query_ids[q_keep],
        split.target_ids[t_keep],
        counts,
    )


# An exported traffic folder (`nobackfill traffic export`, traffic/export.py): query pairs without targets.
QUERY_OLD, QUERY_NEW = "old_query.npy", "new_query.npy"


@dataclass(frozen=True)
class QueryPairs:
    """Unlabelled (new, old) query pairs from one exported folder, zero rows dropped."""

    path: Path
    new: F32
    old: F32
    old_model: ModelIdentity | None
    new_model: ModelIdentity | None
    zero_rows: int


def load_query_pairs(folder: Path) -> QueryPairs:
    """Read an exported folder (old_query.npy, new_query.npy, models.json when present); InputError naming the file."""
    if not folder.is_dir():
        raise InputError(f"{folder}: not a directory")
    old = load_embeddings(folder / QUERY_OLD, allow_zero=True)
    new = load_embeddings(folder / QUERY_NEW, allow_zero=True)
    if len(old) != len(new):
        raise InputError(f"{folder / QUERY_NEW}: {len(new)} rows but {QUERY_OLD} has {len(old)}; rows must pair up")
    keep = old.any(axis=1) & new.any(axis=1)
    ids = read_models_json(folder)
    old_model, new_model = ids if ids is not None else (None, None)
    for identity, rows, side in ((old_model, old, "old"), (new_model, new, "new")):
        if identity is not None and identity.dim != rows.shape[1]:
            raise InputError(
                f"{folder / MODELS_JSON}: the {side} model is {identity.dim}-d, but {side}_query.npy holds "
                f"{rows.shape[1]}-d rows"
            )
    return QueryPairs(folder, new[keep], old[keep], old_model, new_model, int((~keep).sum()))
