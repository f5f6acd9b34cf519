"""`backfill run` into the pgvector database (segment/pgvector_column.py), as a BackfillTarget.

    nobackfill backfill run --segment pgvector:embedding_v2 --add-column ...    a column of the table
    nobackfill backfill run --segment pgvector-table:items_v2 --add-table ...  a side table of our own

Each publish is one transaction that sets the new rows of a batch where they are not set yet, so a
run killed at any moment loses at most the batch in flight, and a re-run skips every row already set
(resumable and idempotent, like a folder's shards).  The column (or side table) is created only with
--add-column (--add-table): a nullable column is a catalogue change under a brief lock
(lock_timeout bounds the wait), never a table rewrite.  One run at a time: a session advisory lock
keyed by where the rows go (shared by the parts of `--part I/N`, each part exclusive on its own
key); it goes with the connection, so a run killed with -9 never leaves it held.  No index is built
here: `backfill index` creates one, on demand.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from service.backfill.targets import BatchTarget
from service.encoders.identity import ModelIdentity
from service.errors import InputError
from service.index.pgvector import ThreadConnections, dsn_of
from service.rows import F32, I64
from service.segment.layout import GalleryRef
from service.segment.pgvector_column import PgvectorColumn

if TYPE_CHECKING:
    from service.backfill.run import Part


class PgvectorColumnTarget(BatchTarget):
    """The new column of the table the settings name."""

    def __init__(self, new_rows: PgvectorColumn, *, add: bool) -> None:
        super().__init__(new_rows.where, add=add)
        self.column = new_rows
        self._connections = ThreadConnections(dsn_of(new_rows.settings), read_only=False)  # run thread, writer's

    def prepare(self, model: ModelIdentity, gallery: GalleryRef) -> None:
        """Check the column is this model's beside this gallery; add it with --add-column, else refuse in one line."""
        conn = self.column.connect(read_only=False)
        try:
            if self.column.checked(conn, model, gallery.fingerprint) is not None:
                return
            if not self.add and self.column.side:
                raise InputError(
                    f"{self.where}: no such table; pass --add-table to create it "
                    f"(CREATE TABLE {self.column.column} (id bigint PRIMARY KEY, embedding vector({model.dim})))"
                )
            if not self.add:
                raise InputError(
                    f"{self.where}: no such column; pass --add-column to add it "
                    f"(ALTER TABLE ... ADD COLUMN {self.column.column} vector({model.dim}): nullable, no rewrite)"
                )
            self.column.add(conn, model, gallery.fingerprint)
        finally:
            conn.close()

    @contextmanager
    def locked(self, part: Part | None) -> Iterator[None]:
        """A session advisory lock (shared by parts, plus each part's own); InputError when another run holds it."""
        conn = self.column.connect()
        key = f"nobackfill:{self.column.rows_table}.{self.column.new_vec}"
        try:
            take = "pg_try_advisory_lock" if part is None else "pg_try_advisory_lock_shared"
            if not conn.execute(f"SELECT {take}(hashtext(%s))", (key,)).fetchone()[0]:
                what = "a `backfill run`" if part is None else "a whole `backfill run` (not a part)"
                raise InputError(f"{self.where}: {what} is moving items into it; wait for it or stop it")
            if (
                part is not None
                and not conn.execute(
                    "SELECT pg_try_advisory_lock(hashtext(%s))", (f"{key}:part-{part.index}-of-{part.count}",)
                ).fetchone()[0]
            ):
                raise InputError(f"{self.where}: part {part} is being moved by another run; each part runs once")
            yield
        finally:
            conn.close()  # session locks go with the connection

    def moved(self) -> I64:
        """Every id whose column is set, sorted."""
        return self.column.moved(self._connections.get())

    def moved_among(self, ids: I64) -> npt.NDArray[np.bool_]:
        """Which of `ids` are set by now (one lookup by id)."""
        return self.column.moved_among(self._connections.get(), ids)

    def publish(self, ids: I64, rows: F32) -> None:
        """One transaction setting the column of `ids` where it is NULL."""
        self.column.write(self._connections.get(), ids, rows)

    def close(self) -> None:
        """Close the connections."""
        self._connections.close()
