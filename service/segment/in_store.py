"""What every segment kept in the user's own store says of itself: a pgvector column or side table, a Qdrant
named vector or collection, a Milvus collection.

Such a segment is one part (the column, the vector), refused whole at open when it is another model's,
and counts its moved rows in the store at each refresh; the model, the gallery it sits beside and the
gallery's size are fixed when it opens.  Each store's module keeps only what differs: how it checks,
counts, searches and writes (segment/pgvector_column.py, segment/qdrant_vector.py,
segment/milvus_collection.py).  A Qdrant or Milvus segment records whose rows it holds in a StoreLabel
(the collection's metadata or properties), so another model's rows are refused in one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from service.encoders.identity import ModelIdentity
from service.index.base import Exclusion, Hits
from service.rows import F32, I64
from service.segment.base import SegmentView


@dataclass(frozen=True)
class StoreLabel:
    """What a store's metadata records of the new rows: the new model, and the gallery (old rows) they sit beside."""

    model: ModelIdentity
    gallery: str  # the gallery's fingerprint

    def value(self) -> dict[str, Any]:
        """The metadata value (JSON)."""
        return {"model": self.model.as_dict(), "gallery": self.gallery}

    @classmethod
    def parse(cls, value: Any, where: str) -> StoreLabel | None:
        """The label in a metadata value; None when it is not nobackfill's."""
        if isinstance(value, str):  # a label written as text (Milvus's properties are strings; or by hand)
            try:
                value = json.loads(value)
            except ValueError:
                return None
        if not isinstance(value, dict) or not isinstance(value.get("model"), dict):
            return None
        return cls(ModelIdentity.from_dict(value["model"], where), str(value.get("gallery", "")))


S = TypeVar("S")  # the store's description of the part (its dim, label, index), None until it exists


class InStoreSegment(Generic[S]):
    """The SegmentStore properties (segment/base.py) a segment in the user's store shares with every other."""

    snapshot: SegmentView

    def __init__(self, model: ModelIdentity, gallery: str, ntotal: int) -> None:
        self._model = model
        self._gallery = gallery  # the fingerprint of the gallery (the old rows) it was filled beside
        self._ntotal = ntotal
        self._state: S | None = None  # None until the part exists in the store

    @property
    def replaced(self) -> str:
        """The fingerprint of the gallery this segment was filled beside (what the cut-over retires)."""
        return self._gallery

    @property
    def model(self) -> ModelIdentity:
        """The new model."""
        return self._model

    @property
    def dim(self) -> int:
        """The new model's width."""
        return self._model.dim

    @property
    def gallery_items(self) -> int:
        """Rows (points) of the gallery."""
        return self._ntotal

    @property
    def coverage(self) -> float:
        """Share of the gallery's rows that have moved (at the last refresh)."""
        return self.snapshot.count / self._ntotal

    @property
    def parts(self) -> int:
        """One part (a column, a vector, a collection), once it exists."""
        return int(self._state is not None)

    @property
    def refused(self) -> dict[str, str]:
        """One part has no parts to refuse one by one: a wrong one is refused whole, at open."""
        return {}


@dataclass(frozen=True)
class InStoreView:
    """A segment in the user's store as one request reads it (segment/base.py's SegmentView): live calls to the
    store, and the count of the last refresh.

    `segment` runs work(rows, connection, state) on its connection (`run`, empty before the part exists) and
    says the new model's `dim` and the index's `search_ef`; every store's rows answer `search`,
    `moved_among` and `rows_of` with the same signatures.
    """

    segment: Any
    moved_count: int
    exclusion: Exclusion | None

    @property
    def count(self) -> int:
        """Moved items at the last refresh."""
        return self.moved_count

    def search(self, queries: F32, k: int) -> Hits:
        """Top-k over the moved rows (none before the part exists)."""
        nothing = (np.full((len(queries), k), -np.inf, np.float32), np.full((len(queries), k), -1, np.int64))
        ef = self.segment.search_ef
        hits: Hits = self.segment.run(lambda rows, conn, state: rows.search(conn, state, queries, k, ef), empty=nothing)
        return hits

    def contains(self, ids: I64) -> npt.NDArray[np.bool_]:
        """Which of `ids` have moved."""
        found: npt.NDArray[np.bool_] = self.segment.run(
            lambda rows, conn, _: rows.moved_among(conn, ids), empty=np.zeros(len(ids), bool)
        )
        return found

    def rows_of(self, ids: I64) -> tuple[npt.NDArray[np.bool_], F32]:
        """Which of `ids` have moved, and their new rows."""
        dim = self.segment.dim
        nothing = (np.zeros(len(ids), dtype=bool), np.zeros((len(ids), dim), dtype=np.float32))
        rows: tuple[npt.NDArray[np.bool_], F32] = self.segment.run(
            lambda store, conn, _: store.rows_of(conn, ids, dim), empty=nothing
        )
        return rows
