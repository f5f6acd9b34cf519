"""Lazy backfill under Zipf traffic: served R@1 as the cascade fills an empty segment from the queries alone.

    .venv/bin/python loadtest/bench_cascade_fill.py --items 100000 --queries 10000 --zipf 1.1 --budget 10 \
        --plot docs/cascade-lazy-fill.png

Builds with bench_hybrid.build into --work (kept between runs): a synthetic gallery of N items, its
item store and a profile.  One query stream: items drawn by Zipf(s) popularity (the ranks permuted
over the ids, backfill/evaluate.zipf_weights), each asked as `item-<id> caption-1`, whose one relevant
gallery id is the item.  Each variant is an in-process Pipeline answering the stream one query per
request, in order:
    compat           no segment, no item store: the profile head's mode (the flat baseline)
    lazy, budget B   the item store and an empty segment folder, mode hybrid (which re-ranks through the
                     cascade): up to B candidates per query encoded on the path and written to the segment
    lazy, budget 0   the same with nothing encoded: the segment never fills (--no-zero to skip)
Two offline references from the synthetic new encoder: the ceiling (re-indexed: the new query against
every item's new row, exact top 1) and the cascade's limit over compat's stage 1 (its top --candidates
all re-ranked by their new rows).  Prints R@1 per window of queries, the segment's coverage and where
the lazy cascade's candidate rows came from (nobackfill_cascade_candidates_total); --plot draws the
rolling R@1 (docs/cascade-lazy-fill.png is the command above's).  The writer publishes on a clock
(flush_s 0.5), so the lazy figures move by a few thousandths from run to run; compat's do not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest.bench_hybrid import CAPTION, build  # noqa: E402
from loadtest.benchlib import size_folder, table  # noqa: E402
from service.encoders.synthetic import SyntheticNewEncoder, format_item  # noqa: E402
from service.metrics import CASCADE_SOURCES, REGISTRY  # noqa: E402
from service.pipeline import Pipeline  # noqa: E402
from service.plots import png_of, pyplot  # noqa: E402
from service.query.job import Query  # noqa: E402
from service.scoring.migration import zipf_weights  # noqa: E402
from service.settings import CascadeSettings, CompatSettings, IndexSettings, Settings  # noqa: E402
from service.vocabulary import Modality, Mode  # noqa: E402

I64 = npt.NDArray[np.int64]
F32 = npt.NDArray[np.float32]
CANDIDATES = "nobackfill_cascade_candidates_total"
CHUNK = 512  # queries per exact top-1 block: 512 x 10^5 float32 scores is 200 MB


@dataclass
class Run:
    """One variant over the stream: per query whether its top 1 was relevant, and what the segment held."""

    name: str
    hits: list[bool] = field(default_factory=list)
    known: list[bool] = field(default_factory=list)  # the relevant item's row was in the segment or pending
    ms: list[float] = field(default_factory=list)
    top: list[int] = field(default_factory=list)  # the served top 1 (-1: none)
    coverage: list[tuple[int, float]] = field(default_factory=list)  # (queries answered, coverage)
    shards: dict[int, int] = field(default_factory=dict)  # queries answered -> shards loaded
    sources: list[dict[str, float]] = field(default_factory=list)  # candidates by source, per window
    stage1: list[list[int]] = field(default_factory=list)  # compat only: its top --candidates
    wall_s: float = 0.0


def query_stream(items: int, queries: int, s: float, seed: int) -> I64:
    """Query items drawn by Zipf(s) popularity, the popularity ranks permuted over the ids."""
    weights = zipf_weights(items, s, seed)
    picks: I64 = np.random.default_rng(seed + 1).choice(items, size=queries, p=weights).astype(np.int64)
    return picks


def settings(work: Path, args: argparse.Namespace, segment: Path | None, budget: int) -> Settings:
    """One variant: the world, and for the lazy ones the item store and an empty segment folder."""
    return Settings(
        index=IndexSettings(
            gallery_dir=work / "gallery",
            nprobe=args.nprobe,
            segment_dir=segment,
            segment_refresh_s=0.5,  # the writer refreshes after each publish; this picks up anything else soon
            item_store=work / "items" if segment is not None else None,
        ),
        compat=CompatSettings(profile_dir=work / "profile"),
        cascade=CascadeSettings(candidates=args.candidates, encode_budget=budget, flush_s=0.5),
    )


def candidate_counts() -> dict[str, float]:
    """The process's cascade candidates so far, by where their row came from."""
    return {s: REGISTRY.get_sample_value(CANDIDATES, {"source": s}) or 0.0 for s in CASCADE_SOURCES}


def _known(pipeline: Pipeline, item: int) -> bool:
    """Whether the item's new row is in the segment's snapshot or waits in the writer now."""
    if pipeline.segment is None:
        return False
    ids = np.array([item], dtype=np.int64)
    writer = pipeline.cascade.writer if pipeline.cascade is not None else None
    return bool(
        pipeline.segment.segment.snapshot.contains(ids)[0] or (writer is not None and writer.rows_of(ids)[0][0])
    )


