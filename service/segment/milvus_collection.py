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

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from service.encoders.identity import ModelIdentity
from service.errors import ArtifactError, GalleryUnavailable, NobackfillError
from service.index.base import Exclusion, first_line
from service.rows import F32, I64
from service.segment.in_store import InStoreSegment, InStoreView
from service.segment.milvus_rows import CollectionState, MilvusNewRows

log = logging.getLogger("nobackfill.segment")

T = TypeVar("T")


class MilvusView(InStoreView):
    """The collection as one request reads it: live calls, the count and moved ids of the last refresh."""


class MilvusCollectionSegment(InStoreSegment[CollectionState]):
    """A second Milvus collection as the service's segment (segment/base.py's SegmentStore)."""

    backend = "milvus-collection"

    def __init__(
        self, new_rows: MilvusNewRows, model: ModelIdentity, gallery: str, ntotal: int, client: Any, *, owned: bool
    ) -> None:
        self.rows = new_rows
        # The lists an IVF index probes (capped at its nlist), as for the gallery's default; HNSW takes ef >= k.
        self.search_ef: int | None = new_rows.settings.nprobe
        self._client = client
        self._owned = owned  # closed here only when not the gallery's
        super().__init__(model, gallery, ntotal)
        self.snapshot: MilvusView = MilvusView(self, 0, None)

    @classmethod
    def open(
        cls, new_rows: MilvusNewRows, model: ModelIdentity, gallery: str, ntotal: int, client: Any, *, owned: bool
    ) -> MilvusCollectionSegment:
        """The new collection beside the user's, refreshed once; one ArtifactError line for another model's."""
        segment = cls(new_rows, model, gallery, ntotal, client, owned=owned)
        try:
            segment.refresh()
        except BaseException:
            segment.close()
            raise
        return segment

    @classmethod
    def finished(cls, new_rows: MilvusNewRows, model: ModelIdentity) -> MilvusCollectionSegment:
        """After the cut-over: `model`'s rows for every item of the user's collection, else one ArtifactError line.

        The gallery it sat beside is not checked (it is retired): the model and the count are.
        """
        from service.index.milvus import connect

        settings = new_rows.settings
        token = settings.milvus_token.get_secret_value() if settings.milvus_token else None
        client = connect(str(settings.milvus_uri), token, settings.milvus_timeout_s)
        try:
            state = new_rows.state(client)
            if state is None or state.label is None:
                raise ArtifactError(f"{new_rows.where}: no nobackfill segment to cut over to")
            ntotal = new_rows.rows(client)
        except NobackfillError:
            client.close()
            raise
        except Exception as exc:  # pymilvus's and grpc's errors: the server is not there
            client.close()
            raise GalleryUnavailable(f"cannot reach Milvus for {new_rows.where}: {first_line(exc)}") from exc
        segment = cls.open(new_rows, model, state.label.gallery, ntotal, client, owned=True)
        moved = segment.snapshot.count
        if moved < ntotal:
            segment.close()
            raise ArtifactError(
                f"{new_rows.where} holds {moved:,} of the collection's {ntotal:,} rows ({moved / ntotal:.1%}); "
                "cut over (NOBACKFILL_OLD__BACKEND=none) once `nobackfill backfill status` says 100 %"
            )
        return segment

    @property
    def where(self) -> str:
        """The two collections (never the token)."""
        return self.rows.where

    def refresh(self) -> list[str]:
        """Check the collection (it may have been created since) and list its keys; [name] when rows arrived."""
        try:
            self._state = self.rows.checked(self._client, self._model, self._gallery)
            listed = self.rows.moved(self._client) if self._state is not None else np.zeros(0, np.int64)
        except NobackfillError:
            raise
        except Exception as exc:  # pymilvus's and grpc's errors
            raise GalleryUnavailable(f"the Milvus segment did not answer ({self.where}): {first_line(exc)}") from exc
        before = self.snapshot.count
        count = len(listed)  # the count and the exclusion from one listing: they never disagree
        self.snapshot = MilvusView(self, count, Exclusion(listed) if count else None)
        return [self.rows.name] if count != before else []

    def run(self, work: Callable[[MilvusNewRows, Any, CollectionState], T], empty: T) -> T:
        """work(rows, client, state); 503 (GalleryUnavailable) when Milvus does not answer."""
        state = self._state
        if state is None:  # not created yet: nothing has moved
            return empty
        try:
            return work(self.rows, self._client, state)
        except NobackfillError:
            raise
        except Exception as exc:  # pymilvus's and grpc's errors alike
            raise GalleryUnavailable(f"the Milvus segment did not answer ({self.where}): {first_line(exc)}") from exc

    def write(self, ids: I64, rows: F32, writer: str) -> None:
        """The cascade's rows into the collection; the service never creates it (no change without consent)."""
        if self._state is None:
            raise ArtifactError(f"{self.where}: not there yet; `nobackfill backfill run --add-collection` creates it")
        self.rows.write(self._client, ids, rows)
        log.debug("%s: %d rows written by %s", self.where, len(ids), writer)

    def describe(self) -> dict[str, Any]:
        """What /v1/info reports: the collection, the model and the coverage."""
        state = self._state
        return {
            "backend": self.backend,
            "collection": self.rows.name,
            "beside": self.rows.collection,
            "created": state is not None,
            "model": self._model.as_dict(),
            "moved": self.snapshot.count,
            "gallery_items": self._ntotal,
            "coverage": round(self.coverage, 6),
            "index": None if state is None else state.layout.index_type,
        }

    def close(self) -> None:
        """Close the client when it is this segment's own (after the cut-over); the gallery closes a shared one."""
        if self._owned:
            self._client.close()
