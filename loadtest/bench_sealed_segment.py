"""A segment with a sealed index against one read exactly: the seal's cost, a reader's start, one query, recall,
and the serving reader's refresh when a shard lands beside the sealed rows.

    .venv/bin/python loadtest/bench_sealed_segment.py --rows 100000

Rows are the simulated new model's embeddings (synthetic-new) of gallery items, written as shards of
4,096 rows; queries its embeddings of 200 of those items' captions, one at a time, as a request
sends them.  The seal uses every core (faiss); the start is `Segment.open` (every shard and the
sealed index read and checked, as the service's start and a cut-over read them); the refresh is what
the service's refresh thread does once a backfill publishes a shard (8 shards of 500 new rows, one at
a time).  docs/backfill.md records a run.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest.benchlib import table  # noqa: E402
from service.encoders.identity import ModelIdentity  # noqa: E402
from service.encoders.synthetic import SyntheticNewEncoder  # noqa: E402
from service.segment.layout import GalleryRef, create_segment, write_shard  # noqa: E402
from service.segment.reader import Indexing, Segment  # noqa: E402
from service.segment.sealed import seal  # noqa: E402
from service.vocabulary import Modality  # noqa: E402

CAPTION = "item-{:010d} caption-1"
PROBE_CAPTION = "item-{:010d} caption-2"
SHARD = 4096
LANDING = 500  # rows of each shard that lands while the reader serves


def one_query_ms(segment: Segment, queries: np.ndarray) -> float:
    """Median milliseconds of one query's top-10 over the segment."""
    took = []
    for row in queries:
        started = time.perf_counter()
        segment.snapshot.search(row[None], 10)
        took.append((time.perf_counter() - started) * 1000)
    return statistics.median(took)


def refresh_ms(segment: Segment, encoder: SyntheticNewEncoder, model: ModelIdentity, first_id: int) -> float:
    """Median milliseconds of the serving reader's refresh after each of 8 shards of new rows lands."""
    took = []
    for n in range(8):
        ids = np.arange(first_id + n * LANDING, first_id + (n + 1) * LANDING, dtype=np.int64)
        write_shard(segment.folder, ids, encoder.encode_items(ids), model, "bench")
        started = time.perf_counter()
        segment.refresh()
        took.append((time.perf_counter() - started) * 1000)
    return statistics.median(took)


def main() -> None:
    """Build the segment, seal it, open it both ways, print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--ef", default="32,64,128", help="efSearch values, comma-separated.")
    parser.add_argument("--whole-rows", action="store_true", help="Also a format-1 index: the graph over whole rows.")
    parser.add_argument("--float32", action="store_true", help="Also a format-2 index: float32 coordinates.")
    parser.add_argument(
        "--probe-captions",
        type=int,
        default=0,
        help="Seal measuring its width on this many caption-2 queries of random items (what a traffic export "
        "holds: `backfill run --probe-queries`), not on its own rows.",
    )
    args = parser.parse_args()
    encoder = SyntheticNewEncoder()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "segment"
        model = ModelIdentity("synthetic-new", encoder.model_id, None, encoder.dim)
        create_segment(folder, model, GalleryRef("ab" * 32, args.rows + 8 * LANDING))
        for start in range(0, args.rows, SHARD):
            ids = np.arange(start, min(start + SHARD, args.rows), dtype=np.int64)
            write_shard(folder, ids, encoder.encode_items(ids), model, "bench")
        picked = np.random.default_rng(0).choice(args.rows, 200, replace=False)
        queries = encoder.encode([CAPTION.format(int(i)) for i in picked], Modality.text)
        probes = None  # served queries stand-in: other captions than the measured ones (caption-2, other items)
        if args.probe_captions:
            others = np.random.default_rng(1).choice(args.rows, args.probe_captions, replace=False)
            probes = encoder.encode([PROBE_CAPTION.format(int(i)) for i in others], Modality.text)
        folders = {"": folder}
        for wanted, label, copy in ((args.float32, "float32, ", "f32"), (args.whole_rows, "whole rows, ", "whole")):
            if wanted:  # the same shards, sealed as format 2 or 1
                shutil.copytree(folder, Path(tmp) / copy, symlinks=True)
                folders[label] = Path(tmp) / copy
        seals = {}
        for label, where in folders.items():
            started = time.perf_counter()
            storage = "float32" if label == "float32, " else "float16"
            done = seal(where, whole_rows=label == "whole rows, ", storage=storage, queries=probes)
            took = time.perf_counter() - started
            measurement = f"measured ef {done.ef_search}, {done.recall:.3f} on {done.probes}"
            seals[label] = f"{label or 'directions, '}{took:.1f} s ({measurement})"
        measured = [("exact", Segment.open(folder, Indexing(exact=True)), 0.0)]
        for label, where in folders.items():
            for ef in [None, *(int(e) for e in args.ef.split(","))]:  # None: the width the seal measured
                started = time.perf_counter()
                segment = Segment.open(where, Indexing(ef_search=ef))
                open_s = time.perf_counter() - started
                widths = ", ".join(str(w) for w in segment.describe()["sealed_ef_search"].values())
                width = f"ef {ef}" if ef is not None else f"its seal's ef ({widths})"
                measured.append((f"sealed HNSW, {label}{width}", segment, open_s))
        _, want = measured[0][1].snapshot.search(queries, 10)
        lines = []
        for name, segment, open_s in measured:
            _, got = segment.snapshot.search(queries, 10)
            recall = np.mean([len(set(w) & set(g)) / 10 for w, g in zip(want.tolist(), got.tolist(), strict=True)])
            lines.append(
                {
                    "segment read": name,
                    "start (Segment.open)": f"{open_s:.1f} s",
                    "one query (median)": f"{one_query_ms(segment, queries):.2f} ms",
                    "recall@10": f"{recall:.3f}",
                }
            )
        sealed = ", ".join(seals.values())
        print(f"{args.rows:,} rows of {queries.shape[1]} floats; seal: {sealed} ({done.rows:,} rows)")
        print(table(lines))
        landed = refresh_ms(measured[1][1], encoder, model, args.rows)  # last: it adds rows to the folder
        print(f"a shard of {LANDING} rows lands beside them: the serving reader's refresh {landed:.1f} ms (8, median)")


if __name__ == "__main__":
    main()
