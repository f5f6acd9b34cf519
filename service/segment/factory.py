"""`open_segment`: the configured new-model segment beside the gallery, as a SegmentStore (segment/base.py).

index.segment_dir               a folder of shards (segment/reader.py), beside any gallery
index.pgvector_new_column       a second column of the pgvector gallery's own table (segment/pgvector_column.py)
index.pgvector_new_table        a side table in the pgvector gallery's database (same module)
index.qdrant_new_vector         a named vector of the Qdrant gallery's own collection (segment/qdrant_vector.py)
index.qdrant_new_collection     a second collection beside it, same point ids (same module)
index.milvus_new_collection     a second collection beside the Milvus gallery, same keys (segment/milvus_collection.py)

`finished_in_store` opens a store's finished segment for the cut-over (NOBACKFILL_OLD__BACKEND=none).
"""

from __future__ import annotations

from typing import Any

from service.encoders.identity import ModelIdentity
from service.errors import SettingsError
from service.index.base import GalleryBackend
from service.segment.base import SegmentStore
from service.segment.layout import GalleryRef
from service.segment.reader import Indexing, Segment
from service.settings import IndexSettings


def indexing_of(index: IndexSettings) -> Indexing:
    """How a folder segment is searched (index.segment_exact, index.segment_ef_search)."""
    return Indexing(index.segment_exact, index.segment_ef_search)


def segment_configured(index: IndexSettings) -> bool:
    """Whether the settings name a segment (a folder, or new rows in the pgvector, Qdrant or Milvus store)."""
    named = (index.segment_dir, index.pgvector_new_column, index.pgvector_new_table)
    in_store = (index.qdrant_new_vector, index.qdrant_new_collection, index.milvus_new_collection)
    return any(n is not None for n in (*named, *in_store))


def open_segment(index: IndexSettings, model: ModelIdentity, gallery: GalleryBackend) -> SegmentStore | None:
    """The segment of `model` beside `gallery`, or None when the settings name none.

    One of another model or gallery is refused in one line (ArtifactError).
    """
    if index.pgvector_new_column is not None or index.pgvector_new_table is not None:
        if gallery.backend != "pgvector":  # its moved rows are left out by the table's own WHERE: same database only
            raise SettingsError(
                "NOBACKFILL_INDEX__PGVECTOR_NEW_COLUMN / _NEW_TABLE are in the pgvector gallery's database: "
                f"they need NOBACKFILL_INDEX__BACKEND=pgvector (the gallery is {gallery.backend})"
            )
        from service.segment.pgvector_column import PgvectorColumnSegment, new_rows_of

        new_rows = new_rows_of(index)
        assert new_rows is not None
        return PgvectorColumnSegment.open(new_rows, model, gallery.fingerprint, gallery.ntotal)
    if index.qdrant_new_vector is not None or index.qdrant_new_collection is not None:
        return _qdrant_segment(index, model, gallery)
    if index.milvus_new_collection is not None:
        return _milvus_segment(index, model, gallery)
    if index.segment_dir is None:
        return None
    beside = GalleryRef(gallery.fingerprint, gallery.ntotal)
    return Segment.beside(index.segment_dir, model, beside, indexing_of(index))


def _qdrant_segment(index: IndexSettings, model: ModelIdentity, gallery: GalleryBackend) -> SegmentStore:
    """The new vector (or second collection) beside the Qdrant gallery: its moved points are left out by the
    collection's own filter, on the gallery's client (local mode lets one client open a folder)."""
    from service.index.qdrant import QdrantGallery
    from service.segment.qdrant_rows import new_rows_of
    from service.segment.qdrant_vector import QdrantVectorSegment

    beside = (
        "NOBACKFILL_INDEX__QDRANT_NEW_VECTOR / _NEW_COLLECTION are beside the Qdrant gallery's collection: "
        "they need NOBACKFILL_INDEX__BACKEND=qdrant"
    )
    return _on_the_gallery_client(QdrantVectorSegment, new_rows_of(index), model, gallery, QdrantGallery, beside)


def _milvus_segment(index: IndexSettings, model: ModelIdentity, gallery: GalleryBackend) -> SegmentStore:
    """The second collection beside the Milvus gallery: its moved ids are left out by the collection's
    over-fetch, on the gallery's client (one gRPC channel; an embedded ./x.db is this process's own server)."""
    from service.index.milvus import MilvusGallery
    from service.segment.milvus_collection import MilvusCollectionSegment
    from service.segment.milvus_rows import new_rows_of

    beside = (
        "NOBACKFILL_INDEX__MILVUS_NEW_COLLECTION is beside the Milvus gallery's collection: "
        "it needs NOBACKFILL_INDEX__BACKEND=milvus"
    )
    return _on_the_gallery_client(MilvusCollectionSegment, new_rows_of(index), model, gallery, MilvusGallery, beside)


def _on_the_gallery_client(
    segment_class: Any, new_rows: Any, model: ModelIdentity, gallery: GalleryBackend, gallery_class: type, beside: str
) -> SegmentStore:
    """A client store's segment (segment/in_store.py's ClientSegment) opened on its gallery's own client."""
    if not isinstance(gallery, gallery_class):
        raise SettingsError(f"{beside} (the gallery is {gallery.backend})")
    assert new_rows is not None  # the settings named the segment: that is why this store was chosen
    client = gallery.client  # type: ignore[attr-defined]  # a Qdrant or Milvus gallery's (checked above)
    opened: SegmentStore = segment_class.open(new_rows, model, gallery.fingerprint, gallery.ntotal, client, owned=False)
    return opened


def finished_in_store(index: IndexSettings, model: ModelIdentity) -> tuple[SegmentStore, str] | None:
    """After the cut-over: the store's finished segment and the gallery it replaced; None for a segment folder.

    Refused in one line (ArtifactError) unless it is `model`'s and every item has its new row.
    """
    from service.segment import milvus_rows, pgvector_column, qdrant_rows

    pgvector = pgvector_column.new_rows_of(index)  # a column or side table of the pgvector database
    if pgvector is not None:
        done = pgvector_column.PgvectorColumnSegment.finished(pgvector, model)
        return done, done.replaced
    qdrant = qdrant_rows.new_rows_of(index) if index.backend == "qdrant" else None
    if qdrant is not None:  # a named vector of the collection, or the second collection
        from service.segment.qdrant_vector import QdrantVectorSegment

        finished = QdrantVectorSegment.finished(qdrant, model)
        return finished, finished.replaced
    milvus = milvus_rows.new_rows_of(index) if index.backend == "milvus" else None
    if milvus is not None:  # the second collection
        from service.segment.milvus_collection import MilvusCollectionSegment

        whole = MilvusCollectionSegment.finished(milvus, model)
        return whole, whole.replaced
    return None
