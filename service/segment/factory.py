"""`open_segment`: the configured new-model segment beside the gallery, as a SegmentStore (segment/base.py).

index.segment_dir               a folder of shards (segment/reader.py), beside any gallery
index.pgvector_new_column       a second column of the pgvector gallery's own table (segment/pgvector_column.py)
"""

from __future__ import annotations

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
    """Whether the settings name a segment (a folder, or a column of the pgvector table)."""
    return (
        index.segment_dir is not None or index.pgvector_new_column is not None or index.pgvector_new_table is not None
    )


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
    if index.segment_dir is None:
        return None
    beside = GalleryRef(gallery.fingerprint, gallery.ntotal)
    return Segment.beside(index.segment_dir, model, beside, indexing_of(index))
