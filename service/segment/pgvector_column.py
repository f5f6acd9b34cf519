"""`PgvectorColumnSegment`: the new-model segment as a second vector column of the user's pgvector table.

    NOBACKFILL_INDEX__BACKEND=pgvector                 (the gallery: the table's old column)
    NOBACKFILL_INDEX__PGVECTOR_NEW_COLUMN=embedding_v2  (the segment: a vector(d) column beside it)

A row has moved when its new column is set; that is the one definition of "moved" for the service,
`backfill run`, `backfill status` and the cut-over, read from the table itself.  Why a column of the
user's table and not a side table: after the cut-over the user's application reads the new vectors
where it read the old ones (one rename, `backfill cutover`), with the same ids, rows and permissions,
and pgvector's own index on the column serves it with or without nobackfill in front.

The column is added by `backfill run --add-column` (a nullable column: a catalogue change under a
short lock, no table rewrite) and labelled with a `COMMENT ON COLUMN` that records the new model's
identity and the gallery it sits beside, so the service refuses a column of another model in one line,
as it refuses another model's segment folder.  A column that exists without that label is not ours,
and is refused too.  Until the column exists the segment serves as empty, and each refresh looks again.

Reads are live, not a snapshot in memory: hybrid's two searches run at once, the gallery's over the
rows whose new column is NULL and this one over the rest, so a row written between them may be
answered by both lists (hybrid's merge keeps it once) or, for that one request, by neither.  The
count (coverage) is read at each refresh.  A search failure answers 503 (the store is down), as the
gallery's does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt

from service.encoders.identity import ModelIdentity
from service.errors import ArtifactError, GalleryUnavailable, InputError
from service.index.base import Exclusion, Hits, InTable, first_line
from service.index.pgvector import (
    OPERATORS,
    ThreadConnections,
    connect,
    dsn_of,
    index_on,
    ranked,
    table_identifier,
)
from service.rows import F32, I64
from service.segment.in_store import (
    SERVE_ONCE_DONE,
    InStoreSegment,
    InStoreView,
    cut_over_label,
    refuse_unless_every_row,
    refuse_unless_ours,
)

if TYPE_CHECKING:
    from service.settings import IndexSettings

log = logging.getLogger("nobackfill.segment")

T = TypeVar("T")
LABEL = "nobackfill"  # the key of the column comment's JSON
STATEMENT_TIMEOUT_MS = 30_000  # a writer's batch or a DDL never holds a lock longer than this
LOCK_TIMEOUT_MS = 5_000  # ALTER TABLE gives up instead of queueing every reader behind it


@dataclass(frozen=True)
class ColumnLabel:
    """What the column's comment records: the new model, and the gallery (table column) it sits beside."""

    model: ModelIdentity
    gallery: str  # the gallery's fingerprint

    def text(self) -> str:
        """The comment's JSON."""
        return json.dumps({LABEL: {"model": self.model.as_dict(), "gallery": self.gallery}}, sort_keys=True)

    @classmethod
    def parse(cls, comment: str | None, where: str) -> ColumnLabel | None:
        """The label in a column comment; None when the comment is not nobackfill's."""
        try:
            found = json.loads(comment or "")
        except ValueError:
            return None
        if not isinstance(found, dict) or not isinstance(found.get(LABEL), dict):
            return None
        body = found[LABEL]
        return cls(ModelIdentity.from_dict(body.get("model") or {}, where), str(body.get("gallery", "")))


@dataclass(frozen=True)
class ColumnState:
    """The new column as the catalogue describes it: its dim and label, and the index on it (if any)."""

    dim: int
    label: ColumnLabel | None
    operator: str  # the SQL operator its index ranks by (<#> without an index: an exact scan)
    metric: str
    index_method: str | None


