"""`--segment qdrant:VECTOR` / `qdrant-collection:NAME` for `backfill run|status|index|cutover` (commands/backfill.py).

A named vector of the collection the NOBACKFILL_INDEX__QDRANT_* settings name, or a second collection
beside it, as the service reads them (commands/store_segment.py's ClientSegmentCli: each call opens its
own client and closes it).
"""

from __future__ import annotations

from typing import Any

from service.commands.store_segment import ClientSegmentCli, named
from service.errors import InputError

QDRANT_PREFIX = "qdrant:"
QDRANT_COLLECTION_PREFIX = "qdrant-collection:"


class QdrantSegmentCli(ClientSegmentCli):
    """The new rows in Qdrant as the backfill commands see them."""

    store = "Qdrant"
    noun = "vector"
    leftover = "the old vectors stay until you delete them"
    nothing_to_run = "in the application"

    def __init__(self, name: str, side: bool) -> None:
        from service.segment.qdrant_rows import QdrantNewRows
        from service.settings import Settings

        self.settings = Settings().index  # NOBACKFILL_INDEX__QDRANT_URL / _PATH and _COLLECTION
        if self.settings.backend != "qdrant":
            raise InputError(
                f"--segment {QDRANT_COLLECTION_PREFIX if side else QDRANT_PREFIX}{name} is beside the Qdrant gallery: "
                "set NOBACKFILL_INDEX__BACKEND=qdrant and its NOBACKFILL_INDEX__QDRANT_* settings"
            )
        self.rows = QdrantNewRows(self.settings, name, side=side)
        self.where = self.rows.where

    def connect(self) -> Any:
        """A client (a local folder: this process's lock on it)."""
        from service.index.qdrant import client_of

        return client_of(self.settings)

    def gallery_class(self) -> Any:
        """The collection's old vector."""
        from service.index.qdrant import QdrantGallery

        return QdrantGallery

    def new_target(self, client: Any, add: bool) -> Any:
        """The named vector or second collection as backfill run's target."""
        from service.backfill.qdrant_target import QdrantVectorTarget

        return QdrantVectorTarget(self.rows, client, add=add)

    def missing(self) -> str:
        """--add-vector (--add-collection) adds it."""
        flag = self.rows.create_flag
        return f"{self.where}: not there yet (`backfill run --segment {self.rows.spec} {flag} ...` adds it)"

    def unlabelled(self) -> str:
        """No label in the collection's metadata."""
        return f"{self.where}: not added by nobackfill (no {self.rows.key!r} in the metadata)"

    def status_fields(self, state: Any) -> dict[str, Any]:  # noqa: ARG002 (Milvus's)
        """The collection holding the rows and how it is searched."""
        return {
            "collection": self.rows.rows_collection,
            "index": "exact (local mode)" if self.settings.qdrant_path else "Qdrant's HNSW (built by its optimizer)",
        }

    def index(self, m: int, ef_construction: int) -> str:  # noqa: ARG002 (pgvector's)
        """`backfill index`: Qdrant indexes a vector by itself; nothing to build."""
        return (
            f"{self.where}: Qdrant's optimizer builds the vector's HNSW index by itself once its segments pass "
            "indexing_threshold; nothing to build (local mode searches exactly)"
        )

    def cutover_module(self) -> Any:
        """backfill/qdrant_cutover.py: the alias operations (a second collection), or the `using` change in the
        application (a named vector)."""
        from service.backfill import qdrant_cutover

        return qdrant_cutover

    def has_call(self, planned: Any) -> bool:
        """The alias operations in one call; none for a named vector."""
        return bool(planned.actions)


def qdrant_segment(text: str) -> QdrantSegmentCli | None:
    """What `qdrant:VECTOR` / `qdrant-collection:NAME` names (None otherwise); InputError without a name."""
    found = named(text, ((QDRANT_COLLECTION_PREFIX, True), (QDRANT_PREFIX, False)), "embedding_v2")
    return None if found is None else QdrantSegmentCli(*found)
