"""In-process benchmark of the query path, every figure a ratio measured side by side in one run.

    python loadtest/bench_pipeline.py --sizes 100000 1000000 --queries 400 [--gallery-1e7 DIR]

For each gallery size it builds (once, under artifacts/bench/) the OLD-model gallery and a
re-indexed baseline gallery of NEW-model embeddings with the same index parameters, fits a
profile, then times single queries (batch 1) through `Pipeline.search`:

- re-indexed service: this same service after a full backfill -- the new model as its only
  encoder, the re-indexed gallery, no compat transform (mode `old` on an identity profile), so
  validation, metrics and threading cost the same on both sides and the ratio is the compat cost;
- bare re-indexed floor: the new encoder's batcher + a faiss search and nothing else (no
  validation, metrics or result objects), shown beside it for transparency;
- slerp, warm cache: old embedding from the in-process cache, new encoder, transform, search;
- slerp, cold cache, encoders concurrent, and the same with encoders sequential;
- micro-batching on vs off with 32 concurrent clients (throughput);
- float16 vs float32 cache, and the flat vs the HNSW coarse quantizer: warm-cache latency and
  hit@10 of the served answers.

The synthetic encoders are tiny; each is given a simulated per-batch cost (`--encoder-ms`,
`--encoder-item-ms`) so the figures have the shape of real models on an accelerator. That cost
is simulated and said so in the output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import Baseline, cli, percentiles, table, time_one, write_identity_profile

from service.encoders.registry import create_encoder
from service.encoders.synthetic import SyntheticNewEncoder
from service.index.gallery import Gallery
from service.pipeline import Pipeline, Query
from service.settings import ApiSettings, CacheSettings, CompatSettings, EncoderSettings, IndexSettings, Settings

ROOT = Path("artifacts/bench")
DTYPES = ("float16", "float32")
COARSE = ("flat", "hnsw")


def prepare(size: int, old_gallery: Path | None) -> dict[str, Path]:
    """Old gallery, re-indexed baseline gallery and profile for one size (built once, then reused)."""
    base = ROOT / f"n{size}"
    paths = {
        "old": old_gallery or base / "old-gallery",
        "new": base / "new-gallery",
        "support": ROOT / "support",
        "profile": ROOT / "profile",
    }
    if not (paths["old"] / "gallery.json").exists():
        cli("gallery", "build", "--size", str(size), "--out", paths["old"], "--force")
    nlist = str(Gallery.load(paths["old"]).nlist)
    if not (paths["new"] / "gallery.json").exists():
        cli(
            "gallery", "build", "--size", str(size), "--synthetic-model", "new", "--nlist", nlist, "--out", paths["new"]
        )
    paths["reindexed"] = base / "reindexed-profile"
    if not (paths["reindexed"] / "profile.json").exists():
        new = SyntheticNewEncoder()
        write_identity_profile(paths["reindexed"], new.model_id, new.dim)
    if not (paths["profile"] / "profile.json").exists():
        if not (paths["support"] / "old_query.npy").exists():
            cli("synth", "support", "--n", "20000", "--out", paths["support"])
        cli("fit", paths["support"], "--out", paths["profile"], "--force")
    return paths


def encoder_settings(backend: str, args: argparse.Namespace, batching: bool = True) -> EncoderSettings:
    """An encoder with the simulated cost of a real model, on the device asked for."""
    return EncoderSettings(
        backend=backend,
        device=args.old_device if backend.endswith("old") else args.new_device,
        simulated_cost_ms=args.encoder_ms,
        simulated_cost_per_item_ms=args.encoder_item_ms,
        batching=batching,
        max_wait_ms=args.max_wait_ms,
    )


def settings_for(paths: dict[str, Path], args: argparse.Namespace, **overrides: Any) -> Settings:
    """Service settings on the bench artifacts."""
    batching = overrides.pop("batching", True)
    values: dict[str, Any] = {
        "old": encoder_settings("synthetic-old", args, batching),
        "new": encoder_settings("synthetic-new", args, batching),
        "index": IndexSettings(gallery_dir=paths["old"], nprobe=args.nprobe),
        "compat": CompatSettings(profile_dir=paths["profile"]),
        # 32 closed-loop clients measure how fast searches go through; their queue is bounded by the
        # clients, and a refusal by expected queue time (api.max_queue_ms) would end the run instead.
        "api": ApiSettings(max_queue_ms=0),
        **overrides,
    }
    return Settings(**values)


def caption(item: int, variant: int) -> str:
    """A caption query naming an item."""
    return f"item-{item:010d} caption-{variant}"


async def latency_rows(paths: dict[str, Path], args: argparse.Namespace, size: int) -> list[dict[str, Any]]:
    """Baseline vs slerp (warm, cold concurrent, cold sequential), interleaved query by query."""
    rng = np.random.default_rng(size)
    items = rng.integers(0, size, args.queries)
    warm = await Pipeline.build(settings_for(paths, args, cache=CacheSettings(lru_size=1_000_000)))
    cold = await Pipeline.build(settings_for(paths, args, cache=CacheSettings(lru_size=0)))
    sequential = await Pipeline.build(
        settings_for(
            paths,
            args,
            cache=CacheSettings(lru_size=0),
            compat=CompatSettings(profile_dir=paths["profile"], concurrent_encoders=False),
        )
    )
    reindexed = await Pipeline.build(
        settings_for(
            paths,
            args,
            old=encoder_settings("synthetic-new", args),
            index=IndexSettings(gallery_dir=paths["new"], nprobe=args.nprobe),
            compat=CompatSettings(profile_dir=paths["reindexed"], default_mode="old"),
            cache=CacheSettings(lru_size=0),
        )
    )
    new_encoder = create_encoder(encoder_settings("synthetic-new", args), "new")
    # The same coarse quantizer choice as the pipelines ("auto"), so only the transform differs.
    baseline = Baseline(new_encoder, Gallery.load(paths["new"], coarse="auto"), args.nprobe, args.max_wait_ms)
    await baseline.batcher.start()
    samples: dict[str, list[float]] = {"bare": [], "service": [], "warm": [], "cold": [], "sequential": []}
    try:
        for item in items[: args.queries // 10]:  # warm-up: first touches of the index pages
            await baseline.search(caption(int(item), 0))
            await reindexed.search([Query("text", caption(int(item), 0))])
            await warm.search([Query("text", caption(int(item), 0))])
        for item in items:
            await warm.search([Query("text", caption(int(item), 1))])
        await warm.drain()
        for n, item in enumerate(items):
            text = caption(int(item), 1)
            fresh = caption(int(item), 2 + n)
            # Interleaved, so machine noise hits every variant alike.
            samples["bare"].append(await time_one(baseline.search(text)))
            samples["service"].append(await time_one(reindexed.search([Query("text", text)])))
            samples["warm"].append(await time_one(warm.search([Query("text", text)])))
            samples["cold"].append(await time_one(cold.search([Query("text", fresh)])))
            samples["sequential"].append(await time_one(sequential.search([Query("text", fresh)])))
    finally:
        await baseline.batcher.stop()
        for pipeline in (reindexed, warm, cold, sequential):
            await pipeline.aclose()
    base, bare = percentiles(samples["service"]), percentiles(samples["bare"])
    rows = []
    for name, label in (
        ("service", "re-indexed service (baseline: new encoder, new gallery, no transform)"),
        ("bare", "bare re-indexed floor (encoder batcher + faiss only)"),
        ("warm", "slerp, warm cache"),
        ("cold", "slerp, cold cache, encoders concurrent"),
        ("sequential", "slerp, cold cache, encoders sequential"),
    ):
        stats = percentiles(samples[name])
        rows.append(
            {
                "size": size,
                "variant": label,
                **stats,
                "p50_ratio": stats["p50_ms"] / base["p50_ms"],
                "p99_ratio": stats["p99_ms"] / base["p99_ms"],
                "p50_ratio_vs_bare": stats["p50_ms"] / bare["p50_ms"],
            }
        )
    return rows


async def throughput(paths: dict[str, Path], args: argparse.Namespace, batching: bool, size: int) -> float:
    """Queries per second with 32 concurrent clients on a cold cache."""
    pipeline = await Pipeline.build(settings_for(paths, args, cache=CacheSettings(lru_size=0), batching=batching))
    per_client: int = max(args.queries // 32, 4)

    async def client(c: int) -> None:
        for j in range(per_client):
            await pipeline.search([Query("text", caption((c * 7919 + j * 104729) % size, 3 + j))])

    try:
        start = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(32)))
        elapsed = time.perf_counter() - start
    finally:
        await pipeline.aclose()
    return 32 * per_client / elapsed


async def warm_rows(
    paths: dict[str, Path], args: argparse.Namespace, size: int, column: str, variants: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Warm-cache latency and hit@10 of the served answers for each variant of some settings."""
    items = np.random.default_rng(size + 1).integers(0, size, args.queries)
    rows = []
    for value, overrides in variants.items():
        values = {"cache": CacheSettings(lru_size=1_000_000), **overrides}
        pipeline = await Pipeline.build(settings_for(paths, args, **values))
        try:
            for item in items:
                await pipeline.search([Query("text", caption(int(item), 1))])
            await pipeline.drain()
            hits, times = 0, []
            for item in items:
                start = time.perf_counter()
                outcome = await pipeline.search([Query("text", caption(int(item), 1))])
                times.append(time.perf_counter() - start)
                assert outcome.results[0].cache == "hit"
                hits += int(item) in outcome.results[0].ids
        finally:
            await pipeline.aclose()
        rows.append({"size": size, column: value, **percentiles(times), "hit@10": hits / len(items)})
    return rows


