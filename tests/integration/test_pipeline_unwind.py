"""The pipeline and the app start through one exit stack each: whatever is refused, nothing started stays running.

"Nothing running" is checked where it lives: encoder child processes (psutil, as in
test_encoder_process.py), the threads the parts start (batcher workers, the search pool, the traffic
drain thread, the spawners), and the event-loop tasks (the batchers' collectors, the loop-lag probe).
The encoders run in child processes here, so a leak is a process that outlives the refusal.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from service import metrics
from service.api.app import create_app
from service.cpu_limit import usable_cpus
from service.errors import ArtifactError, InputError, NobackfillError, SettingsError
from service.pipeline import Pipeline, Query
from service.query.search import search_pool_size
from service.settings import (
    CompatSettings,
    IndexSettings,
    Settings,
    TrafficSettings,
)
from service.traffic.local import LocalPairStore
from service.vocabulary import Modality
from tests.support.app import serving
from tests.support.servers import encoder_children
from tests.support.world import World, isolated_settings

# Threads the pipeline's parts start: batcher workers, spawners of encoder children, the search pool, the sampler.
PART_THREADS = ("encoder-", "spawn-", "nobackfill-search", "nobackfill-traffic")
TEXT = "item-0000000042 caption-1"


def children_left(before: set[int], timeout_s: float = 10.0) -> set[int]:
    """Encoder children started since `before` that are still running after up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    while (left := encoder_children() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def part_threads() -> list[str]:
    """Names of the live threads that belong to a pipeline's parts."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(PART_THREADS))


def part_tasks() -> list[str]:
    """Names of the pending event-loop tasks a pipeline or the app starts (batcher collectors, loop-lag probe)."""
    return sorted(
        name
        for task in asyncio.all_tasks()
        if not task.done() and ((name := task.get_name()).startswith("batcher-") or name == "loop-lag")
    )


def settings_for(world: World, isolation: str = "process", **traffic: Any) -> Settings:
    """The synthetic world with both encoders under `isolation`, no cache, and `traffic` settings."""
    return isolated_settings(world, isolation, traffic=TrafficSettings(**traffic))


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port that another socket listens on for the whole test."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        yield int(holder.getsockname()[1])


async def lifespan_startup(app: Any) -> dict[str, Any]:
    """Run the app's ASGI lifespan startup as uvicorn does; the message the app answered it with."""
    asked = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return asked.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
    try:
        await app(scope, receive, send)
    except NobackfillError:
        pass  # Starlette reports a failed startup and raises it again, as it must
    return next(m for m in sent if m["type"].startswith("lifespan.startup."))


def in_flight() -> float:
    """nobackfill_requests_in_flight now."""
    return metrics.REGISTRY.get_sample_value("nobackfill_requests_in_flight") or 0.0


def unwritable_dir(tmp_path: Path) -> Path:
    """A folder that cannot be created, even by root: a plain file stands where its parent should be."""
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    return in_the_way / "traffic"


async def test_a_traffic_folder_refused_late_unwinds_every_part_in_one_line(world: World, tmp_path: Path) -> None:
    folder = unwritable_dir(tmp_path)
    before = encoder_children()
    # Refused after both encoder children started and the gallery and profile loaded.
    with pytest.raises(ArtifactError) as refused:
        await Pipeline.build(settings_for(world, sample_rate=0.5, store="local", local_dir=folder))
    message = refused.value.message
    assert "\n" not in message and str(folder) in message and "NOBACKFILL_TRAFFIC__LOCAL_DIR" in message, message
    assert children_left(before) == set()
    assert part_threads() == [] and part_tasks() == []


async def test_a_redis_store_without_a_url_refused_late_unwinds_every_part(world: World) -> None:
    settings = settings_for(world, sample_rate=0.5)
    settings.traffic.store = "redis"  # set after validation: whatever refuses it first, the build must unwind
    before = encoder_children()
    with pytest.raises(InputError) as refused:
        await Pipeline.build(settings)
    assert "\n" not in refused.value.message and "NOBACKFILL_TRAFFIC__REDIS_URL" in refused.value.message
    assert children_left(before) == set()
    assert part_threads() == [] and part_tasks() == []


async def test_an_nprobe_setting_over_the_nlist_is_refused_as_a_request_would_be(world: World) -> None:
    settings = settings_for(world, isolation="thread")
    settings.index.nprobe = 100_000  # set, not defaulted: a request asking for it gets 400
    with pytest.raises(SettingsError) as refused:
        await Pipeline.build(settings)
    message = refused.value.message
    assert message.startswith("NOBACKFILL_INDEX__NPROBE=100000 is over the gallery's nlist "), message
    assert part_threads() == [] and part_tasks() == []


async def test_the_unset_nprobe_default_is_capped_at_a_small_gallerys_nlist(world: World) -> None:
    settings = settings_for(world, isolation="thread")
    settings.index = IndexSettings(gallery_dir=world.gallery_dir)  # nprobe left at its default
    pipeline = await Pipeline.build(settings)
    try:
        nlist = pipeline.gallery.max_nprobe
        assert nlist is not None
        assert pipeline.default_nprobe() == min(settings.index.nprobe, nlist)
    finally:
        await pipeline.aclose()


async def test_every_missing_folder_is_named_at_once_before_a_model_loads(tmp_path: Path) -> None:
    settings = Settings(
        index=IndexSettings(gallery_dir=tmp_path / "no-gallery"),
        compat=CompatSettings(profile_dir=tmp_path / "no-profile"),
    )
    before = encoder_children()
    with pytest.raises(ArtifactError) as refused:
        await Pipeline.build(settings)
    message = refused.value.message
    assert "\n" not in message
    assert f"NOBACKFILL_INDEX__GALLERY_DIR={tmp_path / 'no-gallery'}: no such folder" in message
    assert f"NOBACKFILL_COMPAT__PROFILE_DIR={tmp_path / 'no-profile'}: no such folder" in message
    assert "make demo" in message and "artifacts/demo/" in message
    assert children_left(before) == set() and part_threads() == []


async def test_the_app_refuses_a_late_failure_in_one_line(world: World, tmp_path: Path) -> None:
    folder = unwritable_dir(tmp_path)
    app = create_app(settings_for(world, isolation="thread", sample_rate=0.5, store="local", local_dir=folder))
    failed = await lifespan_startup(app)
    assert failed["type"] == "lifespan.startup.failed"
    assert failed["message"].startswith(f"refusing to start: traffic.local_dir {folder} cannot hold the sampled pairs")
    assert "\n" not in failed["message"] and app.state.pipeline is None
    assert part_threads() == [] and part_tasks() == []


async def test_a_taken_metrics_port_refuses_in_one_line_and_leaves_nothing_running(
    world: World, tmp_path: Path, taken_port: int
) -> None:
    # Every part is up (encoder children, batchers, search pool, a sampler) when the metrics port is refused.
    settings = settings_for(world, sample_rate=0.5, store="local", local_dir=tmp_path / "traffic")
    settings.api.metrics_port = taken_port
    before = encoder_children()
    app = create_app(settings)
    failed = await lifespan_startup(app)
    assert failed == {
        "type": "lifespan.startup.failed",
        "message": f"refusing to start: cannot serve metrics on 127.0.0.1:{taken_port}: Address already in use",
    }
    assert app.state.pipeline is None
    assert children_left(before) == set()
    assert part_threads() == [] and part_tasks() == []


async def test_aclose_unwinds_every_part_a_serving_pipeline_started(world: World, tmp_path: Path) -> None:
    store = tmp_path / "traffic"
    before = encoder_children()
    pipeline = await Pipeline.build(settings_for(world, sample_rate=1.0, store="local", local_dir=store))
    try:
        outcome = await pipeline.search([Query(Modality.text, TEXT)], k=3, mode="slerp")
        assert len(outcome.results[0].ids) == 3
        assert len(encoder_children() - before) == 2
        running = part_threads()
        assert any(n.startswith("encoder-old") for n in running) and any(n.startswith("encoder-new") for n in running)
        assert any(n.startswith("nobackfill-search") for n in running) and "nobackfill-traffic" in running
    finally:
        await pipeline.aclose()
    assert children_left(before) == set()
    assert part_threads() == [] and part_tasks() == []
    assert pipeline.draining
    assert LocalPairStore(store, max_pairs=10, ttl_s=600).count() == 1  # the sampler flushed before it stopped


async def test_the_in_flight_gauge_counts_the_queries_of_a_request(world: World) -> None:
    settings = settings_for(world, isolation="thread")
    settings.new.simulated_cost_per_item_ms = 100  # the 5-query batch holds the request for half a second
    async with serving(settings) as running:
        before = in_flight()
        queries = [{"text": f"item-{i:010d} caption-1"} for i in range(5)]
        request = asyncio.create_task(running.search(queries=queries, k=3))
        seen = before
        while seen == before and not request.done():
            await asyncio.sleep(0.005)
            seen = in_flight()
        response = await request
        assert response.status_code == 200, response.text
        assert seen - before == 5
        assert in_flight() == before


async def test_searches_run_on_the_pipelines_own_pool_of_the_configured_size(world: World) -> None:
    settings = settings_for(world, isolation="thread")
    settings.index.search_threads = 3
    async with serving(settings) as running:
        pipeline = running.pipeline
        assert pipeline.search_threads == 3 and pipeline.search_pool._max_workers == 3
        answers = await asyncio.gather(*(running.search(queries=[{"text": TEXT}], k=3) for _ in range(12)))
        assert [a.status_code for a in answers] == [200] * 12
        pool = [n for n in part_threads() if n.startswith("nobackfill-search")]
        assert 1 <= len(pool) <= 3, pool
    assert part_threads() == []


def blas_threads() -> list[int]:
    """Threads of each BLAS library loaded in this process (numpy's and faiss's OpenBLAS)."""
    from threadpoolctl import threadpool_info  # type: ignore[import-untyped]

    return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]


