"""`backfill run` into a second Milvus collection (segment/milvus_rows.py), as a BackfillTarget.

    nobackfill backfill run --segment milvus-collection:items_v2 --add-collection ...

Each publish is one `upsert` of the batch's rows whose keys are not there yet, so a run killed at any
moment loses at most the batch in flight, and a re-run skips every item already written (resumable and
idempotent, like a folder's shards).  The collection is created only with --add-collection, labelled
with the new model in its properties.

Milvus has no lock a run could hold: two runs at once each skip what the other wrote and only repeat the
batch in flight, never holding a key twice (an upsert replaces it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from service.encoders.identity import ModelIdentity
from service.errors import GalleryUnavailable, InputError, NobackfillError
from service.index.base import first_line
from service.rows import F32, I64
from service.segment.layout import GalleryRef
from service.segment.milvus_rows import MilvusNewRows
from service.segment.sealed import SealReport

if TYPE_CHECKING:
    from service.backfill.run import Part


class MilvusCollectionTarget:
    """The second collection the settings and --segment name."""

    unit = "batch"

    def __init__(self, new_rows: MilvusNewRows, client: Any, *, add: bool) -> None:
        self.rows = new_rows
        self.where = new_rows.where
        self.add = add
        self._client = client
        self._written = 0

    def prepare(self, model: ModelIdentity, gallery: GalleryRef) -> None:
        """Check the collection is this model's beside this gallery; create it with --add-collection, else refuse."""
        if self._call(self.rows.checked, model, gallery.fingerprint) is not None:
            return
        if not self.add:
            raise InputError(
                f"{self.where}: no such collection; pass --add-collection to create it (nobackfill's own: the "
                f"keys and field names of {self.rows.collection}, dim {model.dim}, its index type and metric)"
            )
        self._call(self.rows.add, model, gallery.fingerprint)

    @contextmanager
    def locked(self, part: Part | None) -> Iterator[None]:  # noqa: ARG002 (the protocol's)
        """No lock to hold (module docstring): concurrent runs are safe, only wasteful."""
        yield

    def moved(self) -> I64:
        """Every key the collection holds, sorted."""
        moved: I64 = self._call(self.rows.moved)
        return moved

    def moved_among(self, ids: I64) -> npt.NDArray[np.bool_]:
        """Which of `ids` it holds by now (one get by key)."""
        among: npt.NDArray[np.bool_] = self._call(self.rows.moved_among, ids)
        return among

    def write(self, ids: I64, rows: F32, model: ModelIdentity, writer: str) -> str:  # noqa: ARG002 (the protocol's)
        """One upsert of the rows not there yet; a name for the report."""
        self._call(self.rows.write, ids, rows)
        self._written += 1
        return f"batch-{self._written}"

    def finish(self, seal_rows: int, writer: str) -> SealReport | None:  # noqa: ARG002 (the protocol's)
        """Nothing: Milvus indexes each sealed segment of the collection by itself."""
        return None

    def close(self) -> None:
        """Close the client."""
        self._client.close()

    def _call(self, work: Any, *args: Any) -> Any:
        """work(client, *args); an unreachable Milvus is one GalleryUnavailable line."""
        try:
            return work(self._client, *args)
        except NobackfillError:
            raise
        except Exception as exc:  # pymilvus's and grpc's errors
            raise GalleryUnavailable(f"Milvus did not answer for {self.where}: {first_line(exc)}") from exc
