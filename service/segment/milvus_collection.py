"""`MilvusCollectionSegment`: the new-model segment as a second Milvus collection beside the user's.

    NOBACKFILL_INDEX__BACKEND=milvus                      (the gallery: the user's collection, old rows)
    NOBACKFILL_INDEX__MILVUS_NEW_COLLECTION=products_v2   (the segment: a collection of nobackfill's own, same keys)

Where the rows are and what "moved" means: segment/milvus_rows.py.  Why a second collection: Milvus
cannot add a vector field to a collection that holds rows, and the user's collection stays unwritten;
after the cut-over an alias switched to the new collection (`backfill cutover`) serves the user's
application with the same field names, and Milvus's own index on it serves with or without nobackfill.

The gallery's search leaves the moved items out by their ids, listed at each refresh: Milvus has no
filter on another collection, and an `id not in [...]` expression of millions of ids is no query, so
index/milvus.py over-fetches and drops them (up to Milvus's topk bound), and skips the old search once
every row has moved.  Reads are live, not a snapshot: hybrid's two searches run at once, so an item
written between them may be answered by both lists (hybrid's merge keeps it once) or, for that one
request, by neither.  The count (coverage) is read at each refresh.  A call that fails answers 503.

It shares the gallery's client (one gRPC channel; a milvus-lite ./x.db is this process's own server).
The collection is never created by the service (no new collection without the operator's consent):
until `backfill run --add-collection` creates it the segment serves as empty, and each refresh looks again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from service.index.base import Exclusion
from service.segment.in_store import ClientSegment, InStoreView
from service.segment.milvus_rows import CollectionState, MilvusNewRows

if TYPE_CHECKING:
    from service.settings import IndexSettings


class MilvusCollectionSegment(ClientSegment[CollectionState]):
    """A second Milvus collection as the service's segment (segment/base.py's SegmentStore)."""

    backend = "milvus-collection"
    store = "Milvus"
    takes_ef_search = False  # its search_ef is an IVF nprobe; an HNSW collection searches at ef max(k, 64)
    rows: MilvusNewRows

    @staticmethod
    def connect(settings: Any) -> Any:
        """A client of the cut-over's own."""
        from service.index.milvus import connect

        token = settings.milvus_token.get_secret_value() if settings.milvus_token else None
        return connect(str(settings.milvus_uri), token, settings.milvus_timeout_s)

    @staticmethod
    def search_ef_of(settings: IndexSettings) -> int | None:
        """The lists an IVF index probes (capped at its nlist), as for the gallery's default; HNSW takes ef >= k."""
        return settings.nprobe

    def refresh(self) -> list[str]:
        """Check the collection (it may have been created since) and list its keys; [name] when rows arrived."""
        with self.answering():  # pymilvus's and grpc's errors
            self._state = self.rows.checked(self._client, self._model, self._gallery)
            listed = self.rows.moved(self._client) if self._state is not None else np.zeros(0, np.int64)
        before = self.snapshot.count
        count = len(listed)  # the count and the exclusion from one listing: they never disagree
        self.snapshot = InStoreView(self, count, Exclusion(listed) if count else None)
        return [self.rows.name] if count != before else []

    def describe(self) -> dict[str, Any]:
        """What /v1/info reports: the collection, the model and the coverage."""
        state = self._state
        index = None if state is None else state.layout.index_type
        return self.described({"collection": self.rows.name, "beside": self.rows.collection}, index)
