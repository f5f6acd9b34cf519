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

from typing import TYPE_CHECKING, Any

import numpy as np

from service.index.base import Exclusion
from service.segment.in_store import ClientSegment, InStoreView
from service.segment.qdrant_rows import QdrantNewRows, VectorState

if TYPE_CHECKING:
    from service.settings import IndexSettings


class QdrantVectorSegment(ClientSegment[VectorState]):
    """The new vector of the gallery's own collection as the service's segment (segment/base.py's SegmentStore)."""

    backend = "qdrant-vector"
    store = "Qdrant"
    unit = "points"
    rows: QdrantNewRows

    @staticmethod
    def connect(settings: Any) -> Any:
        """A client of the cut-over's own."""
        from service.index.qdrant import client_of

        return client_of(settings)

    @staticmethod
    def search_ef_of(settings: IndexSettings) -> int | None:
        """The gallery's hnsw_ef (a search takes at least k); None: the collection's own."""
        return settings.qdrant_hnsw_ef

    def refresh(self) -> list[str]:
        """Check the vector (it may have been added since) and count its points; [name] when points arrived."""
        with self.answering():
            self._state = self.rows.checked(self._client, self._model, self._gallery)
            count = self.rows.count(self._client) if self._state is not None else 0
            # Beside a second collection the gallery cannot filter on it: the moved ids, listed.
            listed = self.rows.moved(self._client) if self.rows.side and count else np.zeros(0, np.int64)
        before = self.snapshot.count
        exclusion = Exclusion(listed, in_table=self.rows.unmoved()) if count else None
        self.snapshot = InStoreView(self, count, exclusion)
        return [self.rows.name] if count != before else []

    def describe(self) -> dict[str, Any]:
        """What /v1/info reports: the collection, the vector, the model and the coverage."""
        where = {
            "collection": self.rows.rows_collection,
            "vector": self.rows.vector or "(the default vector)",
            "layout": "collection" if self.rows.side else "named vector",
        }
        return self.described(where, None if self._state is None else self.index_kind)

    @property
    def index_kind(self) -> str:
        """How the vector is searched: local mode scans exactly, a server by its HNSW."""
        return "exact (local mode)" if self.rows.settings.qdrant_path else "hnsw"
