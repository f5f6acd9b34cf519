"""In-process benchmark of the query path with the two REAL encoders, every figure a ratio measured side by side.

    python loadtest/bench_real.py --sizes 100000 1000000 [--queries 1000] [--threads default deployment]

What is real and what is not:
- the encoders are the real upgrade of `nobackfill demo --real`: OLD minilm-static-256 (a static
  model2vec model, 256-d), NEW all-MiniLM-L6-v2 (a 6-layer transformer, 384-d), each through the
  service's `sentence-transformers` backend behind its micro-batcher (CPU unless --old-device /
  --new-device say otherwise), with the demo's fitted slerp profile;
- the queries are real: the corpus's test queries (docstring summaries), one per timed call;
- the galleries are real embeddings grown with synthetic filler.  Encoding 10^6 texts with MiniLM
  on 2 cores is out of reach, so the corpus's 4,520 gallery texts are embedded by each model (old:
  the demo's gallery-old.npy; new: `nobackfill encode`, once, cached under --work) and grown to N
  rows: row j < 4,520 is text j's own embedding, row j >= 4,520 a noisy copy
  normalise(e[j mod 4520] + sigma g_j / sqrt(d)).  Both galleries use the same item index and the
  same noise draw g_j (the 256-d one reads its first 256 coordinates), so row j is "the same item"
  in both.  The filler changes nothing on the timed path but the sizes of the inverted lists a
  search scans, which is what a gallery of N items costs there.

Both galleries are built by `nobackfill gallery build --from-npy` with the same index parameters
(the nlist the builder picks for N, PQ64x8: 64 divides 256 and 384).  Variants, each timed on the
same query in turn (interleaved, which one goes first rotating), batch 1, k 10:
- re-indexed service: this same service after a full backfill -- the new model as its only
  encoder, the new-model gallery, no transform (mode `old` on an identity profile), so validation,
  metrics and threads cost the same on both sides and the ratio is what the compatibility path adds;
- bare floor: the new encoder's micro-batcher + one faiss search and nothing else;
- slerp, warm cache: old embedding from the in-process cache, new encoder, transform, search;
- slerp, cold cache, encoders concurrent; and the same with the encoders one after the other.

Thread plans (--threads, CPU only):
- default: every encoder takes the service's default, half the usable cores (`cpu_threads`), the
  re-indexed service's encoder too;
- deployment: the new encoder on every core, the static old one on 1 thread, the re-indexed
  service's encoder on every core (a cheap old model beside an expensive new one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from benchlib import Baseline, cli, interleave, ratio_rows, table, write_identity_profile

from service.commands.real_demo import BACKEND, RealDeployment, prepare
from service.encoders.base import cpu_threads
from service.encoders.registry import create_encoder
from service.index.gallery import Gallery
from service.pipeline import Pipeline, Query
from service.settings import CacheSettings, CompatSettings, EncoderSettings, IndexSettings, Settings

WORK = Path("artifacts/bench-real")
LABELS = {
    "service": "re-indexed service (baseline: new encoder, new gallery, no transform)",
    "bare": "bare re-indexed floor (encoder batcher + faiss only)",
    "warm": "slerp, warm cache",
    "cold": "slerp, cold cache, encoders concurrent",
    "sequential": "slerp, cold cache, encoders sequential",
}
TARGETS = {"warm": 1.03, "cold": 1.10}  # issue 10: p50 and p99 against the re-indexed service


@dataclass(frozen=True)
class ThreadPlan:
    """Torch threads per encoder on CPU; None is the service's default (`cpu_threads`)."""

    name: str
    old: int | None
    new: int | None  # the re-indexed service's encoder gets the same

    def describe(self, old_device: str = "cpu", new_device: str = "cpu") -> str:
        """'old 1 / new 2 / re-indexed 2' with the defaults resolved; the devices instead when on CUDA."""
        if "cpu" not in (old_device, new_device):
            return f"old {old_device} / new {new_device} / re-indexed {new_device}"
        old, new = cpu_threads(self.old), cpu_threads(self.new)
        return f"old {old} / new {new} / re-indexed {new}"


