"""The query path without HTTP: the Pipeline owns its parts and answers each request in a few steps.

    validate ──► embed ──────────────────────────► transform and search ───────────► sample
    (query/validation.py)  (query/embedding.py: the   (query/search.py on the pipeline's   (traffic/, the
                            cache and both encoders    search pool; query/fallback.py       blending modes
                            at once, each behind its   for all-zero encoder rows)           only)
                            own micro-batcher)

Beside a new-model segment (index.segment_dir) the search is hybrid (query/hybrid.py); after the
cut-over (old.backend none) the finished segment is the gallery (segment/cutover.py) and the new model
serves both roles (docs/backfill.md).

build() acquires every part through one AsyncExitStack: encoders (possibly child processes), gallery,
profile, segment, item store, cache, traffic sampler, hit counter, search pool, batchers.  A refusal or
an exception at any step releases everything acquired before it, last first, and aclose() is the same
stack unwinding.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from service import metrics
from service.artifact_check import check_compatible, encoder_line
from service.cache import EmbeddingCache, create_cache
from service.compat.hubness import Corrected, load_hubness
from service.compat.profile import CompatProfile, load_profile
from service.configured_paths import refuse_missing
from service.encoders.base import Encoder, describe, fingerprint_of
from service.encoders.batcher import RETRY_AFTER_MAX_S, MicroBatcher
from service.encoders.process import close_all, isolation_of, start_processes
from service.encoders.registry import create_encoder, identity_of
from service.encoders.ticket import Ticket, admitted
from service.errors import InputError, NobackfillError, Overloaded, SettingsError
from service.index.base import GalleryBackend
from service.index.factory import create_gallery
from service.items.store import ItemStore, open_beside
from service.query.cascade import Cascade, Rerank
from service.query.embedding import CacheWriteBack, Embedder
from service.query.hybrid import SegmentSearch
from service.query.job import Query, QueryResult, SearchJob, SearchOutcome
from service.query.search import search_pool_size, transform_and_search
from service.query.validation import default_mode, served_modes, validate
from service.segment.base import SegmentStore
from service.segment.cutover import SegmentGallery, cutover_profile, open_finished
from service.segment.factory import finished_in_store, indexing_of, open_segment, segment_configured
from service.segment.writer import SegmentWriter
from service.settings import NO_MODEL, EncoderSettings, Settings, env_name
from service.traffic.hits import HitCounter, create_hit_counter
from service.traffic.sampler import TrafficSampler, create_sampler
from service.vocabulary import Merge, Mode, Role

__all__ = ["Pipeline", "Query", "QueryResult", "SearchOutcome", "cache_model_key", "default_mode"]

log = logging.getLogger("nobackfill")
T = TypeVar("T")
# An admitted search may sit in an encoder's queue this many times api.max_queue_ms before it is answered
# 503 instead of encoded: the estimate's margin of error, and the bound on an accepted search's wait.
DEADLINE_FACTOR = 2.0
# A batch may grow only as large as the measured cost says ends within this share of api.max_queue_ms:
# admitted at an expected wait up to max_queue_ms, a search then waits for its own batch too, and the sum
# stays within the accepted bound (2 x max_queue_ms + the unloaded latency) with room for the estimate's error.
BATCH_SHARE = 0.5
# Weight of each request's cache hits in the moving hit ratio that admission expects of the next ones.
HIT_WEIGHT = 0.05


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


def _returned_ids(results: list[QueryResult], k: int) -> npt.NDArray[np.int64]:
    """The returned ids, one row per result (-1 pads a short or empty list), for the hit counter."""
    ids = np.full((len(results), k), -1, dtype=np.int64)
    for row, result in enumerate(results):
        ids[row, : len(result.ids)] = result.ids
    return ids


def _hubness_for(settings: Settings, gallery: GalleryBackend, profile: CompatProfile) -> Corrected | None:
    """The hubness sidecar (compat.hubness_dir), checked against the gallery and the profile; None without one."""
    folder = settings.compat.hubness_dir
    if folder is None or settings.cut_over:
        return None
    return Corrected(load_hubness(folder, gallery.fingerprint, profile.profile_id), settings.compat.hubness_candidates)


def _stage_one(
    job: SearchJob,
    gallery: GalleryBackend,
    segment: SegmentSearch | None,
    cascade: Cascade | None,
    hubness: Corrected | None,
) -> tuple[list[QueryResult], Rerank | None]:
    """transform_and_search, then the cascade's row lookups; re-ranked here already when nothing is to be encoded."""
    results = transform_and_search(job, gallery, segment, hubness)
    if cascade is None:
        return results, None
    rerank = cascade.prepare(job, results)
    if len(rerank.wanted):
        return results, rerank
    cascade.finish(job, results, rerank)
    return results, None


