"""A started service keeps what its startup built out of the garbage collector's full passes (gc_pause.py)."""

from __future__ import annotations

import gc

from tests.support.app import serving
from tests.support.world import World, make_settings


async def test_startup_objects_are_frozen_once_the_pipeline_is_built(world: World) -> None:
    gc.unfreeze()  # what earlier tests of this worker froze goes back to the collector
    assert gc.get_freeze_count() == 0
    async with serving(make_settings(world)) as served:
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # torch, faiss, the encoders and the pipeline: far more than a few objects
        assert (
            await served.client.post("/v1/search", json={"queries": [{"text": "item-0000000042 caption-1"}]})
        ).status_code == 200
