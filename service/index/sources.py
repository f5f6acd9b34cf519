"""Where gallery vectors come from: the synthetic world (old encoder, image view) or the user's .npy files.

A source yields unit-norm float32 rows with int64 ids, chunk by chunk, and draws a training sample,
without ever holding the whole gallery in memory (.npy files are memory-mapped).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from service.encoders.identity import ModelIdentity
from service.errors import InputError

Rows = npt.NDArray[np.float32]
Ids = npt.NDArray[np.int64]


class Source(Protocol):
    """Gallery vectors: `ntotal` rows of `dim`, produced in chunks with their ids."""

    ntotal: int
    dim: int
    model_id: str

    def describe(self) -> dict[str, Any]:
        """JSON-ready provenance for gallery.json."""
        ...

    def rows(self, positions: npt.NDArray[np.int64]) -> Rows:
        """Unit rows at these positions (0..ntotal-1)."""
        ...

    def ids(self, start: int, stop: int) -> Ids:
        """Ids of positions start..stop-1."""
        ...


def chunks(source: Source, chunk_size: int) -> Iterator[tuple[Ids, Rows]]:
    """(ids, unit rows) of the whole source, in order, chunk_size rows at a time."""
    for start in range(0, source.ntotal, chunk_size):
        stop = min(start + chunk_size, source.ntotal)
        yield source.ids(start, stop), source.rows(np.arange(start, stop, dtype=np.int64))


def sample_positions(n: int, size: int, seed: int) -> npt.NDArray[np.int64]:
    """`size` distinct positions of 0..n-1, sorted (sorted reads are kinder to memory-mapped files)."""
    rng = np.random.default_rng(seed)
    if size >= n:
        return np.arange(n, dtype=np.int64)
    return np.sort(rng.choice(n, size=size, replace=False)).astype(np.int64)


class SyntheticSource:
    """Items 0..size-1 of the synthetic world, image view, through one synthetic encoder; id = item id.

    model "old" (the default) is the frozen gallery the service fronts; "new" is what a full backfill
    with the new model would produce, the re-indexed baseline that benchmarks compare against.
    """

    def __init__(self, size: int, device: str = "cpu", model: str = "old") -> None:
        from service.encoders.synthetic import SyntheticNewEncoder, SyntheticOldEncoder

        if model not in ("old", "new"):
            raise InputError(f"synthetic model must be old or new, got {model!r}")
        self.encoder = SyntheticOldEncoder(device) if model == "old" else SyntheticNewEncoder(device)
        self.ntotal = size
        self.dim = self.encoder.dim
        self.model_id = self.encoder.model_id
        self.old_model = ModelIdentity(f"synthetic-{model}", self.model_id, None, self.dim).as_dict()

    def describe(self) -> dict[str, Any]:
        """Provenance: item range, view and the world's parameters."""
        from dataclasses import asdict

        return {
            "kind": "synthetic",
            "items": [0, self.ntotal],
            "view": "image",
            "world": asdict(self.encoder.world.params),
            "model": asdict(self.encoder.model),
        }

    def rows(self, positions: npt.NDArray[np.int64]) -> Rows:
        """Old-encoder image embeddings of these items (already unit rows)."""
        return self.encoder.encode_items(positions)

    def ids(self, start: int, stop: int) -> Ids:
        """Item ids are positions."""
        return np.arange(start, stop, dtype=np.int64)


@dataclass(frozen=True)
class _Shard:
    path: Path
    array: npt.NDArray[Any]
    offset: int


