"""`backfill cutover pgvector:COLUMN`: the SQL that makes the user's own application read the new column natively.

Two ways for a column, both one transaction, both leaving the old column in place until the operator
drops it (a side table has the view only, joined by id):

    view    CREATE VIEW <table>_<column> AS SELECT <every other column>, <column> AS <old column> ...:
            the application reads the view instead of the table, under the old column's name; nothing
            nobackfill serves changes, and pgvector's index on the new column serves the view's ORDER BY
            (a simple view is inlined by the planner).  The default: nothing in flight breaks.
    rename  the old column becomes <old>_old and the new one takes its name: the application changes
            nothing, the new column's index follows it.  nobackfill's own settings must follow too
            (NOBACKFILL_INDEX__PGVECTOR_NEW_COLUMN=<old>, NOBACKFILL_INDEX__PGVECTOR_COLUMN=<old>_old),
            and the statements are refused below 100 % moved, as the cut-over is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.errors import InputError
from service.segment.in_store import refuse_unless_all_moved
from service.segment.pgvector_column import PgvectorColumn

HOW = ("view", "rename")


@dataclass(frozen=True)
class Cutover:
    """The statements, and what the operator does after them."""

    statements: list[str]
    after: str
    drop_later: str


def plan_cutover(column: PgvectorColumn, conn: Any, how: str, view: str | None) -> Cutover:
    """The cut-over's SQL for `column`; InputError unless every row of the table has its new row."""
    from psycopg import sql

    if how not in HOW:
        raise InputError(f"--how must be one of {', '.join(HOW)}, got {how!r}")
    refuse_unless_all_moved(column, conn, "column")
    table = sql.Identifier(*column.table.split(".", 1))
    old, new = column.settings.pgvector_column, column.column
    if column.side and how == "rename":
        raise InputError(
            f"{column.where}: a side table is cut over with --how view (a column of another table cannot be renamed "
            "into this one)"
        )
    if how == "rename":
        retired = f"{old}_old"
        statements = [
            sql.SQL("ALTER TABLE {} RENAME COLUMN {} TO {}").format(
                table, sql.Identifier(old), sql.Identifier(retired)
            ),
            sql.SQL("ALTER TABLE {} RENAME COLUMN {} TO {}").format(table, sql.Identifier(new), sql.Identifier(old)),
        ]
        after = (
            f"the application reads {old} as before, now the new model's rows; nobackfill follows with "
            f"NOBACKFILL_INDEX__PGVECTOR_NEW_COLUMN={old} NOBACKFILL_INDEX__PGVECTOR_COLUMN={retired}"
        )
        drop = sql.SQL("ALTER TABLE {} DROP COLUMN {}").format(table, sql.Identifier(retired))
    else:
        name = (
            view
            or (f"{new.rsplit('.', 1)[-1]}_view" if column.side else f"{column.table.rsplit('.', 1)[-1]}_{new}")[:63]
        )
        others = [
            r[0]
            for r in conn.execute(
                "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attnum > 0 "
                "AND NOT attisdropped ORDER BY attnum",
                (column.table,),
            ).fetchall()
            if r[0] not in (old, new)
        ]
        if column.side:  # the table's other columns, and the side table's rows under the old column's name
            picked = sql.SQL(", ").join(
                [*(sql.SQL("t.{}").format(sql.Identifier(c)) for c in others),
                 sql.SQL("s.embedding AS {}").format(sql.Identifier(old))]
            )  # fmt: skip
            source: sql.Composable = sql.SQL("{} AS t JOIN {} AS s ON s.id = t.{}").format(
                table, sql.Identifier(*new.split(".", 1)), sql.Identifier(column.id_column)
            )
        else:
            picked = sql.SQL(", ").join(
                [
                    *(sql.Identifier(c) for c in others),
                    sql.SQL("{} AS {}").format(sql.Identifier(new), sql.Identifier(old)),
                ]
            )
            source = table
        statements = [sql.SQL("CREATE VIEW {} AS SELECT {} FROM {}").format(sql.Identifier(name), picked, source)]
        after = f"the application reads view {name} where it read {column.table}: column {old} is the new model's"
        if column.side:
            after += (
                f" (its ORDER BY {old} <#> q LIMIT k uses {new}'s HNSW index when the join is a nested loop: "
                "check with EXPLAIN; SET LOCAL enable_hashjoin = off forces it, as nobackfill's own search does)"
            )
        drop = sql.SQL("ALTER TABLE {} DROP COLUMN {}").format(table, sql.Identifier(old))
    return Cutover([s.as_string(conn) for s in statements], after, drop.as_string(conn))


def apply_cutover(conn: Any, cutover: Cutover) -> None:
    """Every statement in one transaction (all or nothing)."""
    with conn.transaction():
        for statement in cutover.statements:
            conn.execute(statement)