async def test_blas_runs_on_one_thread_while_a_pipeline_serves_and_gets_its_threads_back_after(world: World) -> None:
    # A request's products are too small to split; spare BLAS threads only spin on the cores the next
    # request needs (service/blas_threads.py).  Offline work in the same process keeps its threads.
    before = blas_threads()
    async with serving(settings_for(world, isolation="thread")) as running:
        assert blas_threads() and set(blas_threads()) == {1}
        answer = await running.search(queries=[{"text": TEXT}], k=3)
        assert answer.status_code == 200
    assert blas_threads() == before


def test_the_search_pool_size_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert search_pool_size(IndexSettings()) == usable_cpus()  # FAISS computes: one thread per usable CPU
    assert search_pool_size(IndexSettings(backend="milvus")) == min(32, usable_cpus() + 4)  # Milvus mostly waits
    assert search_pool_size(IndexSettings(search_threads=5, backend="milvus")) == 5
    monkeypatch.setenv("NOBACKFILL_INDEX__SEARCH_THREADS", "7")
    assert Settings().index.search_threads == 7
    with pytest.raises(ValidationError):
        IndexSettings(search_threads=0)


def test_a_local_store_checks_its_folder_before_the_first_pair(tmp_path: Path) -> None:
    fresh = LocalPairStore(tmp_path / "new" / "traffic", max_pairs=10, ttl_s=60)
    fresh.check_writable()  # creates the folder and leaves nothing in it
    assert fresh.folder.is_dir() and list(fresh.folder.iterdir()) == []
    with pytest.raises(OSError):
        LocalPairStore(unwritable_dir(tmp_path), max_pairs=10, ttl_s=60).check_writable()
