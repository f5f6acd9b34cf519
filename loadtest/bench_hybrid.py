"""Hybrid search against the compatible service, side by side in one run: p50 / p99 ratios at moved shares.

    .venv/bin/python loadtest/bench_hybrid.py --items 1000000 --moved 0.1,0.5 --queries 400
    .venv/bin/python loadtest/bench_hybrid.py --items 100000 --whole-references   # the calibration's reference width
    .venv/bin/python loadtest/bench_hybrid.py --items 1000000 --ef 384   # also each share at a request's ef_search

Builds once into --work (kept between runs): a synthetic gallery of N items, its item store, a
profile, and one segment per moved share (`backfill run --order random`, each share a copy of the
previous one carried further).  Then one in-process Pipeline per variant: the compatible service (no
segment, its head's mode) and hybrid at each share, timing the same one-query requests interleaved
(benchlib.interleave).  The synthetic encoders cost well under a millisecond, so the ratios are the
search path's own, the worst case; a real model's 10-30 ms per query dilutes them.
docs/backfill.md records a run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest.benchlib import (  # noqa: E402
    cli,
    interleave,
    parse_args_and_work_folder,
    percentiles,
    ratio_interval,
    table,
)
from service.pipeline import Pipeline  # noqa: E402
from service.query.job import Query  # noqa: E402
from service.settings import CompatSettings, IndexSettings, Settings  # noqa: E402
from service.vocabulary import Modality  # noqa: E402

CAPTION = "item-{:010d} caption-1"
# Where the world is built, one folder per gallery size: bench_cascade.py and bench_backfill_share.py reuse it.
WORK = ROOT / "loadtest" / "results" / "hybrid"


def build(work: Path, items: int, moved: list[float]) -> dict[float, Path]:
    """The world's artifacts in `work` (what exists is kept); the segment folder of each moved share."""
    if not (work / "gallery" / "gallery.json").exists():
        cli("synth", "items", "--size", str(items), "--out", work / "items", "--force")
        cli("gallery", "build", "--size", str(items), "--out", work / "gallery", "--items", work / "items", "--force")
    if not (work / "profile" / "profile.json").exists():
        cli("synth", "support", "--n", "4000", "--out", work / "support", "--force")
        cli("fit", work / "support", "--out", work / "profile", "--folds", "3", "--force")
    segments, previous = {}, None
    for share in sorted(moved):
        folder = work / f"segment-{share:g}"
        if not (folder / "segment.json").exists():
            if previous is not None:
                shutil.copytree(previous, folder)
            cli(
                "backfill", "run", "--segment", folder, "--input", work / "items", "--gallery", work / "gallery",
                "--backend", "synthetic-new", "--new-model-id", "synthetic-new", "--order", "random",
                "--fraction", f"{share:g}", "--batch-size", "256",
            )  # fmt: skip
        segments[share], previous = folder, folder
    return segments


def settings(work: Path, segment: Path | None, nprobe: int, profile: str = "profile") -> Settings:
    """One variant's settings: the world, with or without a segment."""
    return Settings(
        index=IndexSettings(gallery_dir=work / "gallery", nprobe=nprobe, segment_dir=segment, segment_refresh_s=3600),
        compat=CompatSettings(profile_dir=work / profile),
    )


def whole_references_profile(work: Path) -> str:
    """A copy of the profile whose backgrounds read the same references at their spaces' full width (as profiles
    stored them before calibration.REFERENCE_RANK): the rows expanded back out of their bases, which gives the same
    backgrounds, so the same answers, at the old cost.  Its folder name under `work`."""
    from dataclasses import replace

    from service.compat.calibration import basis_tensors, reference_tensors
    from service.compat.profile import load_profile, save_profile

    profile = load_profile(work / "profile")
    tensors, calibration = dict(profile.tensors), dict(profile.calibration or {})
    for modality, line in calibration.items():
        for rows_name, basis_name in zip(reference_tensors(modality), basis_tensors(modality), strict=True):
            basis = tensors.pop(basis_name, None)
            if basis is not None:
                tensors[rows_name] = tensors[rows_name] @ basis.T
        whole = {k: v for k, v in line["background"].items() if k != "directions"}
        calibration[modality] = {**line, "background": whole}
    save_profile(replace(profile, tensors=tensors, calibration=calibration), work / "profile-whole", overwrite=True)
    return "profile-whole"