async def serve(run: Run, config: Settings, mode: str | None, stream: I64, k: int, args: argparse.Namespace) -> Run:
    """Answer the stream one query per request, in order; coverage every --coverage-every, sources per --window."""
    pipeline = await Pipeline.build(config)
    start, before = time.perf_counter(), candidate_counts()
    try:
        for n, item in enumerate(stream.tolist(), start=1):
            run.known.append(_known(pipeline, item))
            t0 = time.perf_counter()
            outcome = await pipeline.search([Query(Modality.text, CAPTION.format(item))], k=k, mode=mode)
            run.ms.append(1000 * (time.perf_counter() - t0))
            ids = outcome.results[0].ids
            run.top.append(ids[0] if ids else -1)
            run.hits.append(run.top[-1] == item)
            if k > 10:
                run.stage1.append(list(ids))
            if pipeline.segment is not None and n % args.coverage_every == 0:
                run.coverage.append((n, pipeline.segment.segment.coverage))
                run.shards[n] = len(pipeline.segment.segment.snapshot.shards)
            if n % args.window == 0 or n == len(stream):
                now = candidate_counts()
                run.sources.append({s: now[s] - before[s] for s in CASCADE_SOURCES})
                before = now
    finally:
        await pipeline.aclose()
    run.wall_s = time.perf_counter() - start
    return run


def references(items: int, stream: I64, compat: Run) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """Per query: the re-indexed top 1 is relevant (ceiling); compat's stage 1 re-ranked by new rows is (limit)."""
    encoder = SyntheticNewEncoder()
    rows: F32 = encoder.encode([format_item(i) for i in range(items)], Modality.text)  # the item store's texts
    unique = np.unique(stream)
    queries: F32 = encoder.encode([CAPTION.format(i) for i in unique.tolist()], Modality.text)
    top = np.concatenate([np.argmax(queries[i : i + CHUNK] @ rows.T, axis=1) for i in range(0, len(unique), CHUNK)])
    ceiling = (top == unique)[np.searchsorted(unique, stream)]
    at = np.searchsorted(unique, stream)
    limit = np.zeros(len(stream), dtype=bool)
    for n, candidates in enumerate(compat.stage1):
        ids = np.array([x for x in candidates if x >= 0], dtype=np.int64)
        limit[n] = len(ids) > 0 and ids[np.argmax(rows[ids] @ queries[at[n]])] == stream[n]
    return ceiling, limit


def windows(runs: list[Run], lazy: Run, window: int) -> list[dict[str, Any]]:
    """One row per window of queries: R@1 of each variant, and the lazy run's segment and candidate sources."""
    rows = []
    n = len(lazy.hits)
    coverage = dict(lazy.coverage)
    for w, start in enumerate(range(0, n, window)):
        stop = min(n, start + window)
        row: dict[str, Any] = {"queries": f"{start}-{stop - 1}"}
        for run in runs:
            row[f"R@1 {run.name}"] = float(np.mean(run.hits[start:stop]))
        known = np.asarray(lazy.known[start:stop])
        hits = np.asarray(lazy.hits[start:stop])
        row["relevant known"] = float(known.mean())
        row["R@1 lazy if known"] = float(hits[known].mean()) if known.any() else float("nan")
        row["R@1 lazy if not"] = float(hits[~known].mean()) if (~known).any() else float("nan")
        row["coverage at end"] = coverage.get(stop, float("nan"))
        row["shards"] = lazy.shards.get(stop, -1)
        total = sum(lazy.sources[w].values()) or 1.0
        for source in CASCADE_SOURCES:
            row[source] = lazy.sources[w][source] / total
        row["p50 ms compat"] = float(np.median(runs[0].ms[start:stop]))
        row["p50 ms lazy"] = float(np.median(lazy.ms[start:stop]))
        rows.append(row)
    return rows


def rolling(hits: list[bool], width: int) -> tuple[I64, npt.NDArray[np.float64]]:
    """The R@1 of the last `width` queries, at each query from the width-th on (x: that query's index)."""
    mean = np.convolve(np.asarray(hits, dtype=np.float64), np.ones(width) / width, mode="valid")
    return np.arange(width - 1, len(hits), dtype=np.int64), mean


