"""Sampled pairs in rotating local shards: one .npz file per flush, the oldest deleted past the bound.

    DIR/pairs-<unix ns>-<pid>-<seq>-<rows>.npz   old (float16), new (float16), modality (uint8 codes),
                                                 models (the models_key JSON as utf-8 bytes)

The row count is in the name, so enforcing the bound lists the folder and never opens a shard.  After
every write, shards older than ttl_s are deleted, then the oldest until at most max_pairs rows remain;
a flush larger than max_pairs keeps its newest max_pairs rows.  A shard is written under a temporary
name and renamed, so a reader (export) never sees half a file.  Several worker processes may share the
folder: each names its shards with its pid, and a shard another process deleted first is skipped.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.traffic.base import MODALITY_CODES, PairBatch, StoredPairs, StoreKind, merge_runs

PREFIX = "pairs-"


@dataclass(frozen=True)
class _Shard:
    """One shard file and what its name says."""

    path: Path
    created_ns: int
    rows: int


def _shards(folder: Path) -> list[_Shard]:
    """The folder's complete shards, oldest first (by creation time, then name)."""
    out = []
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    for name in names:
        if not (name.startswith(PREFIX) and name.endswith(".npz")):
            continue
        parts = name[len(PREFIX) : -len(".npz")].split("-")
        if len(parts) != 4 or not all(p.isdigit() for p in parts):
            continue
        out.append(_Shard(folder / name, int(parts[0]), int(parts[3])))
    return sorted(out, key=lambda s: (s.created_ns, s.path.name))


def _unlink(path: Path) -> None:
    """Delete a file another process may have deleted already."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass


class LocalPairStore:
    """Rotating shards under one folder, at most max_pairs rows, none older than ttl_s."""

    kind: StoreKind = "local"

    def __init__(self, folder: Path, *, max_pairs: int, ttl_s: float) -> None:
        if max_pairs < 1:
            raise ValueError("max_pairs must be >= 1")
        self.folder = Path(folder)
        self.max_pairs = max_pairs
        self.ttl_s = ttl_s
        self._seq = 0

    def check_writable(self) -> None:
        """Create the folder and write and delete a probe file in it; OSError when shards cannot be written there."""
        self.folder.mkdir(parents=True, exist_ok=True)
        probe = self.folder / f".probe-{os.getpid()}-{time.time_ns()}"
        probe.write_bytes(b"")
        _unlink(probe)

    def append(self, batches: Sequence[PairBatch]) -> int:
        """Write one shard per model pair in `batches`, then enforce the TTL and the bound."""
        self.folder.mkdir(parents=True, exist_ok=True)
        runs = merge_runs(batches)
        room = self.max_pairs
        kept: list[PairBatch] = []
        for run in reversed(runs):  # the newest rows win when one flush is over the bound
            if room <= 0:
                break
            take = min(room, len(run))
            kept.append(
                PairBatch(run.models, run.old[-take:], run.new[-take:], run.modality[-take:])
                if take < len(run)
                else run
            )
            room -= take
        stored = 0
        for run in reversed(kept):
            self._write(run)
            stored += len(run)
        self.enforce()
        return stored

    def _write(self, run: PairBatch) -> None:
        """One shard, written under a temporary name and renamed into place."""
        self._seq += 1
        name = f"{PREFIX}{time.time_ns():020d}-{os.getpid()}-{self._seq}-{len(run)}.npz"
        tmp = self.folder / f".tmp-{name}"
        codes = np.array([MODALITY_CODES.index(m) for m in run.modality], dtype=np.uint8)
        with tmp.open("wb") as f:
            np.savez(
                f,
                old=run.old.astype(np.float16),
                new=run.new.astype(np.float16),
                modality=codes,
                models=np.frombuffer(run.models.encode(), dtype=np.uint8),
            )
        os.replace(tmp, self.folder / name)

    def enforce(self) -> None:
        """Delete expired shards, then the oldest until at most max_pairs rows remain."""
        shards = _shards(self.folder)
        cutoff = time.time_ns() - int(self.ttl_s * 1e9)
        live = []
        for shard in shards:
            if shard.created_ns < cutoff:
                _unlink(shard.path)
            else:
                live.append(shard)
        total = sum(s.rows for s in live)
        for shard in live:
            if total <= self.max_pairs:
                break
            _unlink(shard.path)
            total -= shard.rows

    def read(self, limit: int | None = None) -> StoredPairs:
        """The newest `limit` rows (all when None), newest first, expired shards left out."""
        self.enforce()
        runs: list[PairBatch] = []
        left = limit
        for shard in reversed(_shards(self.folder)):
            if left is not None and left <= 0:
                break
            try:
                with np.load(shard.path, allow_pickle=False) as data:
                    old, new, codes = data["old"], data["new"], data["modality"]
                    models = bytes(data["models"]).decode()
            except FileNotFoundError:
                continue  # deleted by another process's rotation meanwhile
            take = len(old) if left is None else min(left, len(old))
            # Newest first: the shard's rows were appended oldest first.
            sel = slice(len(old) - 1, len(old) - 1 - take, -1) if take < len(old) else slice(None, None, -1)
            modality = tuple(MODALITY_CODES[int(c)] for c in codes[sel])
            runs.append(PairBatch(models, old[sel].astype(np.float16), new[sel].astype(np.float16), modality))
            if left is not None:
                left -= take
        return StoredPairs(merge_runs(runs))

    def count(self) -> int:
        """Rows in the live shards."""
        self.enforce()
        return sum(s.rows for s in _shards(self.folder))

    def close(self) -> None:
        """Nothing is held open between writes."""
