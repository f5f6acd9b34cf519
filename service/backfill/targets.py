"""Where `backfill run` writes: a segment store seen from the writing side (the BackfillTarget protocol).

    BackfillTarget (protocol)
    ├── FolderTarget           a segment folder: shards, sealed at the end (segment/layout.py, sealed.py)
    ├── PgvectorColumnTarget   the new column of the pgvector table (backfill/pgvector_target.py)
    ├── QdrantVectorTarget     a named vector or second collection in Qdrant (backfill/qdrant_target.py)
    └── MilvusCollectionTarget a second collection beside the Milvus gallery (backfill/milvus_target.py)

run.py's loop (plan, skip what moved, encode, publish, throttle) is the same for every one; a target owns
creation, the run lock, "what has moved" and the write.  The targets in the user's store share BatchTarget
(a write per batch, nothing to seal); the Qdrant and Milvus ones share ClientTarget: one client, one call
per publish, no lock, the client's errors as one GalleryUnavailable line.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import numpy.typing as npt

from service.encoders.identity import ModelIdentity
from service.errors import InputError
from service.index.base import store_errors
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

    def finish(
        self, seal_rows: int, writer: str, queries: F32 | None = None, queries_kind: str = "served"
    ) -> SealReport | None:
        """After an uninterrupted run: what the target builds once (a sealed index, its width measured on
        `queries` when given), or None."""
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

    def finish(
        self, seal_rows: int, writer: str, queries: F32 | None = None, queries_kind: str = "served"
    ) -> SealReport | None:
        """Seal the rows no index covers once there are seal_rows of them (0: never)."""
        if seal_rows <= 0:
            return None
        return seal(self.folder, seal_rows, writer, queries=queries, queries_kind=queries_kind)

    def close(self) -> None:
        """Nothing to release."""


class BatchTarget:
    """A part in the user's store that `backfill run` writes a batch at a time (a pgvector column or side table,
    a Qdrant vector or collection, a Milvus collection).

    Each publish is one write of the batch's rows where they are not written yet (`publish`), named for the
    report by its number; there is nothing to build at the end: the store indexes the rows by itself, or
    (pgvector) `backfill index` creates an index on demand, never implicitly.  `add`: the operator's flag
    that lets `prepare` create the part.
    """

    unit = "batch"

    def __init__(self, where: str, *, add: bool) -> None:
        self.where = where
        self.add = add
        self._written = 0

    def publish(self, ids: I64, rows: F32) -> None:
        """Write the rows of `ids` not written yet."""
        raise NotImplementedError

    def write(self, ids: I64, rows: F32, model: ModelIdentity, writer: str) -> str:  # noqa: ARG002 (the protocol's)
        """One publish; a name for the report."""
        self.publish(ids, rows)
        self._written += 1
        return f"batch-{self._written}"

    def finish(
        self,
        seal_rows: int,  # noqa: ARG002 (the protocol's)
        writer: str,  # noqa: ARG002
        queries: F32 | None = None,  # noqa: ARG002
        queries_kind: str = "served",  # noqa: ARG002
    ) -> SealReport | None:
        """Nothing to build (class docstring)."""
        return None


class ClientTarget(BatchTarget):
    """A part in a store answered through one client (a Qdrant vector or collection, a Milvus collection).

    Each publish is one call that writes the batch's rows where they are not written yet, so a run killed
    at any moment loses at most the batch in flight and a re-run skips what is there (resumable and
    idempotent, like a folder's shards).  Such stores have no lock a run could hold: two runs at once each
    skip what the other wrote and only repeat the batch in flight.  A subclass names its store and says
    how it refuses to create the part without the operator's flag (`refusal`).  `rows` is the store's
    new-rows object (segment/qdrant_rows.py, segment/milvus_rows.py).
    """

    store: ClassVar[str]  # in messages: "Qdrant", "Milvus"

    def __init__(self, new_rows: Any, client: Any, *, add: bool) -> None:
        super().__init__(new_rows.where, add=add)
        self.rows = new_rows
        self._client = client

    def refusal(self, model: ModelIdentity) -> str:
        """The one line that says the part is missing and which flag creates it."""
        raise NotImplementedError

    def prepare(self, model: ModelIdentity, gallery: GalleryRef) -> None:
        """Check the part is this model's beside this gallery; create it when the flag says so, else refuse."""
        if self._call(self.rows.checked, model, gallery.fingerprint) is not None:
            return
        if not self.add:
            raise InputError(self.refusal(model))
        self._call(self.rows.add, model, gallery.fingerprint)

    @contextmanager
    def locked(self, part: Part | None) -> Iterator[None]:  # noqa: ARG002 (the protocol's)
        """No lock to hold (class docstring): concurrent runs are safe, only wasteful."""
        yield

    def moved(self) -> I64:
        """Every id that has its new row, sorted."""
        moved: I64 = self._call(self.rows.moved)
        return moved

    def moved_among(self, ids: I64) -> npt.NDArray[np.bool_]:
        """Which of `ids` have it by now (one read by id)."""
        among: npt.NDArray[np.bool_] = self._call(self.rows.moved_among, ids)
        return among

    def publish(self, ids: I64, rows: F32) -> None:
        """One call writing the rows of `ids` not written yet."""
        self._call(self.rows.write, ids, rows)

    def close(self) -> None:
        """Close the client."""
        self._client.close()

    def _call(self, work: Any, *args: Any) -> Any:
        """work(client, *args); an unreachable store is one GalleryUnavailable line."""
        with store_errors(f"{self.store} did not answer for {self.where}"):
            return work(self._client, *args)