class NpySource:
    """The user's own old-model embeddings: one .npy [n, d] or a folder of .npy shards (sorted by name).

    Rows are L2-normalised here; NaN / inf / all-zero rows are refused with their file and row.
    Ids are the global row numbers, or the int64 values of an ids .npy (one per row, unique).
    old_model: the identity of the model that made the rows (ModelIdentity.as_dict, from the OUT.json
    `nobackfill encode` wrote beside them), recorded in gallery.json; None when unknown.
    """

    _FLOAT_KINDS = ("float16", "float32", "float64")

    def __init__(
        self,
        path: Path,
        ids_path: Path | None = None,
        model_id: str = "unknown",
        old_model: dict[str, Any] | None = None,
    ) -> None:
        self.path = path
        self.model_id = model_id
        self.old_model = old_model
        files = sorted(path.glob("*.npy")) if path.is_dir() else [path]
        if not files:
            raise InputError(f"{path}: no .npy files")
        shards, offset, dim = [], 0, -1
        for file in files:
            array = _open_npy(file)
            if str(array.dtype) not in self._FLOAT_KINDS:
                raise InputError(f"{file}: dtype {array.dtype}, expected float32 (or float16/float64)")
            if array.ndim != 2 or array.shape[1] == 0:
                raise InputError(f"{file}: shape {array.shape}, expected [n, d]")
            if dim not in (-1, array.shape[1]):
                raise InputError(f"{file}: dimension {array.shape[1]} differs from the first shard's {dim}")
            dim = array.shape[1]
            shards.append(_Shard(file, array, offset))
            offset += array.shape[0]
        self.shards = shards
        self.ntotal = offset
        self.dim = dim
        self.ids_path = ids_path
        self._ids = _load_ids(ids_path, self.ntotal) if ids_path is not None else None
        self._starts = np.array([s.offset for s in shards], dtype=np.int64)

    def describe(self) -> dict[str, Any]:
        """Provenance: the absolute paths and row counts of the shards, and the ids file."""
        return {
            "kind": "npy",
            "path": str(self.path.resolve()),
            "files": [{"path": str(s.path.resolve()), "rows": int(s.array.shape[0])} for s in self.shards],
            "ids": str(self.ids_path.resolve()) if self.ids_path is not None else None,
        }

    def ids(self, start: int, stop: int) -> Ids:
        """Row numbers, or the ids file's values."""
        if self._ids is None:
            return np.arange(start, stop, dtype=np.int64)
        return np.asarray(self._ids[start:stop], dtype=np.int64)

    def positions_of(self, ids: Ids) -> npt.NDArray[np.int64]:
        """Positions of these ids (identity without an ids file)."""
        if self._ids is None:
            return ids.astype(np.int64)
        order = np.argsort(self._ids)
        return order[np.searchsorted(self._ids, ids, sorter=order)].astype(np.int64)

    def rows(self, positions: npt.NDArray[np.int64]) -> Rows:
        """Validated, normalised float32 rows at these (sorted or not) global positions."""
        out = np.empty((positions.shape[0], self.dim), dtype=np.float32)
        shard_of = np.searchsorted(self._starts, positions, side="right") - 1
        for k in np.unique(shard_of):
            sel = np.flatnonzero(shard_of == k)
            shard = self.shards[int(k)]
            local = positions[sel] - shard.offset
            # Contiguous positions read as one slice; scattered ones through fancy indexing.
            if local.size and local[-1] - local[0] + 1 == local.size and np.all(np.diff(local) == 1):
                block = np.asarray(shard.array[local[0] : local[-1] + 1], dtype=np.float32)
            else:
                block = np.asarray(shard.array[local], dtype=np.float32)
            out[sel] = _normalise(block, shard.path, local)
        return out


def _open_npy(path: Path) -> npt.NDArray[Any]:
    """Memory-map one .npy read-only; InputError if it is not one."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not a readable .npy array ({exc})") from exc
    if not isinstance(array, np.ndarray):
        raise InputError(f"{path}: not a single .npy array")
    return array


def _load_ids(path: Path, rows: int) -> Ids:
    """The ids file: int64-castable integers, one per row, unique."""
    ids = _open_npy(path)
    if ids.dtype.kind not in "iu":
        raise InputError(f"{path}: ids dtype {ids.dtype}, expected integers")
    if ids.shape != (rows,):
        raise InputError(f"{path}: ids shape {ids.shape}, expected ({rows},) (one per row)")
    ids64 = np.asarray(ids, dtype=np.int64)
    if np.unique(ids64).size != rows:
        raise InputError(f"{path}: ids are not unique")
    return ids64


def _normalise(block: npt.NDArray[np.float32], path: Path, local: npt.NDArray[np.int64]) -> Rows:
    """Unit rows; InputError naming the first NaN / inf / zero row."""
    bad = ~np.isfinite(block).all(axis=1)
    if bad.any():
        row = int(local[np.flatnonzero(bad)[0]])
        raise InputError(f"{path}: row {row} has NaN or inf values")
    norms = np.linalg.norm(block, axis=1, keepdims=True)
    zero = norms[:, 0] == 0
    if zero.any():
        row = int(local[np.flatnonzero(zero)[0]])
        raise InputError(f"{path}: row {row} is all zeros (cannot be normalised)")
    return np.asarray(block / norms, dtype=np.float32)