def _model_info(batcher: MicroBatcher, settings: EncoderSettings) -> dict[str, Any]:
    """What /v1/info says of one encoder: its describe(), how many copies, where they run."""
    return {**describe(batcher.encoder), "replicas": len(batcher.replicas), "isolation": isolation_of(settings)}


def _on_unwind(stack: AsyncExitStack, what: str, release: Callable[[], Awaitable[object]]) -> None:
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

    _on_unwind(stack, what, release)
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


async def _acquire_encoders(stack: AsyncExitStack, settings: Settings) -> tuple[list[Encoder], list[Encoder]]:
    """Both roles' encoders, built side by side; a side that started is closed on unwind, even if the other failed.

    After the cut-over there is no old model: the new model's copies serve both roles.
    """
    new = _in_thread(stack, "the new encoders", partial(_create_encoders, settings, Role.new), close_all)
    if settings.cut_over:
        await _all_done(new)
        return new.result(), new.result()
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


def _finished_segment(settings: Settings, new: Encoder) -> tuple[GalleryBackend, CompatProfile]:
    """After the cut-over: the finished segment as the gallery, and the new model's stand-in profile."""
    model = identity_of(new, settings.new.backend)
    in_store = finished_in_store(settings.index, model)  # new rows in the pgvector or Qdrant store, every row moved
    if in_store is not None:
        return SegmentGallery(*in_store), cutover_profile(model)
    assert settings.index.segment_dir is not None  # Settings refuses a cut-over without a segment
    segment = open_finished(settings.index.segment_dir, model, indexing_of(settings.index))
    return SegmentGallery(segment, segment.meta.gallery.fingerprint), cutover_profile(model)


async def _acquire_artifacts(
    stack: AsyncExitStack, settings: Settings, old: list[Encoder], new: list[Encoder]
) -> tuple[GalleryBackend, CompatProfile]:
    """The gallery (a FAISS folder or a Milvus collection) and the profile, loaded while every encoder copy warms up."""
    if settings.cut_over:
        # Closed on unwind: its connections (a local Qdrant folder stays locked until its client closes).
        artifacts = _in_thread(
            stack, "the finished segment", partial(_finished_segment, settings, new[0]), lambda done: done[0].close()
        )
        warm = _in_thread(stack, "the new encoders' warmup", partial(_warm, new))
        await _all_done(artifacts, warm)
        return artifacts.result()
    gallery = _in_thread(stack, "the gallery", partial(create_gallery, settings.index), _close_gallery)
    profile = _in_thread(stack, "the profile", partial(load_profile, settings.compat.profile_dir))
    warm_old = _in_thread(stack, "the old encoders' warmup", partial(_warm, old))
    warm_new = _in_thread(stack, "the new encoders' warmup", partial(_warm, new))
    await _all_done(gallery, profile, warm_old, warm_new)
    return gallery.result(), profile.result()


async def _acquire_sampler(
    stack: AsyncExitStack, settings: Settings, old: Encoder, new: Encoder
) -> TrafficSampler | None:
    """The traffic sampler (None at sample rate 0), flushed and stopped on unwind."""
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
        _on_unwind(stack, "the segment", partial(asyncio.to_thread, segment.close))
    _record_segment(segment)
    # Its own threads: a hybrid search waits on the segment's search from a search pool thread.
    pool = ThreadPoolExecutor(search_pool_size(settings.index), thread_name_prefix="nobackfill-segment")
    _on_unwind(stack, "the segment pool", partial(asyncio.to_thread, pool.shutdown, True))
    refresher = asyncio.ensure_future(_keep_refreshed(segment, settings.index.segment_refresh_s))

    async def stop_refreshing() -> None:
        refresher.cancel()
        await asyncio.wait([refresher])

    _on_unwind(stack, "the segment refresh", stop_refreshing)
    return SegmentSearch(segment, settings.index.hybrid_merge, pool)


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
    if segment is None or items is None or not cascade.write_segment or settings.cut_over:
        return None
    writer = SegmentWriter(
        segment.segment, shard_rows=cascade.shard_rows, flush_s=cascade.flush_s, max_pending=cascade.max_pending
    )
    _on_unwind(stack, "the segment writer", partial(asyncio.to_thread, writer.close))
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
    _on_unwind(stack, f"the {name} batcher", batcher.stop)
    return batcher


