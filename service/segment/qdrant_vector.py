"""`QdrantVectorSegment`: the new-model segment as a named vector of the user's Qdrant collection (or a second one).

    NOBACKFILL_INDEX__BACKEND=qdrant                      (the gallery: the collection's old vector)
    NOBACKFILL_INDEX__QDRANT_NEW_VECTOR=embedding_v2      (the segment: a named vector beside it), or
    NOBACKFILL_INDEX__QDRANT_NEW_COLLECTION=products_v2   (a collection of nobackfill's own, same point ids)

Where the rows are and what "moved" means: segment/qdrant_rows.py.  Why the user's own collection: after
the cut-over the user's application reads the new vector where it read the old one (`using` the new
name, or an alias to the second collection: `backfill cutover`), with the same ids and payloads, served
by Qdrant's own HNSW on the vector with or without nobackfill in front.

The gallery's search leaves the moved points out in Qdrant itself (a must_not has_vector filter, index/
qdrant.py) beside a named vector; beside a second collection by their ids, read at each refresh
(over-fetching, index/base.py).  Reads are live, not a snapshot: hybrid's two searches run at once, so a
point written between them may be answered by both lists (hybrid's merge keeps it once) or, for that one
request, by neither.  The count (coverage) is read at each refresh.  A call that fails answers 503.

It shares the gallery's client: qdrant-client's local mode lets one client at a time open its folder.
The vector is never added by the service (no schema change without the operator's consent): until
`backfill run --add-vector` adds it the segment serves as empty, and each refresh looks again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from service.encoders.identity import ModelIdentity
from service.errors import ArtifactError, GalleryUnavailable, NobackfillError
from service.index.base import Exclusion, first_line
from service.rows import F32, I64
from service.segment.in_store import InStoreSegment, InStoreView
from service.segment.qdrant_rows import QdrantNewRows, VectorState

log = logging.getLogger("nobackfill.segment")

T = TypeVar("T")


class QdrantView(InStoreView):
    """The vector as one request reads it: live calls, the count of the last refresh."""


class QdrantVectorSegment(InStoreSegment[VectorState]):
    """The new vector of the gallery's own collection as the service's segment (segment/base.py's SegmentStore)."""

    backend = "qdrant-vector"

    def __init__(
        self, new_rows: QdrantNewRows, model: ModelIdentity, gallery: str, ntotal: int, client: Any, *, owned: bool
    ) -> None:
        self.rows = new_rows
        self.search_ef: int | None = new_rows.settings.qdrant_hnsw_ef  # None: the collection's own
        self._client = client
        self._owned = owned  # closed here only when not the gallery's
        super().__init__(model, gallery, ntotal)
        self.snapshot: QdrantView = QdrantView(self, 0, None)

    @classmethod
    def open(
        cls, new_rows: QdrantNewRows, model: ModelIdentity, gallery: str, ntotal: int, client: Any, *, owned: bool
    ) -> QdrantVectorSegment:
        """The new rows beside the collection's gallery, refreshed once; one ArtifactError line for another model's."""
        segment = cls(new_rows, model, gallery, ntotal, client, owned=owned)
        try:
            segment.refresh()
        except BaseException:
            segment.close()
            raise
        return segment

    @classmethod
    def finished(cls, new_rows: QdrantNewRows, model: ModelIdentity) -> QdrantVectorSegment:
        """After the cut-over: the new rows of `model` for every point of the collection, else one ArtifactError line.

        The gallery it sat beside is not checked (it is retired): the model and the count are.
        """
        from service.index.qdrant import client_of

        client = client_of(new_rows.settings)
        try:
            state = new_rows.state(client)
            if state is None or state.label is None:
                raise ArtifactError(f"{new_rows.where}: no nobackfill segment to cut over to")
            ntotal = new_rows.rows(client)
        except NobackfillError:
            client.close()
            raise
        except Exception as exc:  # the client's transport errors: the server is not there
            client.close()
            raise GalleryUnavailable(f"cannot reach Qdrant for {new_rows.where}: {first_line(exc)}") from exc
        segment = cls.open(new_rows, model, state.label.gallery, ntotal, client, owned=True)
        moved = segment.snapshot.count
        if moved < ntotal:
            segment.close()
            raise ArtifactError(
                f"{new_rows.where} holds {moved:,} of the collection's {ntotal:,} points ({moved / ntotal:.1%}); "
                "cut over (NOBACKFILL_OLD__BACKEND=none) once `nobackfill backfill status` says 100 %"
            )
        return segment

    @property
    def where(self) -> str:
        """The collection and vector (never the API key)."""
        return self.rows.where

    def refresh(self) -> list[str]:
        """Check the vector (it may have been added since) and count its points; [name] when points arrived."""
        try:
            self._state = self.rows.checked(self._client, self._model, self._gallery)
            count = self.rows.count(self._client) if self._state is not None else 0
            # Beside a second collection the gallery cannot filter on it: the moved ids, listed.
            listed = self.rows.moved(self._client) if self.rows.side and count else np.zeros(0, np.int64)
        except NobackfillError:
            raise
        except Exception as exc:  # the client's transport errors
            raise GalleryUnavailable(f"the Qdrant segment did not answer ({self.where}): {first_line(exc)}") from exc
        before = self.snapshot.count
        exclusion = Exclusion(listed, in_table=self.rows.unmoved()) if count else None
        self.snapshot = QdrantView(self, count, exclusion)
        return [self.rows.name] if count != before else []

    def run(self, work: Callable[[QdrantNewRows, Any, VectorState], T], empty: T) -> T:
        """work(rows, client, state); 503 (GalleryUnavailable) when Qdrant does not answer."""
        state = self._state
        if state is None:  # not added yet: nothing has moved
            return empty
        try:
            return work(self.rows, self._client, state)
        except NobackfillError:
            raise
        except Exception as exc:  # the client's transport and server errors alike
            raise GalleryUnavailable(f"the Qdrant segment did not answer ({self.where}): {first_line(exc)}") from exc

    def write(self, ids: I64, rows: F32, writer: str) -> None:
        """The cascade's rows into the vector; the service never adds it (no schema change without consent)."""
        if self._state is None:
            flag = "--add-collection" if self.rows.side else "--add-vector"
            raise ArtifactError(f"{self.where}: not there yet; `nobackfill backfill run {flag}` adds it")
        self.rows.write(self._client, ids, rows)
        log.debug("%s: %d rows written by %s", self.where, len(ids), writer)

    def describe(self) -> dict[str, Any]:
        """What /v1/info reports: the collection, the vector, the model and the coverage."""
        return {
            "backend": self.backend,
            "collection": self.rows.rows_collection,
            "vector": self.rows.vector or "(the default vector)",
            "layout": "collection" if self.rows.side else "named vector",
            "created": self._state is not None,
            "model": self._model.as_dict(),
            "moved": self.snapshot.count,
            "gallery_items": self._ntotal,
            "coverage": round(self.coverage, 6),
            "index": None if self._state is None else self.index_kind,
        }

    @property
    def index_kind(self) -> str:
        """How the vector is searched: local mode scans exactly, a server by its HNSW."""
        return "exact (local mode)" if self.rows.settings.qdrant_path else "hnsw"

    def close(self) -> None:
        """Close the client when it is this segment's own (after the cut-over); the gallery closes a shared one."""
        if self._owned:
            self._client.close()
