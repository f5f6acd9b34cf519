"""`--segment milvus-collection:NAME` for `backfill run|status|index|cutover` (commands/backfill.py).

A second collection beside the one the NOBACKFILL_INDEX__MILVUS_* settings name, as the service reads
them (commands/store_segment.py's ClientSegmentCli: each call opens its own client and closes it).
"""

from __future__ import annotations

from typing import Any

from service.commands.store_segment import ClientSegmentCli, named
from service.errors import InputError

MILVUS_COLLECTION_PREFIX = "milvus-collection:"


class MilvusSegmentCli(ClientSegmentCli):
    """The new collection in Milvus as the backfill commands see it."""

    store = "Milvus"
    noun = "collection"
    leftover = "the old collection stays until you drop it"

    def __init__(self, name: str) -> None:
        from service.segment.milvus_rows import MilvusNewRows
        from service.settings import Settings

        self.settings = Settings().index  # NOBACKFILL_INDEX__MILVUS_URI, _COLLECTION and _TOKEN
        if self.settings.backend != "milvus":
            raise InputError(
                f"--segment {MILVUS_COLLECTION_PREFIX}{name} is beside the Milvus gallery: "
                "set NOBACKFILL_INDEX__BACKEND=milvus and its NOBACKFILL_INDEX__MILVUS_* settings"
            )
        self.rows = MilvusNewRows(self.settings, name)
        self.where = self.rows.where

    def connect(self) -> Any:
        """A client (GalleryUnavailable in one line when nobody answers)."""
        from service.segment.milvus_collection import MilvusCollectionSegment

        return MilvusCollectionSegment.connect(self.settings)

    def gallery_class(self) -> Any:
        """The user's collection."""
        from service.index.milvus import MilvusGallery

        return MilvusGallery

    def new_target(self, client: Any, add: bool) -> Any:
        """A second collection as backfill run's target."""
        from service.backfill.milvus_target import MilvusCollectionTarget

        return MilvusCollectionTarget(self.rows, client, add=add)

    def missing(self) -> str:
        """--add-collection creates it."""
        spec = self.rows.spec
        return f"{self.where}: not there yet (`backfill run --segment {spec} --add-collection ...` creates it)"

    def unlabelled(self) -> str:
        """No label property."""
        return f"{self.where}: not created by nobackfill (no 'nobackfill.segment' property)"

    def status_fields(self, state: Any) -> dict[str, Any]:
        """The collection and Milvus's index on it."""
        return {
            "collection": self.rows.name,
            "index": f"Milvus's {state.layout.index_type} ({state.layout.metric}, built by Milvus)",
        }

    def index(self, m: int, ef_construction: int) -> str:  # noqa: ARG002 (pgvector's)
        """`backfill index`: Milvus indexes the collection by itself; nothing to build."""
        return (
            f"{self.where}: Milvus builds the collection's index (the type of {self.rows.collection}'s) on each "
            "sealed segment by itself; nothing to build"
        )

    def cutover_module(self) -> Any:
        """backfill/milvus_cutover.py: one alias call."""
        from service.backfill import milvus_cutover

        return milvus_cutover

    def has_call(self, planned: Any) -> bool:
        """None when the alias already reads the new collection."""
        return planned.call is not None


def milvus_segment(text: str) -> MilvusSegmentCli | None:
    """What `milvus-collection:NAME` names (None otherwise); InputError without a name."""
    found = named(text, ((MILVUS_COLLECTION_PREFIX, True),), "items_v2")
    return None if found is None else MilvusSegmentCli(found[0])