async def main() -> None:
    """Run every comparison for every size and print markdown tables (and JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000])
    parser.add_argument("--queries", type=int, default=400)
    parser.add_argument("--nprobe", type=int, default=16)
    parser.add_argument("--encoder-ms", type=float, default=8.0, help="simulated cost per encoder batch")
    parser.add_argument("--encoder-item-ms", type=float, default=0.25, help="simulated cost per item")
    parser.add_argument("--max-wait-ms", type=float, default=1.0)
    parser.add_argument("--old-device", default="auto", help="cpu, cuda:0, ... (auto: see resolve_device)")
    parser.add_argument("--new-device", default="auto")
    parser.add_argument("--old-gallery", type=Path, help="reuse an existing old gallery (largest size only)")
    parser.add_argument("--json", type=Path, help="also write all rows here")
    args = parser.parse_args()
    print(f"simulated encoder cost: {args.encoder_ms} ms per batch + {args.encoder_item_ms} ms per item")
    latency, batching, dtypes, coarse = [], [], [], []
    for size in args.sizes:
        reuse = args.old_gallery if size == max(args.sizes) else None
        paths = prepare(size, reuse)
        latency += await latency_rows(paths, args, size)
        on = await throughput(paths, args, True, size)
        off = await throughput(paths, args, False, size)
        batching.append({"size": size, "batching on q/s": on, "batching off q/s": off, "ratio": on / off})
        dtypes += await warm_rows(
            paths, args, size, "cache dtype", {d: {"cache": CacheSettings(lru_size=1_000_000, dtype=d)} for d in DTYPES}
        )
        coarse += await warm_rows(
            paths,
            args,
            size,
            "coarse quantizer",
            {c: {"index": IndexSettings(gallery_dir=paths["old"], nprobe=args.nprobe, coarse=c)} for c in COARSE},
        )
    for title, rows in (
        ("latency, batch 1", latency),
        ("micro-batching, 32 clients", batching),
        ("cache dtype", dtypes),
        ("coarse quantizer (warm slerp)", coarse),
    ):
        print(f"\n### {title}\n\n{table(rows)}")
    if args.json:
        everything = {"latency": latency, "batching": batching, "dtype": dtypes, "coarse": coarse}
        args.json.write_text(json.dumps(everything, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
