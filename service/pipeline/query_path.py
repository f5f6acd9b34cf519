"""The query path without HTTP: the Pipeline answers each request in a few steps, and swaps its profile live.

    admit ──► embed ──────────────────────────► transform and search ───────────► sample
    (admission.py)  (query/embedding.py: the   (query/search.py on the pipeline's   (traffic/, the
                     cache and both encoders    search pool; query/fallback.py       blending modes
                     at once, each behind its   for all-zero encoder rows)           only)
                     own micro-batcher)

Beside a new-model segment the search is hybrid (query/hybrid.py).  The cut-over (old.backend none) is a
different composition, not a branch here: parts.py acquires the finished segment as the gallery
(segment/cutover.py) and no old model and no profile, so what is served follows from what is there
(query/validation.py: with no profile, the new model alone; docs/backfill.md).  admission.py decides what
comes in.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service import metrics
from service.artifact_check import check_compatible
from service.cache import EmbeddingCache
from service.compat.hubness import Corrected
from service.compat.profile import CompatProfile, load_profile
from service.encoders.base import describe
from service.encoders.batcher import MicroBatcher
from service.encoders.process import isolation_of
from service.errors import InputError
from service.index.base import GalleryBackend
from service.items.store import ItemStore
from service.pipeline.admission import Admission
from service.pipeline.parts import Parts, acquire_parts
from service.query.cascade import Cascade, Rerank
from service.query.embedding import CacheWriteBack, Embedder
from service.query.hybrid import SegmentSearch
from service.query.job import Query, QueryResult, SearchJob, SearchOutcome
from service.query.plan import plan_of
from service.query.search import transform_and_search
from service.query.validation import default_mode, served_modes, validate_queries, validate_request
from service.settings import NO_MODEL, EncoderSettings, Settings
from service.traffic.hits import HitCounter
from service.traffic.sampler import TrafficSampler
from service.vocabulary import Merge, Mode

log = logging.getLogger("nobackfill")


class Pipeline:
    """Owns the serving parts (parts.py), admits searches (admission.py) and answers them; the profile swaps live."""

    def __init__(self, parts: Parts) -> None:
        self.settings: Settings = parts.settings
        self.old: MicroBatcher | None = parts.old  # None after the cut-over
        self.new: MicroBatcher = parts.new
        self.cache: EmbeddingCache = parts.cache
        self.gallery: GalleryBackend = parts.gallery
        self.profile: CompatProfile | None = parts.profile  # None after the cut-over
        self.write_back: CacheWriteBack = parts.write_back
        self.traffic: TrafficSampler | None = parts.traffic
        self.search_pool: ThreadPoolExecutor = parts.search_pool
        self.search_threads = parts.search_threads
        self.segment: SegmentSearch | None = parts.segment
        self.hits: HitCounter | None = parts.hits
        self.items: ItemStore | None = parts.items
        self.cascade: Cascade | None = parts.cascade
        self.hubness: Corrected | None = parts.hubness
        self.embedder = Embedder(
            parts.old, parts.new, parts.cache, parts.write_back, self.settings.compat.concurrent_encoders
        )
        self.admission = Admission(parts.old, parts.new, self.settings.api)
        self.draining = False
        self._unwind = parts.unwind
        self._unwind.push_async_callback(self._stop_taking_work)  # the first thing aclose() does

    @classmethod
    async def build(cls, settings: Settings) -> Pipeline:
        """Acquire every part (parts.py; any failure unwinds what was acquired) and serve with them."""
        return cls(await acquire_parts(settings))

    @property
    def in_flight(self) -> int:
        """The queries inside the pipeline now (admission's count)."""
        return self.admission.in_flight

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
        found = [f"{b.name} encoder: {problem}" for b in self._batchers if (problem := b.problem()) is not None]
        if (gallery_problem := self.gallery.problem()) is not None:  # a remote gallery (Milvus) not answering
            found.append(f"gallery: {gallery_problem}")
        return [*found, "draining: shutting down"] if self.draining else found

    @property
    def alive(self) -> bool:
        """False once a batcher is beyond restarting: /healthz fails so the orchestrator replaces the process."""
        return all(batcher.alive for batcher in self._batchers)

    @property
    def _batchers(self) -> list[MicroBatcher]:
        """The encoders' batchers: the new model's, and the old one's until the cut-over."""
        return [self.new] if self.old is None else [self.old, self.new]

    # -- the query path ---------------------------------------------------------------------------

    async def search(
        self,
        queries: list[Query],
        k: int = 10,
        mode: str | None = None,
        alpha: float | None = None,
        nprobe: int | None = None,
        ef_search: int | None = None,
    ) -> SearchOutcome:
        """Answer a batch of queries; raises InputError subclasses for bad input, Overloaded when full."""
        profile = self.profile  # one profile for the whole request, even if a reload lands meanwhile
        mode = mode or default_mode(self.settings, profile)
        nprobe = self.default_nprobe() if nprobe is None else nprobe
        served = served_modes(self.settings, profile)
        api = self.settings.api
        validate_request(queries, k, mode, alpha, nprobe, api, self.gallery.max_nprobe, served, ef_search)
        head = None if profile is None else profile.head
        plan = plan_of(Mode(mode), head, segment=self.segment is not None, hybrid_reranks=self._hybrid_reranks)
        cascade = self.cascade if plan.reranks else None
        depth = cascade.depth(k) if cascade is not None else k
        # With no profile (the cut-over) no old row is read: the new model's width stands on both sides.
        dims = (self.new.encoder.dim,) * 2 if profile is None else (profile.old_dim, profile.new_dim)
        job = SearchJob(queries, k, plan, alpha, nprobe, profile, dims, depth=depth, ef_search=ef_search)
        old_encoder = None if self.old is None else self.old.encoder
        validate_queries(job, old_encoder, self.new.encoder, api.max_text_chars)
        with self.admission.admit(job) as ticket:
            try:
                await self.embedder.embed(job, ticket)
            finally:
                self.admission.release(ticket)
            self.admission.learn_hits(job)
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

    @property
    def _hybrid_reranks(self) -> bool:
        """Whether hybrid re-ranks too: with the cascade and an item store, unless cascade.in_hybrid is off."""
        return self.cascade is not None and self.items is not None and self.settings.cascade.in_hybrid

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
        if self.old is None:
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
            "old_model": {"backend": NO_MODEL} if self.old is None else _model_info(self.old, self.settings.old),
            "new_model": _model_info(self.new, self.settings.new),
            "profile": None  # after the cut-over nothing is fitted: the new model serves alone
            if profile is None
            else {
                "id": profile.profile_id,
                "head": profile.head,
                "alphas": profile.alphas,
                "modes": profile.modes(),
            },
            # null where the gallery takes no nprobe (an HNSW or Flat index, Qdrant): it would read as a width.
            "gallery": {
                **self.gallery.describe(),
                "nprobe_default": None if self.gallery.max_nprobe is None else self.default_nprobe(),
            },
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
            "in_hybrid": self._hybrid_reranks,
            "writes_segment": writer is not None,
            "pending_rows": writer.pending if writer is not None else 0,
        }

    def _items_info(self) -> dict[str, Any]:
        """/v1/info's item store block: where, how many, which."""
        assert self.items is not None
        identity = self.items.identity
        return {"path": str(self.items.folder), "count": identity.count, "sha256": identity.sha256}

    def _segment_info(self, profile: CompatProfile | None) -> dict[str, Any]:
        """/v1/info's segment block: the segment's state, and how hybrid merges (calibrated only with a fitted map)."""
        assert self.segment is not None
        merge = self.segment.method
        calibrated = merge == Merge.calibrated and profile is not None and bool(profile.calibration)
        merge_line = (
            "none (cut over: the segment alone answers, in new-model cosines)"
            if profile is None
            else "calibrated"
            if calibrated
            else "raw (the profile has no calibration)"
            if merge == "calibrated"
            else merge
        )
        sampled = {} if self.segment.recall is None else {"sampled_recall": self.segment.recall.describe()}
        return {**self.segment.segment.describe(), "merge": merge_line, **sampled}


def _returned_ids(results: list[QueryResult], k: int) -> npt.NDArray[np.int64]:
    """The returned ids, one row per result (-1 pads a short or empty list), for the hit counter."""
    ids = np.full((len(results), k), -1, dtype=np.int64)
    for row, result in enumerate(results):
        ids[row, : len(result.ids)] = result.ids
    return ids


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