def thread_plans(names: list[str]) -> list[ThreadPlan]:
    """The plans asked for, in order."""
    cores = len(os.sched_getaffinity(0))
    plans = {"default": ThreadPlan("default", None, None), "deployment": ThreadPlan("deployment", 1, cores)}
    return [plans[name] for name in names]


def expand(sources: dict[str, Path], outs: dict[str, Path], n: int, sigma: float, seed: int) -> None:
    """Grow each source .npy to n rows as the module docstring says, one noise draw for all; OUT.json beside each."""
    bases = {name: np.load(path, mmap_mode="r") for name, path in sources.items()}
    (m,) = {base.shape[0] for base in bases.values()}
    width = max(base.shape[1] for base in bases.values())
    outputs = {
        name: np.lib.format.open_memmap(outs[name], mode="w+", dtype=np.float32, shape=(n, base.shape[1]))
        for name, base in bases.items()
    }
    chunk = 65_536
    for start in range(0, n, chunk):
        rows = np.arange(start, min(n, start + chunk))
        noise = np.random.default_rng([seed, start]).standard_normal((rows.size, width), dtype=np.float32)
        noise[rows < m] = 0  # the corpus's own rows stay its real embeddings
        for name, base in bases.items():
            d = base.shape[1]
            x = np.asarray(base[rows % m], dtype=np.float32) + (sigma / np.sqrt(d)) * noise[:, :d]
            outputs[name][rows[0] : rows[-1] + 1] = x / np.linalg.norm(x, axis=1, keepdims=True)
    for name, out in outputs.items():
        out.flush()
        # The encoder's OUT.json, so `gallery build` records the model identity the service checks.
        meta = json.loads(sources[name].with_suffix(".json").read_text())
        meta.update(count=n, file=outs[name].name, filler={"source": str(sources[name]), "sigma": sigma, "seed": seed})
        outs[name].with_suffix(".json").write_text(json.dumps(meta, indent=2))


def new_embeddings(real: RealDeployment, work: Path, device: str) -> Path:
    """The corpus gallery texts through the NEW model (`nobackfill encode`, cached)."""
    out = work / "gallery-new.npy"
    if not out.with_suffix(".json").exists():
        gallery_txt = real.corpus / "gallery.txt"
        cli("encode", "--backend", BACKEND, "--path", real.new_model, "--input", gallery_txt, "--out", out,
            "--device", device, "--force")  # fmt: skip
    return out


def galleries(real: RealDeployment, work: Path, size: int, args: argparse.Namespace) -> tuple[Path, Path]:
    """(old gallery, re-indexed new gallery) of `size` items with the same nlist and PQ, built once."""
    base = work / f"n{size}-sigma{args.sigma:g}"
    old, new = base / "old-gallery", base / "new-gallery"
    if (old / "gallery.json").exists() and (new / "gallery.json").exists():
        return old, new
    base.mkdir(parents=True, exist_ok=True)
    npys = {"old": base / "old.npy", "new": base / "new.npy"}
    sources = {"old": real.root / "gallery-old.npy", "new": new_embeddings(real, work, args.new_device)}
    expand(sources, npys, size, args.sigma, seed=size)
    cli("gallery", "build", "--from-npy", npys["old"], "--out", old, "--force")
    nlist = str(Gallery.load(old).nlist)
    cli("gallery", "build", "--from-npy", npys["new"], "--nlist", nlist, "--out", new, "--force")
    for path in npys.values():  # build inputs only (1-1.5 GB each at 10^6): the galleries hold them now
        path.unlink()
        path.with_suffix(".json").unlink()
    return old, new


def gallery_row(size: int, name: str, path: Path) -> dict[str, Any]:
    """Facts of one built gallery: factory, list balance (1.0 = even), build time."""
    gallery = Gallery.load(path)
    meta = gallery.meta
    lists = faiss.extract_index_ivf(gallery.faiss_index).invlists
    assert lists is not None
    return {
        "size": size,
        "gallery": name,
        "factory": meta["factory"],
        "list imbalance": float(lists.imbalance_factor()),
        "build s": float(meta["build"]["total_s"]),
    }


