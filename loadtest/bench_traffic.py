"""Cost of traffic sampling on the query path: p50 / p99 at sample rate 0, 0.1 and 1.0, side by side in one run.

    python loadtest/bench_traffic.py --size 50000 --queries 600 [--redis-url redis://127.0.0.1:6379/15]

Four (five with --redis-url) pipelines on one gallery and profile, identical but for
traffic.sample_rate: 0 (no sampler at all: the default), 0 again (an A/A control: how far two
identical pipelines in one process differ), 0.1 and 1.0 into rotating local shards (and 1.0 into a
Redis stream).  Each query goes to every variant in turn, the first one rotating
(benchlib.interleave), with a warm old-embedding cache so the variants differ only by the sampler;
the table gives p50 / p99 and their ratios to rate 0 with 95 % bootstrap intervals.  The encoders are
the synthetic ones with a simulated per-batch cost (--encoder-ms, --encoder-item-ms; simulated, said
so), the shape of real models on an accelerator.  It also times TrafficSampler.offer() alone, the
only work sampling adds to a request (the store is written by the drain thread).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import cli, interleave, ratio_rows, table

from service.encoders.identity import ModelIdentity
from service.pipeline import Pipeline, Query
from service.settings import (
    CacheSettings,
    CompatSettings,
    EncoderSettings,
    IndexSettings,
    Settings,
    TrafficSettings,
)
from service.traffic.local import LocalPairStore
from service.traffic.sampler import TrafficSampler

ROOT = Path("artifacts/bench-traffic")


def prepare(size: int) -> dict[str, Path]:
    """Gallery, support set and profile (built once under ROOT, then reused)."""
    paths = {"gallery": ROOT / f"gallery-{size}", "support": ROOT / "support", "profile": ROOT / "profile"}
    if not (paths["gallery"] / "gallery.json").exists():
        cli("gallery", "build", "--size", str(size), "--out", paths["gallery"], "--force")
    if not (paths["support"] / "models.json").exists():
        cli("synth", "support", "--n", "4000", "--out", paths["support"], "--force")
    if not (paths["profile"] / "profile.json").exists():
        cli("fit", paths["support"], "--out", paths["profile"], "--folds", "3", "--force")
    return paths


def settings_for(paths: dict[str, Path], args: argparse.Namespace, traffic: TrafficSettings) -> Settings:
    """The same service each time, but for its traffic settings."""

    def encoder(backend: str) -> EncoderSettings:
        return EncoderSettings(
            backend=backend,
            device="cpu",
            simulated_cost_ms=args.encoder_ms,
            simulated_cost_per_item_ms=args.encoder_item_ms,
            max_wait_ms=args.max_wait_ms,
        )

    return Settings(
        old=encoder("synthetic-old"),
        new=encoder("synthetic-new"),
        index=IndexSettings(gallery_dir=paths["gallery"], nprobe=args.nprobe),
        compat=CompatSettings(profile_dir=paths["profile"]),
        cache=CacheSettings(lru_size=1_000_000),
        traffic=traffic,
    )


def offer_micro(n: int = 20_000) -> dict[str, float]:
    """Microseconds one offer() of a single query takes on the caller's thread, at rate 1.0 and 0.1."""
    old = np.random.default_rng(0).standard_normal((1, 512)).astype(np.float32)
    new = np.random.default_rng(1).standard_normal((1, 768)).astype(np.float32)
    out = {}
    for rate in (1.0, 0.1):
        store = LocalPairStore(ROOT / f"micro-{uuid.uuid4().hex[:8]}", max_pairs=100_000, ttl_s=3600)
        sampler = TrafficSampler(
            store,
            rate,
            ModelIdentity("synthetic-old", "synthetic-old", None, 512),
            ModelIdentity("synthetic-new", "synthetic-new", None, 768),
            queue_size=n,
        )
        eligible = np.ones(1, dtype=bool)
        start = time.perf_counter()
        for _ in range(n):
            sampler.offer(old, new, ["text"], eligible)
        out[f"offer_us_rate_{rate:g}"] = 1e6 * (time.perf_counter() - start) / n
        sampler.close()
        shutil.rmtree(store.folder, ignore_errors=True)
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every variant on the same queries, interleaved."""
    paths = prepare(args.size)
    shards = ROOT / f"shards-{uuid.uuid4().hex[:8]}"
    variants: dict[str, TrafficSettings] = {
        "rate0": TrafficSettings(sample_rate=0.0),
        "control": TrafficSettings(sample_rate=0.0),
        "rate0.1": TrafficSettings(sample_rate=0.1, store="local", local_dir=shards / "r01"),
        "rate1": TrafficSettings(sample_rate=1.0, store="local", local_dir=shards / "r1"),
    }
    labels = {
        "rate0": "sample rate 0 (default: no sampler)",
        "control": "sample rate 0, a second identical pipeline (A/A: the noise floor)",
        "rate0.1": "sample rate 0.1, local shards",
        "rate1": "sample rate 1.0, local shards",
    }
    key = f"nobackfill-bench-traffic-{uuid.uuid4().hex[:8]}"
    if args.redis_url:
        variants["redis1"] = TrafficSettings(sample_rate=1.0, store="redis", redis_url=args.redis_url, stream_key=key)
        labels["redis1"] = "sample rate 1.0, Redis stream"
    pipelines = {name: await Pipeline.build(settings_for(paths, args, t)) for name, t in variants.items()}
    items = np.random.default_rng(args.size).integers(0, args.size, args.queries)
    try:
        for pipeline in pipelines.values():  # warm the caches and the index pages alike
            for item in items:
                await pipeline.search([Query("text", f"item-{int(item):010d} caption-1")])
            await pipeline.drain()

        def call(name: str) -> Any:
            return lambda i: pipelines[name].search([Query("text", f"item-{int(items[i]):010d} caption-1")])

        samples = await interleave({name: call(name) for name in pipelines}, args.queries)
        stored = {}
        for name, pipeline in pipelines.items():
            if pipeline.traffic is not None:
                pipeline.traffic.flush()
                stored[name] = pipeline.traffic.store.count()
    finally:
        for pipeline in pipelines.values():
            await pipeline.aclose()
        shutil.rmtree(shards, ignore_errors=True)
        if args.redis_url:
            import redis

            redis.Redis.from_url(args.redis_url).delete(key)
    rows = ratio_rows(samples, labels, base="rate0", floor="rate0")
    for row in rows:
        row.pop("p50_ratio_vs_bare", None)
    return {"rows": rows, "stored_pairs": stored, "micro": offer_micro(), "args": vars(args)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=50_000)
    parser.add_argument("--queries", type=int, default=600)
    parser.add_argument("--nprobe", type=int, default=16)
    parser.add_argument("--encoder-ms", type=float, default=8.0, help="simulated cost per encoder batch")
    parser.add_argument("--encoder-item-ms", type=float, default=0.25, help="simulated cost per item")
    parser.add_argument("--max-wait-ms", type=float, default=1.0)
    parser.add_argument("--redis-url", help="also time sampling into a Redis stream at rate 1.0")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(table(result["rows"]))
    print("stored pairs:", result["stored_pairs"])
    print("offer() alone:", ", ".join(f"{k} {v:.1f}" for k, v in result["micro"].items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
