"""`QdrantNewRows`: where the new model's rows live in Qdrant, shared by the service's segment and `backfill run`.

    vector      NOBACKFILL_INDEX__QDRANT_NEW_VECTOR=embedding_v2      a named vector of the user's collection
    collection  NOBACKFILL_INDEX__QDRANT_NEW_COLLECTION=products_v2   a collection of nobackfill's own, same ids

A point has moved when it has its new row: for a named vector, when the point *has the vector*
(Qdrant's `has_vector` condition, no payload flag to keep in step); for a second collection, when the
point is there.  That is the one definition of "moved" for the service, `backfill run`, `backfill
status` and the cut-over, read from Qdrant itself.

The named vector is added by `backfill run --add-vector` (`create_vector_name`: Qdrant >= 1.18, and
qdrant-client's local mode) and labelled in the collection's metadata, under the key
`nobackfill:<vector>`, with the new model's identity and the gallery it sits beside, as pgvector's
column comment does: a vector of another model, or one nobackfill did not add, is refused in one line.
The second collection (`--add-collection`, for a server older than 1.18, or to leave the user's
collection unwritten) is created with the old vector's name and Cosine, so an alias switched to it
serves the user's application with the same `using`; its label is in its own metadata.  Each point
carries the payload it had in the user's collection when it was copied: a payload edited there later
is not followed (the named vector has no such gap; docs/stores.md).

Writes set a point's row only where it is not set yet (`update_filter` must_not has_vector): the first
writer's row stays, so `backfill run` and the cascade writer never race a row into two values, and a
re-run re-sends nothing that landed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from service.encoders.identity import ModelIdentity
from service.errors import ArtifactError, InputError
from service.index.base import Hits, InTable
from service.index.qdrant import DISTANCES, as_hits, query_batch
from service.rows import F32, I64
from service.segment.in_store import StoreLabel, placed_rows, refuse_unless_ours

if TYPE_CHECKING:
    from service.settings import IndexSettings

log = logging.getLogger("nobackfill.segment")

LABEL = "nobackfill"  # the metadata key's prefix: nobackfill:<new vector or collection>
SCROLL_PAGE = 10_000


@dataclass(frozen=True)
class VectorState:
    """The new vector as the collection describes it: its dim, label and distance."""

    dim: int
    label: StoreLabel | None
    metric: str


class QdrantNewRows:
    """The new rows in Qdrant, in the client's calls: shared by the service's segment and `backfill run`.

    side False: a named vector `name` of the gallery's collection, set on each moved point (update_vectors).
    side True: a collection `name` of nobackfill's own, one point per moved item under the same id (upsert):
    the user's collection is never written.
    """

    def __init__(self, settings: IndexSettings, name: str, *, side: bool = False) -> None:
        if not settings.qdrant_collection:
            raise InputError("a Qdrant segment needs NOBACKFILL_INDEX__QDRANT_COLLECTION")
        self.settings = settings
        self.collection = settings.qdrant_collection
        self.old_vector = settings.qdrant_vector
        self.name = name
        self.side = side
        self.rows_collection = name if side else self.collection
        # The vector the rows are under: the old one's name in a collection of our own (an alias to it then
        # serves the application's queries unchanged), the new name in the user's collection.
        self.vector: str | None = self.old_vector if side else name
        self.key = f"{LABEL}:{name}"
        self.spec = f"qdrant-collection:{name}" if side else f"qdrant:{name}"  # as --segment names it
        self.where = (
            f"Qdrant collection {name} (beside {self.collection})"
            if side
            else f"Qdrant collection {self.collection}, vector {name}"
        )

    @property
    def create_flag(self) -> str:
        """The `backfill run` flag that makes the rows' place: a second collection is created, a named vector added."""
        return "--add-collection" if self.side else "--add-vector"

    def unmoved(self) -> InTable | None:
        """What the gallery's search filters on to leave the moved points out (None: by listed ids instead)."""
        return None if self.side else InTable("vector", self.name)

    def moved_filter(self) -> Any:
        """Points that have their new row (None in a collection of our own: every point there has)."""
        from qdrant_client import models

        return None if self.side else models.Filter(must=[models.HasVectorCondition(has_vector=self.name)])

    def unset_filter(self) -> Any:
        """Points whose new row is not set yet: a write's update_filter, so the first writer's row stays."""
        from qdrant_client import models

        return models.Filter(must_not=[models.HasVectorCondition(has_vector=self.vector or "")])

    def state(self, client: Any) -> VectorState | None:
        """The vector's dim, label and distance; None when it (or the second collection) is not there yet."""
        if not client.collection_exists(self.rows_collection):
            if self.side:
                return None
            raise ArtifactError(f"{self.where}: no collection {self.collection!r}")
        config = client.get_collection(self.rows_collection).config
        vectors = config.params.vectors
        if isinstance(vectors, dict):
            params = vectors.get(self.vector or "")
        else:
            params = vectors if not self.vector else None
        if params is None:
            if self.side:
                raise ArtifactError(f"{self.where}: the collection has no vector {self.vector or '(default)'!r}")
            return None
        distance = str(getattr(params.distance, "value", params.distance))
        if distance not in DISTANCES:
            raise ArtifactError(f"{self.where}: distance {distance}; the new rows rank by Cosine, Dot or Euclid")
        label = StoreLabel.parse((config.metadata or {}).get(self.key), self.where)
        return VectorState(int(params.size), label, DISTANCES[distance])

    def checked(self, client: Any, model: ModelIdentity, gallery: str) -> VectorState | None:
        """state(), refused in one line unless the rows are nobackfill's, of `model`, beside `gallery`."""
        state = self.state(client)
        if state is None:
            return None
        what = "collection" if self.side else "vector"
        unlabelled = (
            f"{self.where}: the {what} exists but was not added by nobackfill (no {self.key!r} in the "
            f"collection's metadata); name a new {what} in NOBACKFILL_INDEX__QDRANT_NEW_{what.upper()}"
        )
        refuse_unless_ours(self.where, state.label, state.dim, model, gallery, unlabelled=unlabelled, noun=what)
        return state

    def add(self, client: Any, model: ModelIdentity, gallery: str) -> None:
        """Create the named vector (or the second collection) with its label; a no-op once it is there."""
        from qdrant_client import models

        if self.checked(client, model, gallery) is not None:
            return
        label = {self.key: StoreLabel(model, gallery).value()}
        if self.side:
            params = models.VectorParams(size=model.dim, distance=models.Distance.COSINE)
            client.create_collection(
                self.rows_collection,
                vectors_config={self.vector: params} if self.vector else params,
                metadata=label,
            )
        else:
            # The label first: a vector that exists is then always a labelled one, even if the run dies here.
            client.update_collection(self.collection, metadata=label)
            config = models.DenseVectorConfig(size=model.dim, distance=models.Distance.COSINE)
            client.create_vector_name(self.collection, self.name, models.DenseVectorNameConfig(dense=config))
        log.info("%s: added for %s", self.where, model.model_id)

    def rows(self, client: Any) -> int:
        """Points of the gallery's collection (its items)."""
        return int(client.count(self.collection, exact=True).count)

    def count(self, client: Any) -> int:
        """Points that have their new row."""
        return int(client.count(self.rows_collection, count_filter=self.moved_filter(), exact=True).count)

    def moved(self, client: Any) -> I64:
        """Every moved id, ascending (scrolled, ids only)."""
        found: list[int] = []
        offset = None
        while True:
            points, offset = client.scroll(
                self.rows_collection,
                scroll_filter=self.moved_filter(),
                limit=SCROLL_PAGE,
                offset=offset,
                with_payload=False,
                with_vectors=False,
            )
            found.extend(int(p.id) for p in points)
            if offset is None:
                return np.unique(np.array(found, dtype=np.int64))

    def moved_among(self, client: Any, ids: I64) -> npt.NDArray[np.bool_]:
        """Which of `ids` have moved (one retrieve by id)."""
        return self.rows_of(client, ids, 0)[0]

    def rows_of(self, client: Any, ids: I64, dim: int) -> tuple[npt.NDArray[np.bool_], F32]:
        """Which of `ids` have moved, and their new rows (zero elsewhere; a point without the vector is not moved)."""
        name = self.vector or ""

        def fetch() -> Iterator[tuple[Any, Any]]:
            points = client.retrieve(self.rows_collection, ids=ids.tolist(), with_payload=False, with_vectors=[name])
            return ((p.id, p.vector.get(name) if isinstance(p.vector, dict) else p.vector) for p in points)

        return placed_rows(ids, dim, fetch)

    def write(self, client: Any, ids: I64, rows: F32) -> int:
        """Set the new row of `ids` where it is not set yet (the first writer's row stays); the rows sent."""
        from qdrant_client import models

        if not len(ids):
            return 0
        name = self.vector or ""
        if self.side:
            # Each point's payload comes along from the user's collection, so the alias of the cut-over serves
            # whole points (as they were when copied: a later payload edit there is not followed here).
            payloads = {
                int(p.id): p.payload
                for p in client.retrieve(self.collection, ids=ids.tolist(), with_payload=True, with_vectors=False)
            }
            points = [
                models.PointStruct(
                    id=int(i), vector={name: row.tolist()} if name else row.tolist(), payload=payloads.get(int(i))
                )
                for i, row in zip(ids.tolist(), rows, strict=True)
            ]
            client.upsert(self.rows_collection, points=points, update_filter=self.unset_filter(), wait=True)
        else:
            vectors = [
                models.PointVectors(id=int(i), vector={name: row.tolist()})
                for i, row in zip(ids.tolist(), rows, strict=True)
            ]
            client.update_vectors(self.collection, points=vectors, update_filter=self.unset_filter(), wait=True)
        return len(ids)

    def search(self, client: Any, state: VectorState, queries: F32, k: int, hnsw_ef: int | None) -> Hits:
        """Top-k of the moved points by Qdrant's index on the vector, as cosines: (scores, ids; -inf / -1 pad)."""
        ef = max(hnsw_ef, k) if hnsw_ef else None
        answers = query_batch(
            client, self.rows_collection, queries, k, using=self.vector, only=self.moved_filter(), hnsw_ef=ef
        )
        return as_hits(answers, len(queries), k, state.metric)


def new_rows_of(settings: IndexSettings) -> QdrantNewRows | None:
    """The new rows the settings name: a named vector (qdrant_new_vector), a collection (qdrant_new_collection)."""
    if settings.qdrant_new_collection is not None:
        return QdrantNewRows(settings, settings.qdrant_new_collection, side=True)
    if settings.qdrant_new_vector is not None:
        return QdrantNewRows(settings, settings.qdrant_new_vector)
    return None
