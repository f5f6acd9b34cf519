"""The segment interface: the new-model rows of the items moved so far, wherever a store keeps them.

    SegmentStore (protocol)
    ├── Segment                  segment/reader.py             a folder of shards (and sealed indexes), in memory
    ├── PgvectorColumnSegment    segment/pgvector_column.py    a second vector column (or side table) of pgvector
    ├── QdrantVectorSegment      segment/qdrant_vector.py      a named vector (or second collection) in Qdrant
    └── MilvusCollectionSegment  segment/milvus_collection.py  a second collection beside the Milvus gallery

`segment/factory.py` opens the configured one.  The query path (hybrid, `new`, the cascade), the
cascade's writer and the metrics see only this interface, so a store adds one module here and its
settings, and nothing on the query path changes.

A request reads one `SegmentView` (`store.snapshot`): what it searches in the new space, which of
the old gallery's ids it leaves out (`exclusion`, which the gallery's search understands), and the new
rows the cascade re-ranks with.  A view never changes under a request; `refresh()` makes the next one.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from service.encoders.identity import ModelIdentity
from service.index.base import Exclusion, Hits
from service.rows import F32, I64


class SegmentView(Protocol):
    """One consistent state of a segment: what a request searches and skips."""

    @property
    def exclusion(self) -> Exclusion | None:
        """What the old gallery's search skips (the moved items); None while nothing has moved."""
        ...

    @property
    def count(self) -> int:
        """Moved items (distinct ids)."""
        ...

    def search(self, queries: F32, k: int, ef_search: int | None = None) -> Hits:
        """Top-k inner products of unit new-model queries over the moved items: (scores, ids; -inf / -1 pad).

        ef_search: how wide a graph index over them searches for this call (a request's); None: the
        segment's own setting.  An exact search, or an index with no such width, ignores it.
        """
        ...

    def contains(self, ids: I64) -> npt.NDArray[np.bool_]:
        """Which of `ids` have moved."""
        ...

    def rows_of(self, ids: I64) -> tuple[npt.NDArray[np.bool_], F32]:
        """Which of `ids` have moved, and the new-model row of each (zero where not moved)."""
        ...


class SegmentStore(Protocol):
    """The new-model segment beside the frozen gallery, as the service reads and writes it."""

    backend: str

    @property
    def where(self) -> str:
        """Where it lives, for a log line (a folder, a table's column); never a secret."""
        ...

    @property
    def model(self) -> ModelIdentity:
        """The new model whose rows it holds."""
        ...

    @property
    def dim(self) -> int:
        """The new model's width."""
        ...

    @property
    def gallery_items(self) -> int:
        """Items of the gallery it sits beside (coverage's denominator)."""
        ...

    @property
    def snapshot(self) -> SegmentView:
        """The current view (a request holds the one it started with)."""
        ...

    @property
    def coverage(self) -> float:
        """Share of the gallery's items that have moved."""
        ...

    @property
    def parts(self) -> int:
        """Units served (shards, or 1 for a column): the segment_shards metric."""
        ...

    @property
    def refused(self) -> dict[str, str]:
        """Parts refused as damaged -> why (their items stay on the old gallery)."""
        ...

    def refresh(self) -> list[str]:
        """Read what other writers published since the last refresh; the names of the parts newly served."""
        ...

    def write(self, ids: I64, rows: F32, writer: str) -> None:
        """Publish unit rows for `ids` (the cascade writer's call); a reader sees them after its next refresh."""
        ...

    def describe(self) -> dict[str, Any]:
        """What /v1/info reports about the segment (JSON-ready)."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...
