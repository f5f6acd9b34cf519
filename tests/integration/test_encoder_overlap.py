"""The old and new encoders really run at the same time on a cold cache (a ratio, not a wall time)."""

from __future__ import annotations

import time

from service.pipeline import Pipeline, Query
from service.settings import CacheSettings, CompatSettings, EncoderSettings, IndexSettings, Settings
from tests.support.world import World

COST_MS = 150.0


async def timed_search(pipeline: Pipeline, text: str, mode: str) -> float:
    """Seconds one single-query search takes."""
    start = time.perf_counter()
    await pipeline.search([Query(modality="text", content=text)], k=10, mode=mode)
    return time.perf_counter() - start


async def test_cold_request_takes_well_under_the_sum_of_both_encoders(world: World) -> None:
    settings = Settings(
        old=EncoderSettings(backend="synthetic-old", simulated_cost_ms=COST_MS, max_wait_ms=0),
        new=EncoderSettings(backend="synthetic-new", simulated_cost_ms=COST_MS, max_wait_ms=0),
        cache=CacheSettings(lru_size=0),
        index=IndexSettings(gallery_dir=world.gallery_dir),
        compat=CompatSettings(profile_dir=world.profile_dir),
    )
    pipeline = await Pipeline.build(settings)
    try:
        await timed_search(pipeline, "warm", "slerp")
        old_only = await timed_search(pipeline, "item-0000000001 caption-0", "old")
        new_only = await timed_search(pipeline, "item-0000000002 caption-0", "aligned")
        both = await timed_search(pipeline, "item-0000000003 caption-0", "slerp")
    finally:
        await pipeline.aclose()
    ratio = both / (old_only + new_only)
    # Sequential encoders would give ~1.0; concurrent ones ~0.5 plus the search.
    assert ratio < 0.75, f"cold request {both:.3f}s vs old {old_only:.3f}s + new {new_only:.3f}s (ratio {ratio:.2f})"