async def timed(pipelines: dict[str, tuple[Pipeline, int | None]], queries: int, items: int) -> dict[str, list[float]]:
    """Each pipeline warmed on the first texts, then the same one-query requests (at the variant's ef_search)
    timed, interleaved."""
    texts = [CAPTION.format((i * 7919) % items) for i in range(queries)]
    for pipeline, ef in pipelines.values():  # warm: every query's old row cached, every thread started
        for text in texts[:20]:
            await pipeline.search([Query(Modality.text, text)], k=10, ef_search=ef)
    calls = {
        name: (lambda i, p=pipeline, e=ef: p.search([Query(Modality.text, texts[i])], k=10, ef_search=e))
        for name, (pipeline, ef) in pipelines.items()
    }
    return await interleave(calls, queries)


async def measure(
    work: Path,
    segments: dict[float, Path],
    queries: int,
    items: int,
    nprobe: int,
    whole: bool = False,
    efs: tuple[int, ...] = (),
) -> dict[str, Any]:
    """Time every variant on the same queries, interleaved; rows of p50 / p99 and their ratios to compat.

    whole: also each share with the references at their spaces' full width (whole_references_profile).
    efs: also each share with its requests at these ef_search (the same pipeline).
    """
    variants: dict[str, tuple[Pipeline, int | None]] = {
        "compat": (await Pipeline.build(settings(work, None, nprobe)), None)
    }
    wide = whole_references_profile(work) if whole else None
    for share, folder in segments.items():
        pipeline = await Pipeline.build(settings(work, folder, nprobe))
        variants[f"hybrid {share:.0%}"] = (pipeline, None)
        for ef in efs:
            variants[f"hybrid {share:.0%}, ef_search {ef}"] = (pipeline, ef)
        if wide is not None:
            variants[f"hybrid {share:.0%}, whole-width references"] = (
                await Pipeline.build(settings(work, folder, nprobe, wide)),
                None,
            )
    try:
        samples = await timed(variants, queries, items)
    finally:
        for pipeline in {id(p): p for p, _ in variants.values()}.values():
            await pipeline.aclose()
    rows = []
    base = percentiles(samples["compat"])
    for name, times in samples.items():
        stats = percentiles(times)
        low, high = ratio_interval(times, samples["compat"], 0.5)
        rows.append(
            {
                "variant": name,
                **stats,
                "p50_ratio": stats["p50_ms"] / base["p50_ms"],
                "p50_ratio_95ci": f"{low:.3f}-{high:.3f}",
                "p99_ratio": stats["p99_ms"] / base["p99_ms"],
            }
        )
    return {"items": items, "queries": queries, "nprobe": nprobe, "rows": rows}


def main() -> None:
    """Parse flags, build what is missing, measure, print the table (and JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--moved", default="0.1,0.5", help="Moved shares, comma-separated.")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--nprobe", type=int, default=16)
    parser.add_argument(
        "--whole-references", action="store_true", help="Also each share with full-width calibration references."
    )
    parser.add_argument("--ef", default="", help="Also each share at these request ef_search, comma-separated.")
    args, work = parse_args_and_work_folder(parser, WORK)
    segments = build(work, args.items, [float(s) for s in args.moved.split(",")])
    efs = tuple(int(e) for e in args.ef.split(",") if e)
    result = asyncio.run(measure(work, segments, args.queries, args.items, args.nprobe, args.whole_references, efs))
    print(json.dumps(result) if args.json else table(result["rows"]))


if __name__ == "__main__":
    main()
