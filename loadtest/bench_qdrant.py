"""A Qdrant collection served by nobackfill against the collection's own bare search, in one run (issue 49).

    .venv/bin/python loadtest/bench_qdrant.py --items 100000 --queries 300

Builds once into --work (kept between runs; on /dev/shm where it can: local mode commits every write):
N synthetic items, a profile, the old model's rows as named vector `old` of collection `items` in
qdrant-client's local mode, and the new model's rows of --moved of them as named vector `embedding_v2`
(`backfill run --segment qdrant:embedding_v2 --add-vector`).  Then times, interleaved on the same
one-query requests (benchlib.interleave), through one Pipeline over that collection (local mode lets
one client open a folder, so the bare search uses the pipeline's own client):

    qdrant bare             the collection's own search of the old query row (query_points, 10 hits)
    qdrant served           nobackfill over the collection, the profile's head (mode slerp)
    ..., embeddings given   the same, the caller sending both embeddings (no encoder at all)
    qdrant hybrid           nobackfill over both vectors at --moved (the old one's search leaves the points
                            that have the new vector out in Qdrant: a must_not has_vector filter)

Local mode is qdrant-client's embedded engine: an exact numpy scan of the vectors, no HNSW, no network
hop.  Its bare search is therefore slower than a server's and its served minus bare is what nobackfill
adds over an in-process store; a server adds its own network hop to both sides.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from loadtest.benchlib import cli, percentiles, store_bench_args, table, warmed_interleave  # noqa: E402
from service.pipeline import Pipeline  # noqa: E402
from service.query.job import Query  # noqa: E402
from service.settings import CompatSettings, IndexSettings, Settings  # noqa: E402
from service.vocabulary import Modality  # noqa: E402

CAPTION = "item-{:010d} caption-1"
COLLECTION, OLD, NEW = "items", "old", "embedding_v2"
SHM = Path("/dev/shm")


def load_collection(path: Path, rows: np.ndarray) -> float:
    """The rows as the collection's `old` vector (Cosine), in batches; the seconds the upserts took."""
    import qdrant_client
    from qdrant_client import models

    client = qdrant_client.QdrantClient(path=str(path))
    try:
        params = models.VectorParams(size=rows.shape[1], distance=models.Distance.COSINE)
        client.create_collection(COLLECTION, vectors_config={OLD: params})
        started = time.perf_counter()
        for start in range(0, len(rows), 5_000):
            batch = rows[start : start + 5_000]
            client.upsert(
                COLLECTION,
                points=[models.PointStruct(id=start + i, vector={OLD: row.tolist()}) for i, row in enumerate(batch)],
            )
        return time.perf_counter() - started
    finally:
        client.close()


def index_settings(store: Path) -> IndexSettings:
    """The collection as the gallery, its new vector as the segment."""
    return IndexSettings(
        backend="qdrant", qdrant_path=store, qdrant_collection=COLLECTION, qdrant_vector=OLD, qdrant_new_vector=NEW,
        segment_refresh_s=3600,
    )  # fmt: skip


def build(work: Path, store: Path, items: int, moved: float) -> None:
    """What the variants need (kept between runs)."""
    from service.encoders.synthetic import SyntheticOldEncoder

    if not (work / "items").exists():
        cli("synth", "items", "--size", str(items), "--out", work / "items", "--force")
    if not (work / "profile" / "profile.json").exists():
        cli("synth", "support", "--n", "4000", "--out", work / "support", "--force")
        cli("fit", work / "support", "--out", work / "profile", "--folds", "3", "--force")
    if (store / "built").exists():
        return
    rows = SyntheticOldEncoder().encode_items(np.arange(items))
    print(f"qdrant local mode: {items:,} points upserted in {load_collection(store, rows):.1f} s", flush=True)
    env = {"NOBACKFILL_INDEX__BACKEND": "qdrant", "NOBACKFILL_INDEX__QDRANT_PATH": str(store),
           "NOBACKFILL_INDEX__QDRANT_COLLECTION": COLLECTION, "NOBACKFILL_INDEX__QDRANT_VECTOR": OLD}  # fmt: skip
    os.environ.update(env)
    try:
        cli("backfill", "run", "--segment", f"qdrant:{NEW}", "--add-vector", "--input", work / "items",
            "--backend", "synthetic-new", "--profile", work / "profile", "--order", "random",
            "--fraction", f"{moved:g}", "--batch-size", "512")  # fmt: skip
    finally:
        for name in env:
            del os.environ[name]
    (store / "built").touch()


async def measure(work: Path, store: Path, queries: int, items: int) -> list[dict[str, Any]]:
    """Every variant on the same queries, interleaved: p50 / p99 rows, and each served p50 minus the bare p50."""
    from service.encoders.synthetic import SyntheticNewEncoder, SyntheticOldEncoder

    texts = [CAPTION.format((i * 7919) % items) for i in range(queries)]
    old_rows = SyntheticOldEncoder().encode(texts, Modality.text)
    new_rows = SyntheticNewEncoder().encode(texts, Modality.text)
    pipeline = await Pipeline.build(
        Settings(index=index_settings(store), compat=CompatSettings(profile_dir=work / "profile"))
    )
    client: Any = pipeline.gallery.client  # type: ignore[attr-defined]

    async def bare(i: int) -> Any:
        return client.query_points(COLLECTION, query=old_rows[i].tolist(), using=OLD, limit=10, with_payload=False)

    calls = {
        "qdrant bare": bare,
        "qdrant served": lambda i: pipeline.search([Query(Modality.text, texts[i])], k=10, mode="slerp"),
        "qdrant served, embeddings given": lambda i: pipeline.search(
            [Query(Modality.text, old_embedding=old_rows[i], new_embedding=new_rows[i])], k=10, mode="slerp"
        ),
        "qdrant hybrid": lambda i: pipeline.search([Query(Modality.text, texts[i])], k=10, mode="hybrid"),
    }
    try:
        samples = await warmed_interleave(calls, queries)
    finally:
        await pipeline.aclose()
    stats = {name: percentiles(times) for name, times in samples.items()}
    return [
        {"variant": name, **s, "added_p50_ms": s["p50_ms"] - stats["qdrant bare"]["p50_ms"]}
        for name, s in stats.items()
    ]


def main() -> None:
    """Parse flags, build what is missing, measure, print the table (JSON with --json)."""
    args, work = store_bench_args(__doc__, ROOT / "artifacts" / "bench" / "qdrant")
    shm = SHM.is_dir() and os.access(SHM, os.W_OK)
    store = Path(tempfile.gettempdir() if not shm else SHM) / f"nobackfill-bench-qdrant-{args.items}"
    store.mkdir(exist_ok=True)
    build(work, store, args.items, args.moved)
    rows = asyncio.run(measure(work, store, args.queries, args.items))
    print(json.dumps(rows) if args.json else table(rows))


if __name__ == "__main__":
    main()