def plot(path: Path, runs: list[Run], lazy: Run, ceiling: float, limit: float, args: argparse.Namespace) -> None:
    """Rolling R@1 per variant, the ceiling and the limit as lines; the lazy run's coverage on a second axis."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    styles = [("tab:blue", "-", 1.4), ("tab:orange", "-", 1.4), ("tab:purple", "--", 1.0)]
    for run, (color, line, width) in zip(runs, styles, strict=False):  # budget 0 dashed: it lies on compat
        ax.plot(*rolling(run.hits, args.rolling), label=run.name, color=color, linestyle=line, linewidth=width)
    ax.axhline(ceiling, color="black", linestyle="--", linewidth=1, label=f"re-indexed ceiling {ceiling:.3f}")
    ax.axhline(
        limit, color="grey", linestyle=":", linewidth=1, label=f"compat top-{args.candidates} all re-ranked {limit:.3f}"
    )
    ax.set_xlabel("query index")
    ax.set_ylabel(f"served R@1 (rolling, last {args.rolling} queries)")
    ax.set_xlim(0, len(lazy.hits))
    twin = ax.twinx()
    steps, share = zip(*lazy.coverage, strict=True) if lazy.coverage else ((), ())
    twin.plot(steps, [100 * c for c in share], color="tab:green", linestyle="-.", linewidth=1, label="segment coverage")
    twin.set_ylabel("segment coverage (% of items)")
    twin.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(
        lines[0] + more[0], lines[1] + more[1], loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, fontsize=8
    )
    ax.set_title(
        f"Lazy backfill under Zipf({args.zipf}) traffic: {args.items:,} items, "
        f"{args.candidates} candidates, budget {args.budget}",
        fontsize=10,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png_of(fig))


async def measure(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Every variant over the same stream, one after another; the references; the table's rows."""
    stream = query_stream(args.items, args.queries, args.zipf, args.seed)
    # compat asks for the candidates' depth so the same run gives stage 1 for the limit; its top 1 is k's.
    compat = await serve(Run("compat"), settings(work, args, None, 0), None, stream, args.candidates, args)
    budgets = [args.budget] + ([0] if args.zero and args.budget != 0 else [])
    runs = [compat]
    for budget in budgets:
        with tempfile.TemporaryDirectory(prefix="cascade-fill-") as folder:
            config = settings(work, args, Path(folder), budget)
            runs.append(await serve(Run(f"lazy, budget {budget}"), config, Mode.hybrid, stream, 10, args))
    ceiling, limit = references(args.items, stream, compat)
    lazy = runs[1]
    return {
        "items": args.items,
        "queries": args.queries,
        "distinct_items": int(len(np.unique(stream))),
        "zipf": args.zipf,
        "candidates": args.candidates,
        "budget": args.budget,
        "rows": windows(runs, lazy, args.window),
        "overall": {run.name: float(np.mean(run.hits)) for run in runs},
        "ceiling": float(ceiling.mean()),
        "limit": float(limit.mean()),
        "final_coverage": lazy.coverage[-1][1] if lazy.coverage else 0.0,
        "compat_recall_at_candidates": float(
            np.mean([int(x) in c for x, c in zip(stream, compat.stage1, strict=True)])
        ),
        "same_top1_as_compat": {run.name: int(np.sum(np.equal(run.top, compat.top))) for run in runs[1:]},
        "wall_s": {run.name: run.wall_s for run in runs},
        "_runs": runs,
    }


def main() -> None:
    """Parse flags, build what is missing, run the variants, print the table (JSON with --json), draw --plot."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent s of the items' popularity.")
    parser.add_argument("--budget", type=int, default=10, help="cascade.encode_budget of the lazy variant.")
    parser.add_argument("--candidates", type=int, default=50)
    parser.add_argument("--nprobe", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=1000, help="Queries per table row.")
    parser.add_argument("--rolling", type=int, default=500, help="Queries per point of the plot's rolling R@1.")
    parser.add_argument("--coverage-every", type=int, default=500)
    parser.add_argument("--no-zero", dest="zero", action="store_false", help="Skip the budget-0 variant.")
    parser.add_argument("--work", type=Path, default=ROOT / "loadtest" / "results" / "cascade_fill")
    parser.add_argument("--plot", type=Path, default=None, help="Write the figure here (PNG).")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = size_folder(args.work, args.items)
    build(work, args.items, [])
    result = asyncio.run(measure(work, args))
    runs: list[Run] = result.pop("_runs")
    if args.plot is not None:
        plot(args.plot, runs, runs[1], result["ceiling"], result["limit"], args)
    if args.json:
        print(json.dumps(result))
        return
    print(table(result["rows"]))
    summary = {**{f"R@1 {k}": v for k, v in result["overall"].items()}, "ceiling": result["ceiling"]}
    summary |= {"limit": result["limit"], f"compat R@{args.candidates}": result["compat_recall_at_candidates"]}
    summary["final coverage"] = result["final_coverage"]
    print(table([{"queries": f"all {args.queries}", **summary}]))
    print(f"distinct items asked: {result['distinct_items']:,}; same top 1 as compat: {result['same_top1_as_compat']}")
    print("wall s: " + ", ".join(f"{name} {s:.1f}" for name, s in result["wall_s"].items()))


if __name__ == "__main__":
    main()