def reindexed_profile(work: Path) -> Path:
    """The identity profile of the re-indexed service, for the new model recorded beside its embeddings."""
    meta = json.loads((work / "gallery-new.json").read_text())
    path = work / "reindexed-profile"
    write_identity_profile(path, str(meta["model_id"]), int(meta["dim"]))
    return path


def load_queries(real: RealDeployment, n: int) -> tuple[list[str], list[int]]:
    """n test queries (cycled if n exceeds them) and the gallery row of each one's relevant text."""
    rows = [json.loads(line) for line in (real.corpus / "test.jsonl").read_text(encoding="utf-8").splitlines()]
    ids = np.load(real.corpus / "gallery_ids.npy")
    position = {int(item): row for row, item in enumerate(ids.tolist())}
    picked = [rows[i % len(rows)] for i in range(n)]
    return [str(r["query"]) for r in picked], [position.get(int(r["target_id"]), -1) for r in picked]


def encoder_settings(path: Path, device: str, threads: int | None, args: argparse.Namespace) -> EncoderSettings:
    """A sentence-transformers encoder as the service would run it."""
    return EncoderSettings(
        backend=BACKEND,
        path=str(path),
        device=device,
        threads=threads,
        max_wait_ms=args.max_wait_ms,
        isolation=args.isolation,
    )


