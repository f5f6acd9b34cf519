"""The batchers' collection window under load: 0 (a call runs as soon as a replica is free) against 2 ms.

    .venv/bin/python loadtest/bench_window.py --requests 600 --rounds 3      # after make demo

Over the demo's artifacts (artifacts/demo), two pipelines that differ only in `max_wait_ms` (both
encoders), each encoder given a simulated cost per batch and per item (SimulatedCostEncoder: the
synthetic encoders padded to a model's time, which releases the GIL as a model's kernels do).  For
each number of concurrent clients (a closed loop: each sends its next one-query request when the last
is answered), the two pipelines take turns, round by round, on the same requests:

    queries/s    requests answered per second of the round
    p50 / p99    each request's latency
    batch        the new encoder's mean batch size (its batch-size histogram over the round)

With one replica (the default) a window can only add latency: while a batch runs, the calls that
arrive meanwhile queue and form the next batch whatever the window.  This shows what it costs and
whether it buys any throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest.benchlib import percentiles, synthetic_encoders, table  # noqa: E402
from service import metrics  # noqa: E402
from service.pipeline import Pipeline  # noqa: E402
from service.query.job import Query  # noqa: E402
from service.settings import CompatSettings, EncoderSettings, IndexSettings, Settings  # noqa: E402
from service.vocabulary import Modality  # noqa: E402

CAPTION = "item-{:010d} caption-1"


def batch_sum_count() -> tuple[float, float]:
    """The new encoder's batch-size histogram so far: (items, batches), summed over every pipeline."""

    def sample(suffix: str) -> float:
        value = metrics.REGISTRY.get_sample_value(f"nobackfill_encoder_batch_size{suffix}", {"encoder": "new"})
        return value or 0.0

    return sample("_sum"), sample("_count")


async def round_of(pipeline: Pipeline, texts: list[str], clients: int) -> dict[str, float]:
    """Every text once, `clients` at a time in a closed loop: throughput, latency and mean batch."""
    latencies: list[float] = []
    next_text = iter(texts)

    async def client() -> None:
        for text in next_text:
            start = time.perf_counter()
            await pipeline.search([Query(Modality.text, text)], k=10, mode="slerp")
            latencies.append(time.perf_counter() - start)

    items_before, batches_before = batch_sum_count()
    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.perf_counter() - started
    items, batches = batch_sum_count()
    return {
        "qps": len(texts) / elapsed,
        **percentiles(latencies),
        "batch": (items - items_before) / max(1.0, batches - batches_before),
    }


def encoders(window_ms: float, args: argparse.Namespace) -> dict[str, EncoderSettings]:
    """Both synthetic encoders with this window, padded to the model's cost."""
    return synthetic_encoders(
        max_wait_ms=window_ms,
        simulated_cost_ms=args.encoder_ms,
        simulated_cost_per_item_ms=args.encoder_item_ms,
    )


async def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each window at each concurrency, the windows taking turns round by round."""
    base = Settings(
        index=IndexSettings(gallery_dir=args.demo / "gallery"),
        compat=CompatSettings(profile_dir=args.demo / "profile"),
    )
    pipelines = {w: await Pipeline.build(base.model_copy(update=encoders(w, args))) for w in args.windows}
    rows: list[dict[str, Any]] = []
    try:
        for clients in args.clients:
            results: dict[float, list[dict[str, float]]] = {window: [] for window in args.windows}
            for r in range(args.rounds + 1):  # round 0 warms up and is not kept
                texts = [CAPTION.format((r * args.requests + i) * 7919 % 50_000) for i in range(args.requests)]
                for window, pipeline in pipelines.items():
                    result = await round_of(pipeline, texts, clients)
                    if r:
                        results[window].append(result)
            for window, kept in results.items():
                rows.append(
                    {
                        "clients": clients,
                        "window_ms": window,
                        **{key: statistics.median(result[key] for result in kept) for key in kept[0]},
                    }
                )
    finally:
        for pipeline in pipelines.values():
            await pipeline.aclose()
    return rows


def main() -> None:
    """Parse flags, measure, print the table (JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demo", type=Path, default=ROOT / "artifacts" / "demo")
    parser.add_argument("--requests", type=int, default=600, help="requests a round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds kept per window (medians shown)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--windows", type=float, nargs="+", default=[0.0, 2.0], help="max_wait_ms values")
    parser.add_argument("--encoder-ms", type=float, default=3.0, help="simulated cost per batch")
    parser.add_argument("--encoder-item-ms", type=float, default=1.0, help="simulated cost per item")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not (args.demo / "profile" / "profile.json").is_file():
        raise SystemExit(f"{args.demo}: no demo artifacts; run `make demo` (or `nobackfill demo --prepare-only`)")
    rows = asyncio.run(measure(args))
    print(json.dumps(rows) if args.json else table(rows))


if __name__ == "__main__":
    main()
