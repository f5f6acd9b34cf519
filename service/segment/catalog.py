"""Which shards of a segment are intact: each checked once, the one definition of "moved".

Every reader of shards goes through a `ShardCatalog`: the service's `Segment` (what it searches and
what the old gallery's search skips), `MovedIds` (what `backfill run` never encodes again),
`backfill status` and `SegmentSource` (the cut-over's rows and the next upgrade's gallery).  So a
shard that one of them refuses is refused by all, and its items count as not moved everywhere:
`backfill run` moves them again instead of leaving them on the old gallery for ever.

A shard is intact when `layout.read_shard` accepts it: every file matches the manifest, the ids are
`count` int64, the rows float32 [count, dim], finite and of unit norm.  Published shards never change,
so a catalogue checks each name once, intact or refused, and never reads it again; a scan reads only
the names published since the last one.  The rows of an intact shard stay memory-mapped (read-only),
so holding a catalogue of a large segment costs address space, not memory.  Each scan adds the new
intact shards' ids to the catalogue's sorted moved ids (`sorted_union`), so `moved()` costs nothing that
grows with the segment, for a writer checking every batch and the service refreshing alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service.errors import ArtifactError
from service.index.base import sorted_member
from service.rows import F32, I64
from service.segment.layout import read_segment_meta, read_shard, shard_names

_NO_IDS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class ShardEntry:
    """One published shard as checked: its ids and rows when intact, the reason when refused."""

    name: str
    ids: I64 = field(default_factory=lambda: _NO_IDS)  # empty when refused
    vectors: F32 | None = None  # memory-mapped unit rows [len(ids), dim]; None when refused
    meta: dict[str, Any] = field(default_factory=dict)  # shard.json
    refused: str | None = None  # why the shard is not read

    @property
    def intact(self) -> bool:
        """Whether every reader serves this shard's rows."""
        return self.refused is None


class ShardCatalog:
    """The shards of one segment folder, each checked once against the segment's dim."""

    def __init__(self, folder: Path, dim: int) -> None:
        self.folder = folder
        self.dim = dim
        self._entries: dict[str, ShardEntry] = {}  # insertion order = name order (names sort by time)
        self._moved = _NO_IDS  # sorted distinct ids of the intact entries

    @classmethod
    def of(cls, folder: Path) -> ShardCatalog:
        """The catalogue of a segment, at the dim its segment.json names (ArtifactError when it is none)."""
        return cls(folder, read_segment_meta(folder).dim)

    def scan(self) -> list[ShardEntry]:
        """Check the shards published since the last scan; returns them, intact and refused, oldest first."""
        fresh = []
        for name in shard_names(self.folder):
            if name in self._entries:
                continue
            try:
                shard = read_shard(self.folder, name, self.dim)
            except ArtifactError as exc:
                entry = ShardEntry(name, refused=exc.message)
            else:
                entry = ShardEntry(name, shard.ids, shard.vectors, shard.meta)
            self._entries[name] = entry
            fresh.append(entry)
        intact = [entry.ids for entry in fresh if entry.intact]
        if intact:
            self._moved = sorted_union(self._moved, np.unique(np.concatenate(intact)))
        return fresh

    @property
    def entries(self) -> list[ShardEntry]:
        """Every shard checked so far, oldest first."""
        return list(self._entries.values())

    @property
    def intact(self) -> list[ShardEntry]:
        """The shards every reader serves, oldest first."""
        return [entry for entry in self._entries.values() if entry.intact]

    @property
    def refused(self) -> dict[str, str]:
        """Name -> reason of every refused shard."""
        return {entry.name: entry.refused for entry in self._entries.values() if entry.refused is not None}

    def moved(self) -> I64:
        """Sorted distinct ids of every intact shard checked so far (never changed in place: a scan replaces it)."""
        return self._moved


def sorted_union(held: I64, fresh: I64) -> I64:
    """The ascending distinct ids of `held` and `fresh` (both ascending, distinct).

    Why not np.unique of both: a catalogue adds every shard as it lands, and sorting every moved id again
    each time costs a run time quadratic in the segment (0.2 s a shard at 500,000 moved ids).  Inserting the
    few new ones at their bisected places is one copy of the array.
    """
    fresh = fresh[~sorted_member(fresh, held)]
    return np.insert(held, np.searchsorted(held, fresh), fresh) if len(fresh) else held


def moved_ids(folder: Path) -> I64:
    """Sorted distinct ids of every intact published shard: what a writer never encodes again."""
    catalog = ShardCatalog.of(folder)
    catalog.scan()
    return catalog.moved()


class MovedIds:
    """The moved ids of a segment that other writers keep adding to; update() reads only the shards published since."""

    def __init__(self, folder: Path) -> None:
        self.catalog = ShardCatalog.of(folder)

    def update(self) -> I64:
        """Check the shards published since the last update (a refused one never counts); the sorted ids."""
        self.catalog.scan()
        return self.catalog.moved()

    def contains(self, ids: I64) -> npt.NDArray[np.bool_]:
        """Which of `ids` had moved at the last update (a bisection each: cheap at millions of moved ids)."""
        return sorted_member(ids, self.catalog.moved())