class PgvectorColumn:
    """Where the new rows live in the database, in SQL: shared by the service's segment and `backfill run`.

    side False: a second column `name` of the gallery's table, set on each moved row (UPDATE).
    side True: a table `name` of nobackfill's own, (id bigint primary key, embedding vector(d)), one row
    per moved item (INSERT): the user's table is never written, so its indexes and size never change.
    """

    def __init__(self, settings: IndexSettings, name: str, *, side: bool = False) -> None:
        if not settings.pgvector_table:
            raise InputError("a pgvector segment needs NOBACKFILL_INDEX__PGVECTOR_TABLE")
        self.settings = settings
        self.table = settings.pgvector_table
        self.id_column = settings.pgvector_id_column
        self.column = name
        self.side = side
        # Where the new rows are: the table and its id and vector columns.
        self.rows_table = name if side else self.table
        self.new_id = "id" if side else self.id_column
        self.new_vec = "embedding" if side else name
        self.spec = f"pgvector-table:{name}" if side else f"pgvector:{name}"  # as --segment names it
        self.where = (
            f"pgvector side table {name} (beside {self.table})"
            if side
            else f"pgvector table {self.table}, column {name}"
        )

    def unmoved(self) -> InTable:
        """What the gallery's search over the table filters on to leave the moved rows out."""
        return InTable("table" if self.side else "column", self.column)

    def connect(self, *, read_only: bool = True) -> Any:
        """A fresh connection with the writers' timeouts; GalleryUnavailable in one line (no DSN) when none opens."""
        import psycopg

        try:
            conn = connect(dsn_of(self.settings), read_only=read_only)
        except psycopg.OperationalError as exc:
            raise GalleryUnavailable(f"cannot reach PostgreSQL for {self.where}: {first_line(exc)}") from exc
        conn.execute(f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}")
        conn.execute(f"SET lock_timeout = {LOCK_TIMEOUT_MS}")
        return conn

    def state(self, conn: Any) -> ColumnState | None:
        """The column's dim, label and index; None when the table has no such column yet."""
        row = conn.execute(
            "SELECT format_type(a.atttypid, a.atttypmod), col_description(a.attrelid, a.attnum), a.attrelid "
            "FROM pg_attribute a WHERE a.attrelid = to_regclass(%s) AND a.attname = %s AND NOT a.attisdropped",
            (self.rows_table, self.new_vec),
        ).fetchone()
        if row is None:
            return None
        vector_type, comment, rel = row
        if not str(vector_type).startswith("vector("):
            raise ArtifactError(f"{self.where}: the column is {vector_type}, not a pgvector vector(d)")
        dim = int(str(vector_type).split("(", 1)[1].rstrip(")"))
        method, opclass, _ = index_on(conn, rel, self.new_vec)
        operator, metric = OPERATORS.get(opclass or "vector_ip_ops", ("<#>", "ip"))
        return ColumnState(dim, ColumnLabel.parse(comment, self.where), operator, metric, method)

    def checked(self, conn: Any, model: ModelIdentity, gallery: str) -> ColumnState | None:
        """state(), refused in one line unless the column is nobackfill's, of `model`, beside `gallery`."""
        state = self.state(conn)
        if state is None:
            return None
        unlabelled = (
            f"{self.where}: the column exists but was not added by nobackfill (no label in its comment); "
            "name a new column in NOBACKFILL_INDEX__PGVECTOR_NEW_COLUMN"
        )
        refuse_unless_ours(
            self.where, state.label, state.dim, model, gallery,
            unlabelled=unlabelled, noun="column", shape=f"is vector({state.dim})",
        )  # fmt: skip
        return state

    def add(self, conn: Any, model: ModelIdentity, gallery: str) -> None:
        """Create it (a nullable column: no rewrite; or the side table) and its label, in one transaction.

        A no-op once it is there.
        """
        from psycopg import sql

        if self.checked(conn, model, gallery) is not None:
            return
        with conn.transaction():
            if self.side:
                conn.execute(
                    sql.SQL("CREATE TABLE {} (id bigint PRIMARY KEY, embedding vector({}) NOT NULL)").format(
                        table_identifier(self.rows_table), sql.Literal(model.dim)
                    )
                )
            else:
                conn.execute(
                    sql.SQL("ALTER TABLE {} ADD COLUMN {} vector({})").format(
                        table_identifier(self.table), sql.Identifier(self.column), sql.Literal(model.dim)
                    )
                )
            conn.execute(
                sql.SQL("COMMENT ON COLUMN {}.{} IS {}").format(
                    table_identifier(self.rows_table),
                    sql.Identifier(self.new_vec),
                    sql.Literal(ColumnLabel(model, gallery).text()),
                )
            )
        log.info("%s: added for %s", self.where, model.model_id)

    def rows(self, conn: Any) -> int:
        """Rows of the gallery's table (its items)."""
        return int(conn.execute(self._sql("SELECT count(*) FROM {gallery}")).fetchone()[0])

    def index_name(self) -> str:
        """The name `create_index` gives the column's HNSW index."""
        return f"{self.rows_table.rsplit('.', 1)[-1]}_{self.new_vec}_hnsw"[:63]  # PostgreSQL's identifier limit

    def create_index(self, conn: Any, m: int, ef_construction: int) -> str:
        """CREATE INDEX CONCURRENTLY ... USING hnsw (inner product, as the service ranks): no write lock held.

        A build takes as long as it takes: no statement timeout for it.  An interrupted concurrent
        build leaves an INVALID index behind; it is dropped and built again.
        """
        from psycopg import sql

        name = self.index_name()
        invalid = conn.execute(
            "SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.relname = %s AND NOT i.indisvalid",
            (name,),
        ).fetchone()
        if invalid is not None:
            conn.execute(sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(sql.Identifier(name)))
        conn.execute("SET statement_timeout = 0")
        conn.execute(
            sql.SQL(
                "CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {table} USING hnsw ({new} vector_ip_ops) "
                "WITH (m = {m}, ef_construction = {ef})"
            ).format(
                name=sql.Identifier(name),
                table=table_identifier(self.rows_table),
                new=sql.Identifier(self.new_vec),
                m=sql.Literal(m),
                ef=sql.Literal(ef_construction),
            )
        )
        return name

    def count(self, conn: Any) -> int:
        """Rows whose new column is set."""
        return int(conn.execute(self._sql("SELECT count(*) FROM {table} WHERE {new} IS NOT NULL")).fetchone()[0])

    def moved(self, conn: Any) -> I64:
        """Every moved id, ascending."""
        rows = conn.execute(self._sql("SELECT {id} FROM {table} WHERE {new} IS NOT NULL ORDER BY {id}")).fetchall()
        return np.array([r[0] for r in rows], dtype=np.int64)

    def moved_among(self, conn: Any, ids: I64) -> npt.NDArray[np.bool_]:
        """Which of `ids` have moved (one indexed lookup by id)."""
        if not len(ids):
            return np.zeros(0, dtype=bool)
        rows = conn.execute(
            self._sql("SELECT {id} FROM {table} WHERE {id} = ANY(%s) AND {new} IS NOT NULL"), (ids.tolist(),)
        ).fetchall()
        return np.isin(ids, np.array([r[0] for r in rows], dtype=np.int64))

    def rows_of(self, conn: Any, ids: I64, dim: int) -> tuple[npt.NDArray[np.bool_], F32]:
        """Which of `ids` have moved, and their new rows (zero elsewhere)."""
        found = np.zeros(len(ids), dtype=bool)
        rows = np.zeros((len(ids), dim), dtype=np.float32)
        if not len(ids):
            return found, rows
        got = conn.execute(
            self._sql("SELECT {id}, {new}::text FROM {table} WHERE {id} = ANY(%s) AND {new} IS NOT NULL"),
            (ids.tolist(),),
        ).fetchall()
        where = {int(i): n for n, i in enumerate(ids.tolist())}
        for gallery_id, text in got:
            n = where[int(gallery_id)]
            found[n], rows[n] = True, np.array(text[1:-1].split(","), dtype=np.float32)
        return found, rows

    def write(self, conn: Any, ids: I64, rows: F32) -> int:
        """Set the new column of `ids` in one transaction, where it is still NULL (the first writer's row stays).

        The rows go in as one binary COPY into a temporary staging table, then one UPDATE ... FROM it:
        twenty times the rate of sending them as text (4,096 rows of 768 floats: 0.26 s against 5.7 s).
        """
        if not len(ids):
            return 0
        from psycopg import sql

        dim = rows.shape[1]
        stage = sql.Identifier(f"nobackfill_stage_{dim}")  # one per connection (TEMP), emptied at each commit
        with conn.transaction():
            # A writer's bounds for this transaction, whatever the connection's (the service's are a search's).
            conn.execute(
                "SELECT set_config('statement_timeout', %s, true), set_config('lock_timeout', %s, true)",
                (str(STATEMENT_TIMEOUT_MS), str(LOCK_TIMEOUT_MS)),
            )
            conn.execute(
                sql.SQL("CREATE TEMP TABLE IF NOT EXISTS {} (id bigint, v vector({})) ON COMMIT DELETE ROWS").format(
                    stage, sql.Literal(dim)
                )
            )
            with conn.cursor().copy(sql.SQL("COPY {} (id, v) FROM STDIN WITH (FORMAT binary)").format(stage)) as copy:
                copy.write(binary_copy(ids, rows))
            insert = "INSERT INTO {table} (id, embedding) SELECT id, v FROM {stage} ON CONFLICT (id) DO NOTHING"
            update = "UPDATE {table} AS t SET {new} = s.v FROM {stage} AS s WHERE t.{id} = s.id AND t.{new} IS NULL"
            done = conn.execute(self._sql(insert if self.side else update, stage))
            return int(done.rowcount)

    def search(self, conn: Any, state: ColumnState, queries: F32, k: int, ef_search: int) -> Hits:
        """Top-k of the moved rows by the column's index (or exactly), as cosines: (scores, ids; -inf / -1 pad)."""
        statement = self._sql(
            "SELECT {id}, {new} " + state.operator + " %s::vector FROM {table} WHERE {new} IS NOT NULL "
            "ORDER BY {new} " + state.operator + " %s::vector LIMIT %s"
        )
        settings = {"hnsw.ef_search": str(max(ef_search, k))} if state.index_method == "hnsw" else {}
        if state.index_method is not None:
            # The index holds exactly the moved rows, but early in a backfill the planner expects so few
            # of them that it reads the whole table and sorts it instead (20 of 20,000 moved: 1.1 ms
            # against 0.04 through the index; index/pgvector.py says the same of the unmoved rows).
            settings["enable_seqscan"] = "off"
        return ranked(conn, statement, queries, k, state.metric, settings)

    def _sql(self, template: str, stage: Any = None) -> Any:
        """A statement with {table} {id} {new} (the new rows), {gallery} (and {stage}) as quoted identifiers."""
        from psycopg import sql

        names = {"table": table_identifier(self.rows_table), "id": sql.Identifier(self.new_id)}
        names["new"], names["gallery"] = sql.Identifier(self.new_vec), table_identifier(self.table)
        return sql.SQL(template).format(**names, **({"stage": stage} if stage is not None else {}))


