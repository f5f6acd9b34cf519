"""The serving parts, acquired in order on one AsyncExitStack: what Pipeline.build starts and aclose() stops.

encoders (possibly child processes), gallery, profile, segment, item store, cache, traffic sampler, hit
counter, search pool, batchers, cascade.  A refusal or an exception at any step releases everything
acquired before it, last first, and the pipeline's aclose() is the same stack unwinding.  Loading runs
off the event loop, side by side where the parts do not depend on each other (both encoders; the
gallery, the profile and the warmups).

After the cut-over (old.backend none) there is no old model and no profile: the finished segment is the
gallery (segment/cutover.py): the composition has no old model (`old` None), no profile (`profile` None),
no hubness sidecar, no traffic sampler and no cascade writer, and the query path serves what that leaves
(query/validation.py: the new model alone, mode new).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from service import metrics
from service.artifact_check import check_compatible, encoder_line
from service.blas_threads import one_blas_thread
from service.cache import EmbeddingCache, create_cache
from service.compat.hubness import Corrected, load_hubness
from service.compat.profile import CompatProfile, load_profile
from service.configured_paths import refuse_missing
from service.encoders.base import Encoder, fingerprint_of
from service.encoders.batcher import MicroBatcher
from service.encoders.process import close_all, isolation_of, start_processes
from service.encoders.registry import create_encoder, identity_of
from service.errors import NobackfillError, SettingsError
from service.index.base import GalleryBackend
from service.index.factory import create_gallery
from service.items.store import ItemStore, open_beside
from service.query.cascade import Cascade
from service.query.embedding import CacheWriteBack
from service.query.hybrid import SegmentSearch
from service.query.search import search_pool_size
from service.query.validation import default_mode, served_modes
from service.segment.base import SegmentStore
from service.segment.cutover import SegmentGallery, open_finished
from service.segment.factory import finished_in_store, indexing_of, open_segment, segment_configured
from service.segment.recall_sample import RecallSampler
from service.segment.writer import SegmentWriter
from service.settings import EncoderSettings, Settings, env_name
from service.traffic.hits import HitCounter, create_hit_counter
from service.traffic.sampler import TrafficSampler, create_sampler
from service.vocabulary import Mode, Role

log = logging.getLogger("nobackfill")
T = TypeVar("T")
# A batch may grow only as large as the measured cost says ends within this share of api.max_queue_ms:
# admitted at an expected wait up to max_queue_ms, a search then waits for its own batch too, and the sum
# stays within the accepted bound (2 x max_queue_ms + the unloaded latency) with room for the estimate's error.
BATCH_SHARE = 0.5


@dataclass(frozen=True)
class Parts:
    """Every serving part, started and checked against each other; `unwind` releases them, last first.

    After the cut-over `old` and `profile` are None: the new model over the finished segment is all there is.
    """

    settings: Settings
    old: MicroBatcher | None  # None after the cut-over: no old model
    new: MicroBatcher
    cache: EmbeddingCache
    write_back: CacheWriteBack
    gallery: GalleryBackend
    profile: CompatProfile | None  # None after the cut-over: nothing maps between two models
    traffic: TrafficSampler | None  # None at traffic.sample_rate 0
    search_pool: ThreadPoolExecutor
    search_threads: int
    segment: SegmentSearch | None  # None without a segment
    hits: HitCounter | None  # None at traffic.hit_rate 0
    items: ItemStore | None  # the gallery's raw items (index.item_store), read-only; None without one
    cascade: Cascade | None  # None where mode cascade is not served
    hubness: Corrected | None  # None without compat.hubness_dir
    unwind: AsyncExitStack


async def acquire_parts(settings: Settings) -> Parts:
    """Acquire every part (loading off the event loop), check they fit, start the batchers; any failure unwinds."""
    refuse_missing(settings)  # before any model loads: every missing folder in one line
    async with AsyncExitStack() as stack:
        stack.enter_context(one_blas_thread())  # small products, spinning BLAS threads: blas_threads.py
        old_replicas, new_replicas = await _acquire_encoders(stack, settings)
        gallery, profile = await _acquire_artifacts(stack, settings, old_replicas, new_replicas)
        _refuse_nprobe_over_nlist(settings, gallery)
        old_encoder, new_encoder = old_replicas[0] if old_replicas else None, new_replicas[0]
        if profile is not None and old_encoder is not None:  # after the cut-over the segment checked the model
            check_compatible(profile, old_encoder, new_encoder, gallery, settings)
        default_mode(settings, profile)  # refuses a configured default the profile cannot serve
        hubness = await asyncio.to_thread(_hubness_for, settings, gallery, profile)
        segment = await _acquire_segment(stack, settings, new_encoder, gallery)
        items = _in_thread(stack, "the item store", partial(_open_items, settings, gallery), _close_items)
        await _all_done(items)
        writer = _acquire_writer(stack, settings, segment, items.result())
        # The old rows' cache; with no old model it is keyed by the new one and never asked (nothing reads old).
        cached = old_encoder or new_encoder
        cache = create_cache(settings.cache, cache_model_key(cached), cached.dim)
        on_unwind(stack, "the cache", cache.aclose)
        write_back = CacheWriteBack(cache)
        on_unwind(stack, "the cache writes", write_back.drain)  # before the cache closes
        traffic = await _acquire_sampler(stack, settings, old_encoder, new_encoder)
        hits = await _acquire_hits(stack, settings)
        threads = search_pool_size(settings.index)
        pool = ThreadPoolExecutor(threads, thread_name_prefix="nobackfill-search")
        on_unwind(stack, "the search pool", partial(asyncio.to_thread, pool.shutdown, True))
        queue_ms = settings.api.max_queue_ms
        new = await _started_batcher(stack, new_replicas, settings.new, "new", queue_ms)
        old = None
        if old_replicas is not None:
            old = await _started_batcher(stack, old_replicas, settings.old, "old", queue_ms)
        cascade = None
        if Mode.cascade in served_modes(settings, profile):
            knobs = settings.cascade
            cascade = Cascade(
                knobs.candidates,
                knobs.encode_budget,
                knobs.encode_timeout_s,
                new,
                pool,
                segment.segment if segment is not None else None,
                writer,
                items.result(),
            )
        if profile is not None:
            metrics.PROFILE_INFO.info({"profile_id": profile.profile_id, "head": profile.head})
        metrics.GALLERY_INFO.info({"fingerprint": gallery.fingerprint, "ntotal": str(gallery.ntotal)})
        return Parts(
            settings,
            old,
            new,
            cache,
            write_back,
            gallery,
            profile,
            traffic,
            pool,
            threads,
            segment,
            hits,
            items.result(),
            cascade,
            hubness,
            stack.pop_all(),
        )


def cache_model_key(encoder: Encoder) -> str:
    """The model part of the cache key: the id, and the weights fingerprint when there is one.

    With the fingerprint in the key, retrained weights under an unchanged name never read the old
    weights' cached rows.
    """
    fingerprint = fingerprint_of(encoder)
    return encoder.model_id if fingerprint is None else f"{encoder.model_id}@{fingerprint[:16]}"


def _create_encoders(settings: Settings, role: Role) -> list[Encoder]:
    """The configured encoder for `role`, one copy per replica; a failure names its settings, in one line."""
    encoder_settings = settings.old if role == Role.old else settings.new
    try:
        if isolation_of(encoder_settings) == "process":
            return start_processes(encoder_settings, role, encoder_settings.replicas)
        return [create_encoder(encoder_settings, role) for _ in range(encoder_settings.replicas)]
    except NobackfillError as exc:
        raise type(exc)(f"{role} encoder ({encoder_line(encoder_settings, role)}): {exc.message}") from exc


def _warm(replicas: list[Encoder]) -> None:
    """Warm every copy of a model (every modality it serves: the backend's warmup does each)."""
    for encoder in replicas:
        encoder.warmup()


def _close_gallery(gallery: GalleryBackend) -> None:
    """Close a gallery (a Milvus client; nothing for FAISS)."""
    gallery.close()


def _close_sampler(sampler: TrafficSampler | None) -> None:
    """Flush and stop a sampler, when there is one."""
    if sampler is not None:
        sampler.close()


def _close_items(items: ItemStore | None) -> None:
    """Close the item store's connections, when there is one."""
    if items is not None:
        items.close()


def _open_items(settings: Settings, gallery: GalleryBackend) -> ItemStore | None:
    """The item store (index.item_store), checked against the gallery; None when none is configured."""
    folder = settings.index.item_store
    return None if folder is None else open_beside(folder, gallery.ntotal, gallery.meta.get("items"))


def _close_hits(hits: HitCounter | None) -> None:
    """Flush and stop the hit counter, when there is one."""
    if hits is not None:
        hits.close()


def _hubness_for(settings: Settings, gallery: GalleryBackend, profile: CompatProfile | None) -> Corrected | None:
    """The hubness sidecar (compat.hubness_dir), checked against the gallery and the profile; None without one."""
    folder = settings.compat.hubness_dir
    if folder is None or profile is None:  # no profile (the cut-over): nothing is mapped, nothing to correct
        return None
    return Corrected(load_hubness(folder, gallery.fingerprint, profile.profile_id), settings.compat.hubness_candidates)


def on_unwind(stack: AsyncExitStack, what: str, release: Callable[[], Awaitable[object]]) -> None:
    """Push `release`; its failure is logged, so it neither hides the refusal under way nor skips the other releases."""

    async def quietly() -> None:
        try:
            await release()
        except Exception:
            log.exception("releasing %s failed", what)

    stack.push_async_callback(quietly)


def _in_thread(
    stack: AsyncExitStack, what: str, make: Callable[[], T], close: Callable[[T], object] | None = None
) -> asyncio.Task[T]:
    """Start `make` on a worker thread; the unwind waits for it (even after a cancelled build) and closes its result."""
    task = asyncio.ensure_future(asyncio.to_thread(make))

    async def release() -> None:
        await asyncio.wait([task])
        if close is not None and not task.cancelled() and task.exception() is None:
            await asyncio.to_thread(close, task.result())

    on_unwind(stack, what, release)
    return task


async def _all_done(*tasks: asyncio.Task[Any]) -> None:
    """Wait for every task, then raise every failure as one: none is left running, or unreported, behind a refusal."""
    await asyncio.wait(tasks)
    failures = [exc for task in tasks if (exc := task.exception()) is not None]
    if not failures:
        return
    first = failures[0]
    if len(failures) > 1 and all(isinstance(exc, NobackfillError) for exc in failures):
        # The gallery and the profile both missing is said at once, not one per attempt.
        raise type(first)("; ".join(str(exc) for exc in failures)) from first
    raise first


async def _acquire_encoders(stack: AsyncExitStack, settings: Settings) -> tuple[list[Encoder] | None, list[Encoder]]:
    """Both roles' encoders, built side by side; a side that started is closed on unwind, even if the other failed.

    After the cut-over there is no old model (None).
    """
    new = _in_thread(stack, "the new encoders", partial(_create_encoders, settings, Role.new), close_all)
    if settings.cut_over:
        await _all_done(new)
        return None, new.result()
    old = _in_thread(stack, "the old encoders", partial(_create_encoders, settings, Role.old), close_all)
    await _all_done(old, new)
    return old.result(), new.result()


def _refuse_nprobe_over_nlist(settings: Settings, gallery: GalleryBackend) -> None:
    """index.nprobe set above the gallery's nlist is refused, as that nprobe in a request is (400).

    Left unset, the default is capped at the nlist: a small gallery serves without being told an nprobe.
    """
    limit, nprobe = gallery.max_nprobe, settings.index.nprobe
    if "nprobe" in settings.index.model_fields_set and limit is not None and nprobe > limit:
        name = env_name("index", "nprobe")
        raise SettingsError(
            f"{name}={nprobe} is over the gallery's nlist {limit}: a request asking for it is refused (400), "
            f"and so is the setting (expected {name} in 1..{limit})"
        )


def _finished_segment(settings: Settings, new: Encoder) -> SegmentGallery:
    """After the cut-over: the finished segment as the gallery (refused unless it is the new model's, complete)."""
    model = identity_of(new, settings.new.backend)
    in_store = finished_in_store(settings.index, model)  # new rows in the pgvector or Qdrant store, every row moved
    if in_store is not None:
        return SegmentGallery(*in_store)
    assert settings.index.segment_dir is not None  # Settings refuses a cut-over without a segment
    segment = open_finished(settings.index.segment_dir, model, indexing_of(settings.index))
    return SegmentGallery(segment, segment.meta.gallery.fingerprint)


async def _acquire_artifacts(
    stack: AsyncExitStack, settings: Settings, old: list[Encoder] | None, new: list[Encoder]
) -> tuple[GalleryBackend, CompatProfile | None]:
    """The gallery and the profile, loaded while every encoder copy warms up; with no old model (the cut-over)
    the finished segment is the gallery, and there is no profile."""
    if old is None:
        # Closed on unwind: its connections (a local Qdrant folder stays locked until its client closes).
        finished = _in_thread(
            stack, "the finished segment", partial(_finished_segment, settings, new[0]), lambda done: done.close()
        )
        warm = _in_thread(stack, "the new encoders' warmup", partial(_warm, new))
        await _all_done(finished, warm)
        return finished.result(), None
    gallery = _in_thread(stack, "the gallery", partial(create_gallery, settings.index), _close_gallery)
    profile = _in_thread(stack, "the profile", partial(load_profile, settings.compat.profile_dir))
    warm_old = _in_thread(stack, "the old encoders' warmup", partial(_warm, old))
    warm_new = _in_thread(stack, "the new encoders' warmup", partial(_warm, new))
    await _all_done(gallery, profile, warm_old, warm_new)
    return gallery.result(), profile.result()


async def _acquire_sampler(
    stack: AsyncExitStack, settings: Settings, old: Encoder | None, new: Encoder
) -> TrafficSampler | None:
    """The traffic sampler (None at sample rate 0, and with no old model: no answer blends two), flushed on unwind."""
    if old is None:
        return None
    # The identities models.json records, so exported pairs are checked against support sets like for like.
    old_id, new_id = identity_of(old, settings.old.backend), identity_of(new, settings.new.backend)
    make = partial(create_sampler, settings, old_id, new_id)
    sampler = _in_thread(stack, "the traffic sampler", make, _close_sampler)
    await _all_done(sampler)
    return sampler.result()


async def _acquire_hits(stack: AsyncExitStack, settings: Settings) -> HitCounter | None:
    """The hit counter (None at traffic.hit_rate 0), flushed and stopped on unwind."""
    make = partial(create_hit_counter, settings.traffic, settings.cache.redis_url)
    hits = _in_thread(stack, "the hit counter", make, _close_hits)
    await _all_done(hits)
    return hits.result()


async def _acquire_segment(
    stack: AsyncExitStack, settings: Settings, new: Encoder, gallery: GalleryBackend
) -> SegmentSearch | None:
    """The new-model segment beside the gallery (None when the settings name none), its pool and refresh loop.

    After the cut-over it is the gallery itself, already open (SegmentGallery).
    """
    if not segment_configured(settings.index):
        return None
    segment: SegmentStore | None
    if isinstance(gallery, SegmentGallery):
        segment = gallery.segment
    else:
        model = identity_of(new, settings.new.backend)
        segment = await asyncio.to_thread(open_segment, settings.index, model, gallery)
        if segment is None:
            return None
        on_unwind(stack, "the segment", partial(asyncio.to_thread, segment.close))
    _record_segment(segment)
    # Its own threads: a hybrid search waits on the segment's search from a search pool thread.
    pool = ThreadPoolExecutor(search_pool_size(settings.index), thread_name_prefix="nobackfill-segment")
    on_unwind(stack, "the segment pool", partial(asyncio.to_thread, pool.shutdown, True))
    refresher = asyncio.ensure_future(_keep_refreshed(segment, settings.index.segment_refresh_s))

    async def stop_refreshing() -> None:
        refresher.cancel()
        await asyncio.wait([refresher])

    on_unwind(stack, "the segment refresh", stop_refreshing)
    recall = RecallSampler(settings.index.segment_recall_every)
    on_unwind(stack, "the segment's recall sampler", partial(asyncio.to_thread, recall.close))
    return SegmentSearch(segment, settings.index.hybrid_merge, pool, recall)


async def _keep_refreshed(segment: SegmentStore, every_s: float) -> None:
    """Pick up the shards published since, every `every_s`; a failure is logged and the current snapshot serves on."""
    while True:
        await asyncio.sleep(every_s)
        try:
            loaded = await asyncio.to_thread(segment.refresh)
        except Exception as exc:  # a segment.json of another model, an unreadable folder: serve what we have
            log.error("segment %s: refresh failed, serving the last snapshot: %s", segment.where, exc)
            continue
        if loaded:
            log.info("segment %s: %d new part(s), coverage %.4f", segment.where, len(loaded), segment.coverage)
        _record_segment(segment)


def _record_segment(segment: SegmentStore) -> None:
    """Coverage and shard counts into the metrics."""
    metrics.BACKFILL_COVERAGE.set(segment.coverage)
    metrics.SEGMENT_SHARDS.labels(state="loaded").set(segment.parts)
    metrics.SEGMENT_SHARDS.labels(state="refused").set(len(segment.refused))


def _acquire_writer(
    stack: AsyncExitStack, settings: Settings, segment: SegmentSearch | None, items: ItemStore | None
) -> SegmentWriter | None:
    """The cascade's segment writer: with a segment folder and an item store to encode from, unless turned off.

    Closed (what waits published) after the batchers stop, so rows of calls they finish still land.
    """
    cascade = settings.cascade
    if segment is None or items is None or not cascade.write_segment or settings.cut_over:  # finished: no writes
        return None
    writer = SegmentWriter(
        segment.segment, shard_rows=cascade.shard_rows, flush_s=cascade.flush_s, max_pending=cascade.max_pending
    )
    on_unwind(stack, "the segment writer", partial(asyncio.to_thread, writer.close))
    return writer


async def _started_batcher(
    stack: AsyncExitStack, replicas: list[Encoder], settings: EncoderSettings, name: str, max_queue_ms: float
) -> MicroBatcher:
    """A started batcher over `replicas`, stopped (its pending calls finished, its threads joined) on unwind.

    Its batches are capped at BATCH_SHARE of api.max_queue_ms: an admitted search waits up to that long to
    start, then for its own batch, and the two together stay within twice it (docs/reliability.md).
    """
    batcher = MicroBatcher(
        replicas,
        settings.max_batch_size,
        settings.max_wait_ms,
        name=name,
        batching=settings.batching,
        timeout_s=settings.timeout_s,
        poison_ttl_s=settings.poison_ttl_s,
        poison_capacity=settings.poison_capacity,
        stuck_threads=settings.stuck_threads,
        max_batch_s=BATCH_SHARE * max_queue_ms / 1000 if max_queue_ms > 0 else None,
    )
    await batcher.start()
    on_unwind(stack, f"the {name} batcher", batcher.stop)
    return batcher
