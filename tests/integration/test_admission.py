"""Load shedding: while the event loop runs late, searches are refused at once; other routes are not."""

from __future__ import annotations

import asyncio
import time

from service import metrics
from service.settings import ApiSettings, CompatSettings, EncoderSettings, IndexSettings, Settings
from tests.support.app import serving
from tests.support.world import World

CAPTION = "item-{:010d} caption-1"


def settings_for(world: World, shed_lag_ms: float) -> Settings:
    return Settings(
        index=IndexSettings(gallery_dir=world.gallery_dir, nprobe=8),
        compat=CompatSettings(profile_dir=world.profile_dir),
        api=ApiSettings(shed_lag_ms=shed_lag_ms),
    )


async def test_a_late_loop_sheds_searches_with_503_and_recovers_by_itself(world: World) -> None:
    async with serving(settings_for(world, shed_lag_ms=100)) as running:
        assert (await running.search(queries=[{"text": CAPTION.format(1)}])).status_code == 200
        shed_before = metrics.REGISTRY.get_sample_value("nobackfill_shed_requests_total") or 0.0
        time.sleep(0.3)  # one stall (a GC pass, a noisy neighbour) is averaged away: nothing is shed
        await asyncio.sleep(0.02)
        assert (await running.search(queries=[{"text": CAPTION.format(5)}])).status_code == 200
        for _ in range(12):  # what a saturated CPU does: the loop's timers fire late tick after tick
            time.sleep(0.2)
            await asyncio.sleep(0)
        refused = await running.search(queries=[{"text": CAPTION.format(2)}])
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "overloaded" and refused.headers["retry-after"] == "1"
        assert "ms behind" in refused.json()["error"]["message"]
        assert metrics.REGISTRY.get_sample_value("nobackfill_shed_requests_total") == shed_before + 1
        assert (await running.client.get("/readyz")).status_code == 200  # probes are never shed
        assert (await running.client.get("/metrics")).status_code == 200
        await asyncio.sleep(1.0)  # on time again: the average falls below the limit
        assert (await running.search(queries=[{"text": CAPTION.format(3)}])).status_code == 200


async def test_shedding_off_serves_however_late(world: World) -> None:
    async with serving(settings_for(world, shed_lag_ms=0)) as running:
        for _ in range(40):
            time.sleep(0.05)
            await asyncio.sleep(0)
        assert (await running.search(queries=[{"text": CAPTION.format(4)}])).status_code == 200


async def test_searches_that_would_queue_past_max_queue_ms_are_refused_with_retry_after(world: World) -> None:
    # One 100 ms call at a time on each encoder: from the second search sent at once, the expected wait is
    # half a call or more, far over a 10 ms budget.
    encoder = {"simulated_cost_ms": 100, "max_batch_size": 1, "max_wait_ms": 0}
    settings = settings_for(world, shed_lag_ms=0).model_copy(
        update={
            "api": ApiSettings(shed_lag_ms=0, max_queue_ms=10),
            "old": EncoderSettings(backend="synthetic-old", **encoder),
            "new": EncoderSettings(backend="synthetic-new", **encoder),
        }
    )
    async with serving(settings) as running:
        assert (await running.search(queries=[{"text": CAPTION.format(1)}])).status_code == 200  # measures the cost
        before = refusals()
        answers = await asyncio.gather(*(running.search(queries=[{"text": CAPTION.format(i)}]) for i in range(8)))
        refused = [a for a in answers if a.status_code == 503]
        assert refused and all(a.status_code == 200 for a in answers if a not in refused), [a.text for a in answers]
        assert all(a.json()["error"]["code"] == "overloaded" and int(a.headers["retry-after"]) >= 1 for a in refused)
        # Refused at admission (the expected wait), or admitted and then answered before being encoded (its
        # queue deadline, 2 x MAX_QUEUE_MS, passed): never encoded and then refused.
        messages = [a.json()["error"]["message"] for a in refused]
        assert any("NOBACKFILL_API__MAX_QUEUE_MS" in m for m in messages), messages
        assert all("NOBACKFILL_API__MAX_QUEUE_MS" in m or "queue deadline" in m for m in messages), messages
        after = refusals()
        assert after["queue_time"] > before["queue_time"]
        # One count per search refused at admission, per encoder call refused at its deadline (a search has two).
        assert len(refused) <= sum(after.values()) - sum(before.values()) <= 2 * len(refused)
        assert running.pipeline.new.expected_wait_s(1) == 0.0  # drained: the next one is admitted
        assert (await running.search(queries=[{"text": CAPTION.format(9)}])).status_code == 200


def refusals() -> dict[str, float]:
    """nobackfill_admission_refusals_total by reason, now."""
    return {
        reason: metrics.REGISTRY.get_sample_value("nobackfill_admission_refusals_total", {"reason": reason}) or 0.0
        for reason in metrics.ADMISSION_REASONS
    }