async def latency_rows(
    real: RealDeployment, paths: tuple[Path, Path, Path], plan: ThreadPlan, size: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Every variant on the same queries, interleaved; rows with ratios to the re-indexed service."""
    old_gallery, new_gallery, reindexed = paths
    old = encoder_settings(real.old_model, args.old_device, plan.old, args)
    new = encoder_settings(real.new_model, args.new_device, plan.new, args)
    index = IndexSettings(gallery_dir=old_gallery, nprobe=args.nprobe)
    compat = CompatSettings(profile_dir=real.profile)
    off = CacheSettings(lru_size=0)
    pipelines = {
        "service": Settings(
            old=new,
            new=new,
            index=IndexSettings(gallery_dir=new_gallery, nprobe=args.nprobe),
            compat=CompatSettings(profile_dir=reindexed, default_mode="old"),
            cache=off,
        ),
        "warm": Settings(old=old, new=new, index=index, compat=compat, cache=CacheSettings(lru_size=1_000_000)),
        "cold": Settings(old=old, new=new, index=index, compat=compat, cache=off),
        "sequential": Settings(
            old=old,
            new=new,
            index=index,
            compat=CompatSettings(profile_dir=real.profile, concurrent_encoders=False),
            cache=off,
        ),
    }
    built: dict[str, Pipeline] = {}
    bare = Baseline(create_encoder(new, "new"), Gallery.load(new_gallery, coarse="auto"), args.nprobe, args.max_wait_ms)
    texts, targets = load_queries(real, args.queries)
    hits = dict.fromkeys(pipelines, 0)
    try:
        for name, settings in pipelines.items():
            built[name] = await Pipeline.build(settings)
        await bare.batcher.start()
        # The warm cache holds every query's old embedding, written as the pipeline writes a miss.
        warm = built["warm"]
        for start in range(0, len(texts), 32):
            batch = texts[start : start + 32]
            await warm.cache.set_many("text", batch, await warm.old.encode(batch, "text"))

        def searcher(name: str) -> Callable[[int], Awaitable[None]]:
            async def call(i: int) -> None:
                if name == "bare":
                    await bare.search(texts[i])
                    return
                outcome = await built[name].search([Query("text", texts[i])])
                hits[name] += int(targets[i] in outcome.results[0].ids)

            return call

        calls = {name: searcher(name) for name in LABELS}
        await interleave(calls, max(5, len(texts) // 10))  # warm-up: first touches of pages and kernels
        hits.update(dict.fromkeys(hits, 0))
        samples = await interleave(calls, len(texts))
    finally:
        await bare.batcher.stop()
        for pipeline in built.values():
            await pipeline.aclose()
    rows = ratio_rows(samples, LABELS)
    for name, row in zip(LABELS, rows, strict=True):
        row["hit@10"] = hits[name] / len(texts) if name in hits else "-"
    where = plan.describe(args.old_device, args.new_device)
    return [{"size": size, "threads": where, **row} for row in rows]


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """One line per targeted row: met or missed, with the ratios."""
    lines = []
    by_label = {label: key for key, label in LABELS.items()}
    for row in rows:
        key = by_label[row["variant"]]
        if key in TARGETS:
            limit = TARGETS[key]
            met = row["p50_ratio"] <= limit and row["p99_ratio"] <= limit
            lines.append(
                f"- {row['size']:,} items, threads {row['threads']}, {row['variant']}: p50 {row['p50_ratio']:.3f}, "
                f"p99 {row['p99_ratio']:.3f} (target <= {limit}): {'met' if met else 'MISSED'}"
            )
    return lines


async def main() -> None:
    """Prepare the real artifacts and galleries, run every size x thread plan, print markdown tables."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000])
    parser.add_argument("--queries", type=int, default=1000, help="timed queries per variant (the test set has 1,000)")
    parser.add_argument("--threads", nargs="+", choices=["default", "deployment"], default=["default", "deployment"])
    parser.add_argument("--nprobe", type=int, default=16)
    parser.add_argument("--max-wait-ms", type=float, default=EncoderSettings().max_wait_ms, help="micro-batch wait")
    parser.add_argument(
        "--isolation",
        choices=["auto", "thread", "process"],
        default=EncoderSettings().isolation,
        help="the pipelines' encoders in child processes or in this one (the bare floor always in this one)",
    )
    parser.add_argument("--sigma", type=float, default=0.5, help="norm of the filler copies' noise")
    parser.add_argument("--old-device", default="cpu", help="cpu, cuda:0, ... or auto (see resolve_device)")
    parser.add_argument("--new-device", default="cpu")
    parser.add_argument("--real-dir", type=Path, default=Path("artifacts/real"), help="`demo --real` artifacts")
    parser.add_argument("--work", type=Path, default=WORK, help="where the expanded galleries are cached")
    parser.add_argument("--json", type=Path, help="also write all rows here")
    parser.add_argument("--prepare-only", action="store_true", help="build the artifacts and galleries, time nothing")
    args = parser.parse_args()
    real = RealDeployment(args.real_dir)
    prepare(real, cli)  # builds whatever of the real upgrade is missing (models, corpus, profile, ...)
    args.work.mkdir(parents=True, exist_ok=True)
    plans = thread_plans(args.threads)
    if "cpu" not in (args.old_device, args.new_device):
        plans = plans[:1]  # thread counts mean nothing on CUDA
    latency: list[dict[str, Any]] = []
    built: list[dict[str, Any]] = []
    for size in args.sizes:
        old_gallery, new_gallery = galleries(real, args.work, size, args)
        built += [gallery_row(size, "old (256-d)", old_gallery), gallery_row(size, "re-indexed (384-d)", new_gallery)]
        paths = (old_gallery, new_gallery, reindexed_profile(args.work))
        for plan in [] if args.prepare_only else plans:
            rows = await latency_rows(real, paths, plan, size, args)
            where = plan.describe(args.old_device, args.new_device)
            print(f"\n### {size:,} items, threads {where}\n\n{table(rows)}", flush=True)
            latency += rows
    print(
        f"\ndevices: old {args.old_device}, new {args.new_device}; encoders' isolation {args.isolation}; "
        f"nprobe {args.nprobe}; {args.queries} queries"
    )
    print(f"\n### galleries (filler sigma {args.sigma:g})\n\n{table(built)}")
    if latency:
        print("\n### targets\n\n" + "\n".join(verdicts(latency)))
    if args.json:
        args.json.write_text(json.dumps({"latency": latency, "galleries": built}, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
