"""What every segment kept in the user's own store says of itself: a pgvector column or side table, a Qdrant
named vector or collection.

Such a segment is one part (the column, the vector), refused whole at open when it is another model's,
and counts its moved rows in the store at each refresh; the model, the gallery it sits beside and the
gallery's size are fixed when it opens.  Each store's module keeps only what differs: how it checks,
counts, searches and writes (segment/pgvector_column.py, segment/qdrant_vector.py).
"""

from __future__ import annotations

from typing import Generic, TypeVar

from service.encoders.identity import ModelIdentity
from service.segment.base import SegmentView

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
