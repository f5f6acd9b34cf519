"""`--segment pgvector:COLUMN` / `pgvector-table:TABLE` for `backfill run|status|index|cutover` (commands/backfill.py).

The segment is a new column of the pgvector table the settings name (NOBACKFILL_INDEX__PGVECTOR_DSN,
NOBACKFILL_INDEX__PGVECTOR_TABLE), as the service reads them, or a side table of nobackfill's own in that
database.  The same face as the other stores' (commands/store_segment.py).
"""

from __future__ import annotations

import time
from typing import Any

from service.commands.store_segment import named
from service.errors import InputError

PGVECTOR_PREFIX = "pgvector:"
PGVECTOR_TABLE_PREFIX = "pgvector-table:"


class PgvectorSegmentCli:
    """The new column (or side table) as the backfill commands see it."""

    noun = "column"  # (a side table's instance says "side table")

    def __init__(self, name: str, side: bool) -> None:
        from service.segment.pgvector_column import PgvectorColumn
        from service.settings import Settings

        self.settings = Settings().index  # NOBACKFILL_INDEX__PGVECTOR_DSN and _TABLE, as the service reads them
        self.column = PgvectorColumn(self.settings, name, side=side)
        self.where = self.column.where
        self.noun = "side table" if side else "column"  # in status's lines

    def exists(self) -> bool:
        """Whether the column (side table) is there."""
        with self.column.connect() as conn:
            return self.column.state(conn) is not None

    def gallery_ref(self) -> Any:
        """The table's old column as the gallery the segment sits beside (opened as the service opens it)."""
        from service.index.pgvector import PgvectorGallery
        from service.segment.layout import GalleryRef

        gallery = PgvectorGallery.open(self.settings)
        gallery.close()
        return GalleryRef(gallery.fingerprint, gallery.ntotal)

    def target(self, add: bool) -> Any:
        """backfill run's target."""
        from service.backfill.pgvector_target import PgvectorColumnTarget

        return PgvectorColumnTarget(self.column, add=add)

    def moved(self) -> int:
        """Rows moved now."""
        with self.column.connect() as conn:
            return self.column.count(conn) if self.column.state(conn) is not None else 0

    def status(self, hits: Any) -> dict[str, Any]:
        """`backfill status`'s report."""
        from service.backfill.status import column_status

        return column_status(self.column, hits)

    def index(self, m: int, ef_construction: int) -> str:
        """`backfill index`: CREATE INDEX CONCURRENTLY on the column (HNSW, inner product), never implicitly."""
        started = time.perf_counter()
        with self.column.connect(read_only=False) as conn:
            if self.column.state(conn) is None:
                raise InputError(f"{self.where}: no such column (`backfill run --add-column` adds it)")
            name = self.column.create_index(conn, m, ef_construction)
        return (
            f"index {name} on {self.where}: HNSW (m {m}, ef_construction {ef_construction}, inner product), "
            f"built concurrently in {time.perf_counter() - started:.1f} s; the service uses it from its next refresh"
        )

    def cutover(self, apply: bool, how: str, view: str | None, alias: str | None) -> list[str]:  # noqa: ARG002
        """The cut-over's SQL, in one transaction (--apply runs it); `alias` is Qdrant's and Milvus's."""
        from service.backfill.pgvector_cutover import apply_cutover, plan_cutover

        with self.column.connect(read_only=not apply) as conn:
            planned = plan_cutover(self.column, conn, how, view)
            if apply:
                apply_cutover(conn, planned)
        verb = "applied, in one transaction" if apply else "to run in one transaction (--apply runs it)"
        return [
            f"-- {self.where}: the cut-over, {verb}",
            "BEGIN;",
            *(f"{statement};" for statement in planned.statements),
            "COMMIT;",
            f"-- then {planned.after}",
            f"-- the old vectors stay until you drop them: {planned.drop_later};",
        ]


def pgvector_segment(text: str) -> PgvectorSegmentCli | None:
    """What `pgvector:COLUMN` / `pgvector-table:TABLE` names (None otherwise); InputError without a name."""
    found = named(text, ((PGVECTOR_PREFIX, False), (PGVECTOR_TABLE_PREFIX, True)), "embedding_v2")
    return None if found is None else PgvectorSegmentCli(*found)