def binary_copy(ids: I64, rows: F32) -> bytes:
    """(id bigint, v vector) tuples in PostgreSQL's binary COPY format, built with numpy, no per-float text.

    pgvector's binary form of a vector: uint16 dim, uint16 unused, then dim float4, all big-endian.
    """
    n, dim = rows.shape
    record = np.dtype(
        [("fields", ">i2"), ("id_len", ">i4"), ("id", ">i8"), ("v_len", ">i4"), ("dim", ">u2"), ("unused", ">u2"),
         ("v", ">f4", (dim,))]
    )  # fmt: skip
    out = np.zeros(n, dtype=record)
    out["fields"], out["id_len"], out["id"] = 2, 8, ids
    out["v_len"], out["dim"], out["v"] = 4 + 4 * dim, dim, rows
    header = b"PGCOPY\n\xff\r\n\x00" + (0).to_bytes(4, "big") + (0).to_bytes(4, "big")
    return header + out.tobytes() + (-1).to_bytes(2, "big", signed=True)


def new_rows_of(settings: IndexSettings) -> PgvectorColumn | None:
    """The new rows the settings name: a column of the table (pgvector_new_column), a side table (_new_table)."""
    if settings.pgvector_new_table is not None:
        return PgvectorColumn(settings, settings.pgvector_new_table, side=True)
    if settings.pgvector_new_column is not None:
        return PgvectorColumn(settings, settings.pgvector_new_column)
    return None


