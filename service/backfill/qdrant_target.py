"""`backfill run` into Qdrant (segment/qdrant_rows.py), as a BackfillTarget.

    nobackfill backfill run --segment qdrant:embedding_v2 --add-vector ...              a named vector
    nobackfill backfill run --segment qdrant-collection:items_v2 --add-collection ...  a second collection

Each publish is one `update_vectors` (or `upsert`) that sets the new rows of a batch where they are not
set yet, so a run killed at any moment loses at most the batch in flight, and a re-run skips every
point already set (resumable and idempotent, like a folder's shards).  The vector (or collection) is
created only with --add-vector (--add-collection), labelled in the collection's metadata.

Qdrant has no lock a run could hold: two runs at once each skip what the other set and only repeat the
batch in flight, never writing a point twice (the first writer's row stays).  In local mode the
client's own folder lock already lets one process in.
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
from service.segment.qdrant_rows import QdrantNewRows
from service.segment.sealed import SealReport

if TYPE_CHECKING:
    from service.backfill.run import Part


class QdrantVectorTarget:
    """The new vector (or second collection) the settings name."""

    unit = "batch"

    def __init__(self, new_rows: QdrantNewRows, client: Any, *, add: bool) -> None:
        self.rows = new_rows
        self.where = new_rows.where
        self.add = add
        self._client = client
        self._written = 0

    def prepare(self, model: ModelIdentity, gallery: GalleryRef) -> None:
        """Check the vector is this model's beside this gallery; add it with --add-vector, else refuse in one line."""
        if self._call(self.rows.checked, model, gallery.fingerprint) is not None:
            return
        if not self.add and self.rows.side:
            raise InputError(
                f"{self.where}: no such collection; pass --add-collection to create it "
                f"(a collection of nobackfill's own: vector {self.rows.vector or '(default)'}, dim {model.dim}, Cosine)"
            )
        if not self.add:
            raise InputError(
                f"{self.where}: no such vector; pass --add-vector to add it "
                f"(create_vector_name {self.rows.name}: dim {model.dim}, Cosine; Qdrant >= 1.18, else "
                "--segment qdrant-collection:NAME --add-collection)"
            )
        self._call(self.rows.add, model, gallery.fingerprint)

    @contextmanager
    def locked(self, part: Part | None) -> Iterator[None]:  # noqa: ARG002 (the protocol's)
        """No lock to hold (module docstring): concurrent runs are safe, only wasteful."""
        yield

    def moved(self) -> I64:
        """Every id that has its new row, sorted."""
        moved: I64 = self._call(self.rows.moved)
        return moved

    def moved_among(self, ids: I64) -> npt.NDArray[np.bool_]:
        """Which of `ids` have it by now (one retrieve by id)."""
        among: npt.NDArray[np.bool_] = self._call(self.rows.moved_among, ids)
        return among

    def write(self, ids: I64, rows: F32, model: ModelIdentity, writer: str) -> str:  # noqa: ARG002 (the protocol's)
        """One update setting the vector of `ids` where it is not set; a name for the report."""
        self._call(self.rows.write, ids, rows)
        self._written += 1
        return f"batch-{self._written}"

    def finish(self, seal_rows: int, writer: str) -> SealReport | None:  # noqa: ARG002 (the protocol's)
        """Nothing: Qdrant's optimizer indexes the vector by itself."""
        return None

    def close(self) -> None:
        """Close the client."""
        self._client.close()

    def _call(self, work: Any, *args: Any) -> Any:
        """work(client, *args); an unreachable Qdrant is one GalleryUnavailable line."""
        try:
            return work(self._client, *args)
        except NobackfillError:
            raise
        except Exception as exc:  # the client's transport and server errors
            raise GalleryUnavailable(f"Qdrant did not answer for {self.where}: {first_line(exc)}") from exc