class Pipeline:
    """Owns the encoders' batchers, the cache, the gallery, the current profile, the sampler and the search pool."""

    def __init__(
        self,
        settings: Settings,
        old: MicroBatcher,
        new: MicroBatcher,
        cache: EmbeddingCache,
        gallery: GalleryBackend,
        profile: CompatProfile,
        *,
        write_back: CacheWriteBack,
        traffic: TrafficSampler | None,
        search_pool: ThreadPoolExecutor,
        search_threads: int,
        segment: SegmentSearch | None = None,
        hits: HitCounter | None = None,
        items: ItemStore | None = None,
        cascade: Cascade | None = None,
        hubness: Corrected | None = None,
    ) -> None:
        self.settings = settings
        self.old = old
        self.new = new
        self.cache = cache
        self.gallery = gallery
        self.profile = profile
        self.write_back = write_back
        self.traffic = traffic  # None at traffic.sample_rate 0
        self.search_pool = search_pool
        self.search_threads = search_threads
        self.segment = segment  # None without index.segment_dir
        self.hits = hits  # None at traffic.hit_rate 0
        self.items = items  # the gallery's raw items (index.item_store), read-only; None without one
        self.cascade = cascade  # None where mode cascade is not served
        self.hubness = hubness  # None without compat.hubness_dir
        self.embedder = Embedder(old, new, cache, write_back, settings.compat.concurrent_encoders)
        self.in_flight = 0
        self.hit_ratio = 0.0  # the old rows the cache answers (moving): work it takes off the old encoder
        self.draining = False
        self._unwind = AsyncExitStack()  # build() hands over the stack that acquired every part

    @classmethod
    async def build(cls, settings: Settings) -> Pipeline:
        """Acquire every part (loading off the event loop), check they fit, start the batchers; any failure unwinds."""
        refuse_missing(settings)  # before any model loads: every missing folder in one line
        async with AsyncExitStack() as stack:
            old_replicas, new_replicas = await _acquire_encoders(stack, settings)
            gallery, profile = await _acquire_artifacts(stack, settings, old_replicas, new_replicas)
            _refuse_nprobe_over_nlist(settings, gallery)
            old_encoder, new_encoder = old_replicas[0], new_replicas[0]
            if not settings.cut_over:  # after it, _finished_segment checked the one model against the segment
                check_compatible(profile, old_encoder, new_encoder, gallery, settings)
            default_mode(settings, profile)  # refuses a configured default the profile cannot serve
            hubness = await asyncio.to_thread(_hubness_for, settings, gallery, profile)
            segment = await _acquire_segment(stack, settings, new_encoder, gallery)
            items = _in_thread(stack, "the item store", partial(_open_items, settings, gallery), _close_items)
            await _all_done(items)
            writer = _acquire_writer(stack, settings, segment, items.result())
            cache = create_cache(settings.cache, cache_model_key(old_encoder), old_encoder.dim)
            _on_unwind(stack, "the cache", cache.aclose)
            write_back = CacheWriteBack(cache)
            _on_unwind(stack, "the cache writes", write_back.drain)  # before the cache closes
            traffic = await _acquire_sampler(stack, settings, old_encoder, new_encoder)
            hits = await _acquire_hits(stack, settings)
            threads = search_pool_size(settings.index)
            pool = ThreadPoolExecutor(threads, thread_name_prefix="nobackfill-search")
            _on_unwind(stack, "the search pool", partial(asyncio.to_thread, pool.shutdown, True))
            queue_ms = settings.api.max_queue_ms
            new = await _started_batcher(stack, new_replicas, settings.new, "new", queue_ms)
            old = new
            if not settings.cut_over:
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
            pipeline = cls(
                settings,
                old,
                new,
                cache,
                gallery,
                profile,
                write_back=write_back,
                traffic=traffic,
                search_pool=pool,
                search_threads=threads,
                segment=segment,
                hits=hits,
                items=items.result(),
                cascade=cascade,
                hubness=hubness,
            )
            _on_unwind(stack, "the pipeline", pipeline._stop_taking_work)  # the first thing aclose() does
            metrics.PROFILE_INFO.info({"profile_id": profile.profile_id, "head": profile.head})
            metrics.GALLERY_INFO.info({"fingerprint": gallery.fingerprint, "ntotal": str(gallery.ntotal)})
            pipeline._unwind = stack.pop_all()
        return pipeline

    async def aclose(self) -> None:
        """Unwind what build() acquired, last first: the same stack a refused start unwinds.

        Stop taking work, the batchers (finishing their calls), the search pool, the sampler (flushed),
        the pending cache writes, the cache, the gallery, the encoders (their child processes).
        """
        await self._unwind.aclose()

    async def _stop_taking_work(self) -> None:
        """From now on /readyz says draining."""
        self.draining = True

    async def drain(self) -> None:
        """Wait for the background cache writes started so far."""
        await self.write_back.drain()

    def problems(self) -> list[str]:
        """Why this pipeline cannot take traffic now (empty when it can): /readyz answers 503 with these."""
        batchers = dict.fromkeys((self.old, self.new))  # one batcher after the cut-over
        found = [f"{b.name} encoder: {problem}" for b in batchers if (problem := b.problem()) is not None]
        if (gallery_problem := self.gallery.problem()) is not None:  # a remote gallery (Milvus) not answering
            found.append(f"gallery: {gallery_problem}")
        return [*found, "draining: shutting down"] if self.draining else found

    @property
    def alive(self) -> bool:
        """False once a batcher is beyond restarting: /healthz fails so the orchestrator replaces the process."""
        return self.old.alive and self.new.alive

    # -- the query path ---------------------------------------------------------------------------

    async def search(
        self,
        queries: list[Query],
        k: int = 10,
        mode: str | None = None,
        alpha: float | None = None,
        nprobe: int | None = None,
    ) -> SearchOutcome:
        """Answer a batch of queries; raises InputError subclasses for bad input, Overloaded when full."""
        profile = self.profile  # one profile for the whole request, even if a reload lands meanwhile
        mode = mode or default_mode(self.settings, profile)
        cascade = self._cascade_for(mode)
        depth = cascade.depth(k) if cascade is not None else k
        nprobe = self.default_nprobe() if nprobe is None else nprobe
        job = SearchJob(queries, k, mode, alpha, nprobe, profile, depth=depth)
        served = served_modes(self.settings, profile)
        validate(job, self.settings.api, self.gallery.max_nprobe, self.old.encoder, self.new.encoder, served)
        with self._admitted(job) as ticket:
            try:
                with admitted(ticket):
                    await self.embedder.embed(job)
            finally:
                self._release(ticket)
            self._learn_hits(job)
            results, rerank = await self._transform_and_search(job, cascade)
            if cascade is not None and rerank is not None:  # candidates to encode: the loop's part, then the re-rank
                await cascade.encode(rerank)
                cascade.finish(job, results, rerank)
        if self.traffic is not None and job.reads.blends:
            # A blending answer read both embeddings: hand them to the sampler (a queue put, never a wait).
            self.traffic.offer_queries(queries, job.old, job.new)
        if self.hits is not None:  # which items users get, for backfill --order hot (a queue put, never a wait)
            self.hits.offer(_returned_ids(results, job.k))
        return SearchOutcome(results, job.timings)

    def _cascade_for(self, mode: str) -> Cascade | None:
        """The cascade when this mode re-ranks: cascade always, hybrid with an item store (cascade.in_hybrid)."""
        if self.cascade is None:
            return None
        in_hybrid = mode == Mode.hybrid and self.settings.cascade.in_hybrid and self.items is not None
        return self.cascade if mode == Mode.cascade or in_hybrid else None

    @contextmanager
    def _admitted(self, job: SearchJob) -> Iterator[Ticket]:
        """Count the job's queries in flight (and in the gauge) while they are served; Overloaded past
        api.max_in_flight or when they would wait longer than api.max_queue_ms for the encoders."""
        n = len(job.queries)
        limit = self.settings.api.max_in_flight
        if self.in_flight + n > limit:
            metrics.ADMISSION_REFUSALS.labels(reason="in_flight").inc()
            wait = self.expected_wait_s(n)
            raise Overloaded(f"{self.in_flight} queries in flight; the limit is {limit}", _retry_after(wait, 0.0))
        encoded = [query for query in job.queries if query.content is not None]
        refusal = self.queue_refusal(len(encoded), job.reads.reads_old, job.reads.reads_new) if encoded else None
        if refusal is not None:
            raise refusal
        ticket = self._ticket(len(encoded), job.reads.reads_old, job.reads.reads_new)
        self.in_flight += n
        metrics.IN_FLIGHT.inc(n)
        try:
            yield ticket
        finally:
            self.in_flight -= n
            metrics.IN_FLIGHT.dec(n)

    def expected_wait_s(self, n: int, reads_old: bool = True, reads_new: bool = True) -> float:
        """Seconds n queries can expect to queue for the encoders they need: the longer of the two waits,
        the old encoder's for the share of them the cache is not expected to answer."""
        wait = self.new.expected_wait_s(n) if reads_new or self.old is self.new else 0.0
        if reads_old and self.old is not self.new:
            misses = math.ceil(n * (1.0 - self.hit_ratio))
            wait = max(wait, self.old.expected_wait_s(misses) if misses else 0.0)
        return wait

    def queue_refusal(self, n: int, reads_old: bool = True, reads_new: bool = True) -> Overloaded | None:
        """The 503 for n more queries to encode when their expected wait is over api.max_queue_ms, else None
        (counted; the load shedder asks for one query before a body is read)."""
        limit_s = self.settings.api.max_queue_ms / 1000
        if limit_s <= 0:
            return None
        wait = self.expected_wait_s(n, reads_old, reads_new)
        if wait <= limit_s:
            return None
        metrics.ADMISSION_REFUSALS.labels(reason="queue_time").inc()
        waited = "every replica of an encoder is stuck" if math.isinf(wait) else f"about {wait * 1000:.0f} ms"
        return Overloaded(
            f"overloaded: a search now would queue for the encoders {waited} (limit {limit_s * 1000:.0f} ms, "
            "NOBACKFILL_API__MAX_QUEUE_MS); retry later",
            _retry_after(wait, limit_s),
        )

    def _ticket(self, n: int, reads_old: bool, reads_new: bool) -> Ticket:
        """The admitted request's ticket: its queue deadline, and the items it reserves on each encoder."""
        limit_s = self.settings.api.max_queue_ms / 1000
        ticket = Ticket(time.perf_counter() + DEADLINE_FACTOR * limit_s if limit_s > 0 else None)
        expected = {self.new: n if reads_new or self.old is self.new else 0}
        if reads_old and self.old is not self.new:
            expected[self.old] = math.ceil(n * (1.0 - self.hit_ratio))
        for batcher, items in expected.items():
            if items:
                batcher.reserve(items)
                ticket.reserved[batcher.name] = items
        return ticket

    def _release(self, ticket: Ticket) -> None:
        """Give back what the request reserved and never queued (cache hits, a failure before its calls)."""
        for batcher in dict.fromkeys((self.old, self.new)):
            batcher.unreserve(ticket.reserved.pop(batcher.name, 0))

    def _learn_hits(self, job: SearchJob) -> None:
        """Move the hit ratio towards this job's: the share of its looked-up old rows the cache had."""
        looked_up = [status for status in job.cache_status if status in ("hit", "miss")]
        if looked_up:
            share = looked_up.count("hit") / len(looked_up)
            self.hit_ratio += HIT_WEIGHT * (share - self.hit_ratio)

    async def _transform_and_search(
        self, job: SearchJob, cascade: Cascade | None
    ) -> tuple[list[QueryResult], Rerank | None]:
        """_stage_one on the search pool, in this task's context (as asyncio.to_thread would)."""
        context = contextvars.copy_context()
        work = partial(context.run, _stage_one, job, self.gallery, self.segment, cascade, self.hubness)
        return await asyncio.get_running_loop().run_in_executor(self.search_pool, work)

    # -- profile hot swap -------------------------------------------------------------------------

    async def reload_profile(self, profile_dir: Path | None = None) -> CompatProfile:
        """Load a profile and swap it in atomically; on any failure the current one stays."""
        if self.settings.cut_over:
            raise InputError("there is no profile to reload after the cut-over (NOBACKFILL_OLD__BACKEND=none)")
        path = profile_dir or self.settings.compat.profile_dir
        candidate = await asyncio.to_thread(load_profile, path)
        check_compatible(candidate, self.old.encoder, self.new.encoder, self.gallery, self.settings)
        default_mode(self.settings, candidate)
        if self.hubness is not None and self.hubness.hubness.meta.get("profile_id") != candidate.profile_id:
            raise InputError(
                f"the hubness sidecar {self.settings.compat.hubness_dir} was computed for profile "
                f"{self.hubness.hubness.meta.get('profile_id')}, not {candidate.profile_id}: recompute it "
                "(nobackfill gallery hubness) and restart, or unset NOBACKFILL_COMPAT__HUBNESS_DIR"
            )
        self.profile = candidate
        metrics.PROFILE_INFO.info({"profile_id": candidate.profile_id, "head": candidate.head})
        return candidate

    def default_nprobe(self) -> int:
        """index.nprobe, capped at the gallery's nlist where it has one (only the unset default can be over it)."""
        limit = self.gallery.max_nprobe
        return self.settings.index.nprobe if limit is None else min(self.settings.index.nprobe, limit)

    async def probe_gallery(self) -> str | None:
        """Ask the gallery whether it answers (bounded by its timeout, off the event loop); its problem or None."""
        return await asyncio.to_thread(self.gallery.probe)

    def info(self) -> dict[str, Any]:
        """What /v1/info reports: models, dims, devices, profile, gallery."""
        profile = self.profile
        return {
            "old_model": {"backend": NO_MODEL} if self.settings.cut_over else _model_info(self.old, self.settings.old),
            "new_model": _model_info(self.new, self.settings.new),
            "profile": None  # after the cut-over nothing is fitted: the new model serves alone
            if self.settings.cut_over
            else {
                "id": profile.profile_id,
                "head": profile.head,
                "alphas": profile.alphas,
                "modes": profile.modes(),
            },
            "gallery": {**self.gallery.describe(), "nprobe_default": self.default_nprobe()},
            "cache": {"kind": self.cache.kind, "state": self.cache.state()},
            "hubness": None if self.hubness is None else self._hubness_info(),
            "default_mode": default_mode(self.settings, profile),
            "modes": served_modes(self.settings, profile),
            **({"segment": self._segment_info(profile)} if self.segment is not None else {}),
            **({"items": self._items_info()} if self.items is not None else {}),
            **({"cascade": self._cascade_info()} if self.cascade is not None else {}),
        }

    def _hubness_info(self) -> dict[str, Any]:
        """/v1/info's hubness block: what the sidecar was computed from, and how many hits it re-ranks."""
        assert self.hubness is not None
        return {**self.hubness.hubness.meta, "candidates": self.hubness.candidates}

    def _cascade_info(self) -> dict[str, Any]:
        """/v1/info's cascade block: how many candidates, the encode budget, whether hybrid re-ranks, the writer."""
        assert self.cascade is not None
        knobs, writer = self.settings.cascade, self.cascade.writer
        return {
            "candidates": knobs.candidates,
            "encode_budget": knobs.encode_budget if self.items is not None else 0,
            "in_hybrid": knobs.in_hybrid and self.items is not None,
            "writes_segment": writer is not None,
            "pending_rows": writer.pending if writer is not None else 0,
        }

    def _items_info(self) -> dict[str, Any]:
        """/v1/info's item store block: where, how many, which."""
        assert self.items is not None
        identity = self.items.identity
        return {"path": str(self.items.folder), "count": identity.count, "sha256": identity.sha256}

    def _segment_info(self, profile: CompatProfile) -> dict[str, Any]:
        """/v1/info's segment block: the segment's state, and how hybrid merges (calibrated only with a fitted map)."""
        assert self.segment is not None
        merge = self.segment.method
        calibrated = merge == Merge.calibrated and bool(profile.calibration)
        merge_line = (
            "none (cut over: the segment alone answers, in new-model cosines)"
            if self.settings.cut_over
            else "calibrated"
            if calibrated
            else "raw (the profile has no calibration)"
            if merge == "calibrated"
            else merge
        )
        return {**self.segment.segment.describe(), "merge": merge_line}


def _retry_after(wait_s: float, limit_s: float) -> int:
    """Whole seconds until a queue expected to take wait_s is down to limit_s (1 to RETRY_AFTER_MAX_S)."""
    if math.isinf(wait_s):
        return RETRY_AFTER_MAX_S
    return min(max(1, math.ceil(wait_s - limit_s)), RETRY_AFTER_MAX_S)
