"""A finished segment as the rows of a new gallery: what the cut-over serves, and the next upgrade's old gallery.

Every intact shard (segment/catalog.py: checked as the service checks it) is memory-mapped, each id
taken once (its first row, as the service reads it), in id order; `gallery build --from-segment`
builds an IVF-PQ gallery of them whose gallery.json names the segment's model as the gallery's model.
A segment that does not cover the gallery is refused (its missing items would vanish from search)
unless the caller allows it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service.errors import ArtifactError, InputError
from service.segment.catalog import ShardCatalog
from service.segment.layout import read_segment_meta

Rows = npt.NDArray[np.float32]
Ids = npt.NDArray[np.int64]


class SegmentSource:
    """The segment's rows, one per moved id, sorted by id (the index.sources.Source protocol)."""

    def __init__(self, folder: Path, allow_partial: bool = False) -> None:
        self.folder = folder
        self.meta = read_segment_meta(folder)
        self.dim = self.meta.dim
        self.model_id = self.meta.model.model_id
        self.old_model = self.meta.model.as_dict()  # the gallery's model is the segment's
        self._vectors: list[Any] = []
        parts_ids, parts_shard, parts_row = [], [], []
        catalog = ShardCatalog(folder, self.dim)
        catalog.scan()
        for entry in catalog.intact:  # a refused shard's items count as not moved, as the service counts them
            self._vectors.append(entry.vectors)
            parts_ids.append(entry.ids)
            parts_shard.append(np.full(len(entry.ids), len(self._vectors) - 1, dtype=np.int64))
            parts_row.append(np.arange(len(entry.ids), dtype=np.int64))
        if not parts_ids:
            raise InputError(f"segment {folder}: no intact shards; nothing to build a gallery from")
        all_ids = np.concatenate(parts_ids)
        first = np.unique(all_ids, return_index=True)[1]  # the first row of each id, sorted by id
        self._ids = all_ids[first]
        self._shard = np.concatenate(parts_shard)[first]
        self._row = np.concatenate(parts_row)[first]
        self.ntotal = int(len(self._ids))
        missing = self.meta.gallery.ntotal - self.ntotal
        if missing > 0 and not allow_partial:
            raise InputError(
                f"segment {folder} holds {self.ntotal:,} of the gallery's {self.meta.gallery.ntotal:,} items; "
                "finish the backfill first (`nobackfill backfill run ... --fraction 1.0`), or pass --allow-partial"
            )

    def describe(self) -> dict[str, Any]:
        """Provenance for gallery.json: the segment, its model and the gallery it replaces."""
        return {
            "kind": "segment",
            "segment": str(self.folder.resolve()),
            "model": self.meta.model.as_dict(),
            "replaces_gallery": self.meta.gallery.as_dict(),
        }

    def rows(self, positions: npt.NDArray[np.int64]) -> Rows:
        """Unit rows at these positions (gathered shard by shard from the memory maps)."""
        out = np.empty((len(positions), self.dim), dtype=np.float32)
        shards, rows = self._shard[positions], self._row[positions]
        for shard in np.unique(shards).tolist():
            mine = shards == shard
            out[mine] = self._vectors[shard][rows[mine]]
        if not np.isfinite(out).all():
            raise ArtifactError(f"segment {self.folder}: non-finite rows")
        return out

    def ids(self, start: int, stop: int) -> Ids:
        """Gallery ids of positions start..stop-1."""
        return self._ids[start:stop]
