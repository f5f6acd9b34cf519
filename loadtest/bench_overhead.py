"""What nobackfill adds over the gallery's own search, part by part, in one process (issue 47's 1 ms question).

    .venv/bin/python loadtest/bench_overhead.py --queries 1000      # after `make demo` (or demo --prepare-only)

Over the demo's artifacts (artifacts/demo: the IVF-PQ gallery and the slerp profile), interleaved on the
same one-query requests (benchlib.interleave):

    gallery search        the gallery's own search of the old query row (what any store costs)
    transform             the profile's head alone: the old and new rows into one query row
    thread hop            an empty call on a worker thread and back (what the search pool costs per request)
    served, given         Pipeline.search with both embeddings sent by the caller: validation, admission,
                          transform, the hop, the search, the result objects; no encoder
    served                Pipeline.search of the text: the same plus both (synthetic) encoders and their batchers
    served, 2 ms window   the same with both batchers waiting up to 2 ms for company before a batch
                          (NOBACKFILL_*__MAX_WAIT_MS=2, the default until 2026-12-07; 0 now)

served, given minus gallery search is what nobackfill itself adds to a compatible search.
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

from loadtest.benchlib import percentiles, synthetic_encoders, table, warmed_interleave  # noqa: E402
from service.compat.heads import transform  # noqa: E402
from service.encoders.synthetic import SyntheticNewEncoder, SyntheticOldEncoder  # noqa: E402
from service.pipeline import Pipeline  # noqa: E402
from service.query.job import Query  # noqa: E402
from service.settings import CompatSettings, IndexSettings, Settings  # noqa: E402
from service.vocabulary import Modality  # noqa: E402

CAPTION = "item-{:010d} caption-1"
WINDOW_MS = 2.0  # the batchers' collection window the served path is compared with


async def measure(demo: Path, queries: int) -> list[dict[str, Any]]:
    """Every part on the same queries, interleaved: p50 / p99 rows."""
    settings = Settings(
        index=IndexSettings(gallery_dir=demo / "gallery"), compat=CompatSettings(profile_dir=demo / "profile")
    )
    pipeline = await Pipeline.build(settings)
    windowed = await Pipeline.build(settings.model_copy(update=synthetic_encoders(max_wait_ms=WINDOW_MS)))
    assert pipeline.profile is not None
    profile, gallery, nprobe = pipeline.profile, pipeline.gallery, settings.index.nprobe
    texts = [CAPTION.format((i * 7919) % gallery.ntotal) for i in range(queries)]
    old = SyntheticOldEncoder().encode(texts, Modality.text)
    new = SyntheticNewEncoder().encode(texts, Modality.text)

    async def search(i: int) -> Any:
        return gallery.search(old[i : i + 1], 10, nprobe)

    async def head(i: int) -> Any:
        return transform(profile, "slerp", old[i : i + 1], new[i : i + 1], Modality.text)

    async def hop(i: int) -> Any:  # noqa: ARG001 (interleave's signature)
        return await asyncio.get_running_loop().run_in_executor(pipeline.search_pool, lambda: None)

    calls = {
        "gallery search": search,
        "transform": head,
        "thread hop": hop,
        "served, given": lambda i: pipeline.search(
            [Query(Modality.text, old_embedding=old[i], new_embedding=new[i])], k=10, mode="slerp"
        ),
        "served": lambda i: pipeline.search([Query(Modality.text, texts[i])], k=10, mode="slerp"),
        f"served, {WINDOW_MS:g} ms window": lambda i: windowed.search(
            [Query(Modality.text, texts[i])], k=10, mode="slerp"
        ),
    }
    try:
        samples = await warmed_interleave(calls, queries, warm=50)
    finally:
        await windowed.aclose()
        await pipeline.aclose()
    stats = {name: percentiles(times) for name, times in samples.items()}
    bare = stats["gallery search"]["p50_ms"]
    return [{"variant": name, **s, "over_search_p50_ms": s["p50_ms"] - bare} for name, s in stats.items()]


def main() -> None:
    """Parse flags, measure, print the table (JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demo", type=Path, default=ROOT / "artifacts" / "demo")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not (args.demo / "profile" / "profile.json").is_file():
        raise SystemExit(f"{args.demo}: no demo artifacts; run `make demo` (or `nobackfill demo --prepare-only`)")
    rows = asyncio.run(measure(args.demo, args.queries))
    print(json.dumps(rows) if args.json else table(rows))


if __name__ == "__main__":
    main()
