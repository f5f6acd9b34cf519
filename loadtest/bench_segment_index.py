"""Which index a segment block should be: one-query latency and recall@10 against the exact scan.

    .venv/bin/python loadtest/bench_segment_index.py --rows 100000

Rows are the simulated new model's embeddings (synthetic-new) of random gallery items; queries are
its embeddings of 200 of those items' captions, as hybrid search sends them.  Builds use every
core, searches one query at a time (as a request does).  docs/backfill.md records a run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest.benchlib import table  # noqa: E402
from service.encoders.synthetic import SyntheticNewEncoder  # noqa: E402
from service.vocabulary import Modality  # noqa: E402

CAPTION = "item-{:010d} caption-1"


def ivf_flat(rows: np.ndarray, lists: int, nprobe: int) -> Any:
    """IVF-Flat trained on the rows themselves (as the segment's IVF blocks were)."""
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(rows.shape[1]), rows.shape[1], lists, faiss.METRIC_INNER_PRODUCT)
    index.cp.niter = 10
    sample = np.random.default_rng(0).choice(len(rows), min(len(rows), 40 * lists), replace=False)
    index.train(rows[np.sort(sample)])
    index.add(rows)
    index.nprobe = nprobe
    return index


def hnsw(rows: np.ndarray, links: int, ef: int) -> Any:
    """HNSW over the rows (segment/reader.py's Indexing builds it with efConstruction 40)."""
    index = faiss.IndexHNSWFlat(rows.shape[1], links, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = 40
    index.add(rows)
    index.hnsw.efSearch = ef
    return index


def measure(name: str, build: Any, queries: np.ndarray, truth: np.ndarray) -> dict[str, Any]:
    """Build the index, then time it one query at a time; recall@10 against `truth`."""
    start = time.perf_counter()
    index = build()
    built = time.perf_counter() - start
    times, found = [], []
    for query in queries:
        start = time.perf_counter()
        _, ids = index.search(query[None], 10)
        times.append(time.perf_counter() - start)
        found.append(ids[0])
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(found, truth.tolist(), strict=True)])
    return {"index": name, "build_s": round(built, 1), "p50_ms": 1e3 * float(np.median(times)), "recall@10": recall}


def main() -> None:
    """Encode the rows, compute the exact answers, measure each candidate index."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    args = parser.parse_args()
    encoder = SyntheticNewEncoder()
    items = np.random.default_rng(0).choice(10 * args.rows, args.rows, replace=False)
    rows = np.concatenate([encoder.encode_items(items[i : i + 50_000]) for i in range(0, args.rows, 50_000)])
    rows = np.ascontiguousarray(rows / np.linalg.norm(rows, axis=1, keepdims=True), dtype=np.float32)
    queries = encoder.encode([CAPTION.format(i) for i in items[:200]], Modality.text)
    queries = np.ascontiguousarray(queries / np.linalg.norm(queries, axis=1, keepdims=True), dtype=np.float32)
    exact = faiss.IndexFlatIP(rows.shape[1])
    exact.add(rows)
    _, truth = exact.search(queries, 10)
    root = int(np.sqrt(args.rows))
    candidates = {
        "flat (exact)": lambda: exact,
        f"IVF-Flat {root} lists, nprobe 16": lambda: ivf_flat(rows, root, 16),
        f"IVF-Flat {4 * root} lists, nprobe 16": lambda: ivf_flat(rows, 4 * root, 16),
        "HNSW 16 links, ef 32": lambda: hnsw(rows, 16, 32),
        "HNSW 32 links, ef 32": lambda: hnsw(rows, 32, 32),
        "HNSW 32 links, ef 64": lambda: hnsw(rows, 32, 64),
    }
    print(table([measure(name, build, queries, truth) for name, build in candidates.items()]))


if __name__ == "__main__":
    main()
