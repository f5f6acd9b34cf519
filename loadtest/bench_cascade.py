"""The re-rank cascade against the compatible service, side by side in one run: p50 / p99 ratios.

    .venv/bin/python loadtest/bench_cascade.py --items 100000 --queries 400
    .venv/bin/python loadtest/bench_cascade.py --items 100000 --queries 400 --new-cost-ms 2 --new-cost-per-item-ms 0.5

Builds with bench_hybrid.build (kept between runs): a synthetic gallery, its item store, a profile,
and a segment holding every item.  One in-process Pipeline per variant, timing the same one-query
requests interleaved (benchlib.interleave):
    compat               no segment, no item store: the head's mode (the baseline)
    hybrid 100%          the full segment beside the gallery, no re-rank
    cascade, in segment  the full segment, mode cascade: every candidate's row is read from the segment
    cascade, budget B    an item store and no segment: up to B candidates per query encoded on the path
                         (nothing is written, so every request encodes again: the worst case)
--new-cost-ms / --new-cost-per-item-ms give the new encoder a simulated cost per batch (a real
model's), for the query and the candidates alike.  docs/backfill.md records runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest.bench_hybrid import CAPTION, WORK, build  # noqa: E402
from loadtest.benchlib import interleave, parse_args_and_work_folder, ratio_rows, table  # noqa: E402
from service.pipeline import Pipeline  # noqa: E402
from service.query.job import Query  # noqa: E402
from service.settings import CascadeSettings, CompatSettings, EncoderSettings, IndexSettings, Settings  # noqa: E402
from service.vocabulary import Modality  # noqa: E402


def settings(work: Path, args: argparse.Namespace, *, segment: Path | None, items: bool, budget: int) -> Settings:
    """One variant: the world, with or without the full segment and the item store."""
    new = EncoderSettings(
        backend="synthetic-new",
        simulated_cost_ms=args.new_cost_ms,
        simulated_cost_per_item_ms=args.new_cost_per_item_ms,
    )
    return Settings(
        new=new,
        index=IndexSettings(
            gallery_dir=work / "gallery",
            nprobe=args.nprobe,
            segment_dir=segment,
            segment_refresh_s=3600,
            item_store=work / "items" if items else None,
        ),
        compat=CompatSettings(profile_dir=work / "profile"),
        cascade=CascadeSettings(candidates=args.candidates, encode_budget=budget, write_segment=False),
    )


async def measure(work: Path, full: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Time every variant on the same queries, interleaved; rows of p50 / p99 and their ratios to compat."""
    plan: dict[str, tuple[Settings, str]] = {
        "compat": (settings(work, args, segment=None, items=False, budget=0), "slerp"),
        "hybrid 100%": (settings(work, args, segment=full, items=False, budget=0), "hybrid"),
        "cascade, in segment": (settings(work, args, segment=full, items=False, budget=0), "cascade"),
    }
    for budget in args.budgets:
        plan[f"cascade, budget {budget}"] = (settings(work, args, segment=None, items=True, budget=budget), "cascade")
    variants = {name: (await Pipeline.build(s), mode) for name, (s, mode) in plan.items()}
    texts = [CAPTION.format((i * 7919) % args.items) for i in range(args.queries)]
    try:
        for pipeline, mode in variants.values():  # warm: every query's old row cached, every thread started
            for text in texts[:20]:
                await pipeline.search([Query(Modality.text, text)], k=10, mode=mode)
        calls = {
            name: (lambda i, p=pipeline, m=mode: p.search([Query(Modality.text, texts[i])], k=10, mode=m))
            for name, (pipeline, mode) in variants.items()
        }
        samples = await interleave(calls, args.queries)
    finally:
        for pipeline, _ in variants.values():
            await pipeline.aclose()
    rows = ratio_rows(samples, {name: name for name in samples}, base="compat", floor="compat")
    for row in rows:
        row.pop("p50_ratio_vs_bare")  # the base is the floor here
    return {
        "items": args.items,
        "queries": args.queries,
        "candidates": args.candidates,
        "new_cost_ms": args.new_cost_ms,
        "new_cost_per_item_ms": args.new_cost_per_item_ms,
        "rows": rows,
    }


def main() -> None:
    """Parse flags, build what is missing, measure, print the table (and JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--candidates", type=int, default=50)
    parser.add_argument("--budgets", type=lambda s: [int(b) for b in s.split(",")], default=[0, 5, 20])
    parser.add_argument("--nprobe", type=int, default=16)
    parser.add_argument("--new-cost-ms", type=float, default=0.0)
    parser.add_argument("--new-cost-per-item-ms", type=float, default=0.0)
    args, work = parse_args_and_work_folder(parser, WORK)
    full = build(work, args.items, [1.0])[1.0]
    result = asyncio.run(measure(work, full, args))
    print(json.dumps(result) if args.json else table(result["rows"]))


if __name__ == "__main__":
    main()
