"""Where `backfill run` writes: a segment store seen from the writing side (the BackfillTarget protocol).

    BackfillTarget (protocol)
    ├── FolderTarget           a segment folder: shards, sealed at the end (segment/layout.py, sealed.py)
    ├── PgvectorColumnTarget   the new column of the pgvector table (backfill/pgvector_target.py)
    ├── QdrantVectorTarget     a named vector or second collection in Qdrant (backfill/qdrant_target.py)
    └── MilvusCollectionTarget a second collection beside the Milvus gallery (backfill/milvus_target.py)

run.py's loop (plan, skip what moved, encode, publish, throttle) is the same for every one; a target owns
creation, the run lock, "what has moved" and the write.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from service.encoders.identity import ModelIdentity
from service.rows import F32, I64
from service.segment.catalog import MovedIds
from service.segment.layout import GalleryRef, create_segment, remove_abandoned, write_shard
from service.segment.sealed import SealReport, seal

if TYPE_CHECKING:
    from service.backfill.run import Part


class BackfillTarget(Protocol):
    """A segment as `backfill run` fills it."""

    where: str  # for messages: the folder, or the table's column
    unit: str  # what one publish makes: "shard", "batch"

    def prepare(self, model: ModelIdentity, gallery: GalleryRef) -> None:
        """Create it when it does not exist (refused in one line when it is another model's or gallery's)."""
        ...

    def locked(self, part: Part | None) -> AbstractContextManager[None]:
        """Hold the run lock for the block (InputError at once when another run holds it)."""
        ...

    def moved(self) -> I64:
        """Every id moved so far, by any writer, sorted."""
        ...

    def moved_among(self, ids: I64) -> npt.NDArray[np.bool_]:
        """Which of `ids` have moved by now (another writer may be adding)."""
        ...

    def write(self, ids: I64, rows: F32, model: ModelIdentity, writer: str) -> str:
        """Publish unit rows; the name of what was published."""
        ...

    def finish(self, seal_rows: int, writer: str) -> SealReport | None:
        """After an uninterrupted run: what the target builds once (a sealed index), or None."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


class FolderTarget:
    """A segment folder: shards through layout.write_shard, the moved ids through a ShardCatalog."""

    unit = "shard"

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.where = str(folder)
        self._moved: MovedIds | None = None

    def prepare(self, model: ModelIdentity, gallery: GalleryRef) -> None:
        """create_segment (a no-op once it exists), then drop what a killed writer left half-written."""
        create_segment(self.folder, model, gallery)

    @contextmanager
    def locked(self, part: Part | None) -> Iterator[None]:
        """The folder's flock (run.one_run_at_a_time); abandoned temporary shards removed once it is held."""
        from service.backfill.run import one_run_at_a_time

        with one_run_at_a_time(self.folder, part):
            remove_abandoned(self.folder)
            yield

    def moved(self) -> I64:
        """The catalogue's intact ids, read again (only the shards published since)."""
        if self._moved is None:
            self._moved = MovedIds(self.folder)
        return self._moved.update()

    def moved_among(self, ids: I64) -> npt.NDArray[np.bool_]:
        """A bisection each in the ids read now."""
        self.moved()
        assert self._moved is not None
        return self._moved.contains(ids)

    def write(self, ids: I64, rows: F32, model: ModelIdentity, writer: str) -> str:
        """One shard (hidden, fsynced, renamed)."""
        return write_shard(self.folder, ids, rows, model, writer)

    def finish(self, seal_rows: int, writer: str) -> SealReport | None:
        """Seal the rows no index covers once there are seal_rows of them (0: never)."""
        return seal(self.folder, seal_rows, writer) if seal_rows > 0 else None

    def close(self) -> None:
        """Nothing to release."""