class ColumnView(InStoreView):
    """The column as one request reads it: live SQL, the count of the last refresh."""


class PgvectorColumnSegment(InStoreSegment[ColumnState]):
    """The new column of the gallery's own table as the service's segment (segment/base.py's SegmentStore)."""

    backend = "pgvector-column"

    def __init__(self, new_rows: PgvectorColumn, model: ModelIdentity, gallery: str, ntotal: int) -> None:
        settings = new_rows.settings
        self.column = new_rows
        self.search_ef: int = settings.pgvector_ef_search
        super().__init__(model, gallery, ntotal)
        # The cascade writer writes; its shards and the searches beside the gallery's are bounded alike.
        self._connections = ThreadConnections(dsn_of(settings), read_only=False, timeout_s=settings.pgvector_timeout_s)
        self.snapshot: ColumnView = ColumnView(self, 0, None)

    @classmethod
    def open(cls, new_rows: PgvectorColumn, model: ModelIdentity, gallery: str, ntotal: int) -> PgvectorColumnSegment:
        """The new rows beside the table's gallery, refreshed once; ArtifactError in one line for another model's."""
        segment = cls(new_rows, model, gallery, ntotal)
        segment.refresh()
        return segment

    @classmethod
    def finished(cls, new_rows: PgvectorColumn, model: ModelIdentity) -> PgvectorColumnSegment:
        """After the cut-over: the new rows of `model` for every row of the table, else one ArtifactError line.

        The gallery it sat beside is not checked (it is retired, and may have been renamed by the
        cut-over's SQL): the model and the count are.
        """
        with new_rows.connect() as conn:
            label = cut_over_label(new_rows.state(conn), new_rows.where, "segment", ArtifactError)
            ntotal = new_rows.rows(conn)
        segment = cls.open(new_rows, model, label.gallery, ntotal)
        try:
            refuse_unless_every_row(
                new_rows.where, segment.snapshot.count, ntotal, "rows", SERVE_ONCE_DONE, ArtifactError,
                whose="the table's ",
            )  # fmt: skip
        except ArtifactError:
            segment.close()  # a refused start holds no connection
            raise
        return segment

    @property
    def where(self) -> str:
        """The table and column (never the DSN)."""
        return self.column.where

    def refresh(self) -> list[str]:
        """Check the column (it may have been added since) and count its rows; [column] when rows arrived."""
        conn = self._connections.get()
        try:
            self._state = self.column.checked(conn, self._model, self._gallery)
            count = self.column.count(conn) if self._state is not None else 0
        except Exception:
            self._connections.drop()
            raise
        before = self.snapshot.count
        exclusion = Exclusion(np.zeros(0, dtype=np.int64), in_table=self.column.unmoved()) if count else None
        self.snapshot = ColumnView(self, count, exclusion)
        return [self.column.column] if count != before else []

    def run(self, work: Callable[[PgvectorColumn, Any, ColumnState], T], empty: T) -> T:
        """work(column, connection, state) on this thread's connection; 503 (GalleryUnavailable) when it fails."""
        import psycopg

        state = self._state
        if state is None:  # not added yet: nothing has moved
            return empty
        try:
            return work(self.column, self._connections.get(), state)
        except psycopg.OperationalError as exc:
            self._connections.drop()
            raise GalleryUnavailable(f"the pgvector segment did not answer ({self.where}): {first_line(exc)}") from exc

    def write(self, ids: I64, rows: F32, writer: str) -> None:
        """The cascade's rows into the column; the service never adds it (no ALTER without the operator's consent)."""
        if self._state is None:
            raise ArtifactError(f"{self.where}: no such column yet; `nobackfill backfill run --add-column` adds it")
        conn = self._connections.get()
        try:
            self.column.write(conn, ids, rows)
        except Exception:
            self._connections.drop()
            raise
        log.debug("%s: %d rows written by %s", self.where, len(ids), writer)

    def describe(self) -> dict[str, Any]:
        """What /v1/info reports: the table, the column, the model and the coverage."""
        state = self._state
        index = (state.index_method if state is not None else None) or "none (exact scan)"
        return self.described({"table": self.column.table, "column": self.column.column}, index)

    def close(self) -> None:
        """Close every thread's connection."""
        self._connections.close()
