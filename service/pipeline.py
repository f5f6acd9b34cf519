"""The query path without HTTP: cache lookup, old and new encoders at once, compat head, gallery search.

Old embeddings come from the cache when they can; the misses go to the old encoder while the new
encoder runs on every query at the same time, each behind its own micro-batcher and device. New old
embeddings are written back to the cache in the background so the response never waits for Redis.

An encoder may return an all-zero row: a static or lexical model does for text with no known token.
Such a row has no direction, so that query is answered by the other endpoint alone (mode `old` when
the new row is zero; `aligned`, or `adapter` for an adapter head, when the old row is zero), or with no
results when every endpoint its mode reads is zero.  The result says so in `fallback` (old | new |
none) and nobackfill_zero_embedding_fallbacks_total counts it: never NaN, never a 5xx.  (A caller's own
all-zero embedding is still a 400: that is bad input, not data.)
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from service import metrics
from service.artifact_check import check_compatible, encoder_line
from service.cache import EmbeddingCache, create_cache
from service.cache.base import usable_rows
from service.compat.heads import transform
from service.compat.profile import CompatProfile, load_profile
from service.compat.rows import normalize_rows
from service.encoders.base import Embeddings, Encoder, describe, fingerprint_of, modalities_of
from service.encoders.batcher import MicroBatcher
from service.encoders.process import close_all, isolation_of, start_processes
from service.encoders.registry import create_encoder, identity_of
from service.errors import ArtifactError, InputError, NobackfillError, Overloaded, TooManyQueries, UnsupportedMode
from service.index.base import GalleryBackend, check_nprobe
from service.index.factory import create_gallery
from service.settings import EncoderSettings, Settings
from service.traffic.sampler import TrafficSampler, create_sampler
from service.vocabulary import Modality, Mode, Role

T = TypeVar("T")

# Modes that never look at one of the two query embeddings, so that encoder is skipped.
OLD_FREE_MODES = frozenset(mode for mode in Mode if not mode.reads_old)
COMPARE = Mode.compare


@dataclass(frozen=True)
class Query:
    """One query: content for the encoders, or both embeddings given by the caller."""

    modality: Modality
    content: str | None = None
    old_embedding: Embeddings | None = None
    new_embedding: Embeddings | None = None


@dataclass
class QueryResult:
    """Top-k for one query, plus what produced it."""

    ids: list[int]
    scores: list[float]
    mode: str
    alpha: float | None
    cache: str
    theta: float | None = None
    old_ids: list[int] | None = None
    old_scores: list[float] | None = None
    overlap: float | None = None
    fallback: str | None = None  # which endpoint answered alone after an all-zero encoder row (old | new | none)


@dataclass
class SearchOutcome:
    """Results in request order and the time each stage took, in milliseconds."""

    results: list[QueryResult]
    timings_ms: dict[str, float] = field(default_factory=dict)


def _record(timings: dict[str, float], name: str, elapsed: float) -> None:
    """Add a stage's seconds to the request's timings (ms) and the stage histogram."""
    timings[name] = timings.get(name, 0.0) + elapsed * 1000
    metrics.STAGE_DURATION.labels(stage=name).observe(elapsed)


@contextmanager
def _stage(timings: dict[str, float], name: str) -> Iterator[None]:
    """Time a stage into the request's timings and the stage histogram."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _record(timings, name, time.perf_counter() - start)


async def _timed(timings: dict[str, float], name: str, work: Awaitable[T]) -> T:
    """Await `work`, timing it as a stage."""
    with _stage(timings, name):
        return await work


Group = tuple[Modality, str, str | None]  # modality, mode, fallback


def _groups(queries: list[Query], plan: list[tuple[str, str | None]]) -> dict[Group, slice | list[int]]:
    """Row indices of each (modality, mode, fallback): one transform call each; one slice (no copies) for one group."""
    groups: dict[Group, list[int]] = {}
    for i, (query, (mode, fallback)) in enumerate(zip(queries, plan, strict=True)):
        groups.setdefault((query.modality, mode, fallback), []).append(i)
    if len(groups) == 1:
        return {key: slice(None) for key in groups}
    return dict(groups)


def _create_encoders(settings: Settings, role: Role) -> list[Encoder]:
    """The configured encoder for `role`, one copy per replica; a failure names its settings, in one line."""
    encoder_settings = settings.old if role == Role.old else settings.new
    try:
        if isolation_of(encoder_settings) == "process":
            return start_processes(encoder_settings, role, encoder_settings.replicas)
        return [create_encoder(encoder_settings, role) for _ in range(encoder_settings.replicas)]
    except NobackfillError as exc:
        raise type(exc)(f"{role} encoder ({encoder_line(encoder_settings, role)}): {exc.message}") from exc


async def _create_both(settings: Settings) -> tuple[list[Encoder], list[Encoder]]:
    """Both roles' encoders, built side by side; when one side fails, the other's processes are stopped."""
    old, new = await asyncio.gather(
        asyncio.to_thread(_create_encoders, settings, Role.old),
        asyncio.to_thread(_create_encoders, settings, Role.new),
        return_exceptions=True,
    )
    for side, other in ((old, new), (new, old)):
        if isinstance(side, BaseException):
            if isinstance(other, list):
                await asyncio.to_thread(close_all, other)
            raise side
    assert isinstance(old, list) and isinstance(new, list)
    return old, new


def _model_info(batcher: MicroBatcher, settings: EncoderSettings) -> dict[str, Any]:
    """What /v1/info says of one encoder: its describe(), how many copies, where they run."""
    return {**describe(batcher.encoder), "replicas": len(batcher.replicas), "isolation": isolation_of(settings)}


def _warm(replicas: list[Encoder]) -> None:
    """Warm every copy of a model (every modality it serves: the backend's warmup does each)."""
    for encoder in replicas:
        encoder.warmup()


def _fallback_modes(
    profile: CompatProfile, queries: list[Query], old: Embeddings, new: Embeddings, head_mode: str
) -> list[tuple[str, str | None]]:
    """(mode, fallback) per query: the head's mode, or the other endpoint alone after an all-zero encoder row."""
    n = len(queries)
    reads_old, reads_new = Mode(head_mode).reads_old, Mode(head_mode).reads_new
    old_zero = ~old.any(axis=1) if reads_old else np.zeros(n, dtype=bool)
    new_zero = ~new.any(axis=1) if reads_new else np.zeros(n, dtype=bool)
    if not (old_zero.any() or new_zero.any()):  # the hot path: every row has a direction
        return [(head_mode, None)] * n
    encoded = np.fromiter((q.content is not None for q in queries), dtype=bool, count=n)
    old_zero &= encoded  # a caller's own embeddings were checked at validation: only encoder rows count
    new_zero &= encoded
    new_alone = "adapter" if "adapter" in profile.modes() else "aligned"
    out: list[tuple[str, str | None]] = []
    for old_is_zero, new_is_zero in zip(old_zero.tolist(), new_zero.tolist(), strict=True):
        if not (old_is_zero or new_is_zero):
            out.append((head_mode, None))
        elif old_is_zero and reads_new and not new_is_zero:
            out.append((new_alone, "new"))
        elif new_is_zero and reads_old and not old_is_zero:
            out.append(("old", "old"))
        else:
            out.append((head_mode, "none"))  # searched as is, answered with no results
    return out


def cache_model_key(encoder: Encoder) -> str:
    """The model part of the cache key: the id, and the weights fingerprint when there is one.

    With the fingerprint in the key, retrained weights under an unchanged name never read the old
    weights' cached rows.
    """
    fingerprint = fingerprint_of(encoder)
    return encoder.model_id if fingerprint is None else f"{encoder.model_id}@{fingerprint[:16]}"


def default_mode(settings: Settings, profile: CompatProfile) -> str:
    """The configured default mode, else the profile's head; ArtifactError if the profile lacks it."""
    mode = settings.compat.default_mode or profile.head
    if mode not in {*profile.modes(), COMPARE}:
        raise ArtifactError(
            f"default mode {mode!r} is not served by profile {profile.profile_id} "
            f"(it serves {', '.join(profile.modes())})"
        )
    return mode


class Pipeline:
    """Owns the encoders' batchers, the cache, the gallery and the current profile."""

    def __init__(
        self,
        settings: Settings,
        old: MicroBatcher,
        new: MicroBatcher,
        cache: EmbeddingCache,
        gallery: GalleryBackend,
        profile: CompatProfile,
    ) -> None:
        self.settings = settings
        self.old = old
        self.new = new
        self.cache = cache
        self.gallery = gallery
        self.profile = profile
        self.in_flight = 0
        self.draining = False
        self._background: set[asyncio.Task[None]] = set()
        self.traffic: TrafficSampler | None = None  # set by build() when traffic.sample_rate > 0

    @classmethod
    async def build(cls, settings: Settings) -> Pipeline:
        """Load encoders, gallery and profile (off the event loop), check they fit, start the batchers."""
        old_replicas, new_replicas = await _create_both(settings)
        old_encoder, new_encoder = old_replicas[0], new_replicas[0]
        every_replica = [*old_replicas, *new_replicas]
        try:
            gallery, profile, _, _ = await asyncio.gather(
                asyncio.to_thread(create_gallery, settings.index),  # a FAISS folder or a Milvus collection
                asyncio.to_thread(load_profile, settings.compat.profile_dir),
                asyncio.to_thread(_warm, old_replicas),
                asyncio.to_thread(_warm, new_replicas),
            )
        except BaseException:
            await asyncio.to_thread(close_all, every_replica)  # a refused start leaves no encoder process behind
            raise
        try:
            check_compatible(profile, old_encoder, new_encoder, gallery, settings)
            default_mode(settings, profile)  # refuses a configured default the profile cannot serve
        except NobackfillError:
            await asyncio.to_thread(gallery.close)  # a refused start leaves no Milvus connection behind
            await asyncio.to_thread(close_all, every_replica)
            raise
        cache = create_cache(settings.cache, cache_model_key(old_encoder), old_encoder.dim)
        old = MicroBatcher(
            old_replicas,
            settings.old.max_batch_size,
            settings.old.max_wait_ms,
            name="old",
            batching=settings.old.batching,
            timeout_s=settings.old.timeout_s,
        )
        new = MicroBatcher(
            new_replicas,
            settings.new.max_batch_size,
            settings.new.max_wait_ms,
            name="new",
            batching=settings.new.batching,
            timeout_s=settings.new.timeout_s,
        )
        await old.start()
        await new.start()
        metrics.PROFILE_INFO.info({"profile_id": profile.profile_id, "head": profile.head})
        metrics.GALLERY_INFO.info({"fingerprint": gallery.fingerprint, "ntotal": str(gallery.ntotal)})
        pipeline = cls(settings, old, new, cache, gallery, profile)
        # The identities models.json records, so exported pairs are checked against support sets like for like.
        pipeline.traffic = create_sampler(
            settings, identity_of(old_encoder, settings.old.backend), identity_of(new_encoder, settings.new.backend)
        )
        return pipeline

    async def drain(self) -> None:
        """Wait for the background cache writes started so far."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    def problems(self) -> list[str]:
        """Why this pipeline cannot take traffic now (empty when it can): /readyz answers 503 with these."""
        found = [f"{b.name} encoder: {problem}" for b in (self.old, self.new) if (problem := b.problem()) is not None]
        if (gallery_problem := self.gallery.problem()) is not None:  # a remote gallery (Milvus) not answering
            found.append(f"gallery: {gallery_problem}")
        return [*found, "draining: shutting down"] if self.draining else found

    @property
    def alive(self) -> bool:
        """False once a batcher is beyond restarting: /healthz fails so the orchestrator replaces the process."""
        return self.old.alive and self.new.alive

    async def aclose(self) -> None:
        """Stop the batchers, let pending cache writes finish, close the cache."""
        self.draining = True
        await self.drain()
        await self.old.stop()
        await self.new.stop()
        await asyncio.to_thread(close_all, [*self.old.replicas, *self.new.replicas])
        await self.cache.aclose()
        await asyncio.to_thread(self.gallery.close)
        if self.traffic is not None:
            await asyncio.to_thread(self.traffic.close)

    # -- validation -------------------------------------------------------------------------------

    def validate(self, queries: list[Query], k: int, mode: str, alpha: float | None, nprobe: int) -> None:
        """Check a request against the limits, the profile and the gallery; raise a 4xx error if bad."""
        api = self.settings.api
        if not queries:
            raise InputError("queries must not be empty")
        if len(queries) > api.max_queries:
            raise TooManyQueries(f"{len(queries)} queries in one request; the limit is {api.max_queries}")
        if not 1 <= k <= api.max_k:
            raise InputError(f"k must be in 1..{api.max_k}, got {k}")
        check_nprobe(nprobe, self.gallery.max_nprobe)  # before any encoder runs; the gallery checks it again
        if alpha is not None and not (math.isfinite(alpha) and 0.0 <= alpha <= 1.0):
            raise InputError(f"alpha must be in [0, 1], got {alpha}")
        served = self.profile.modes()
        if mode != COMPARE and mode not in served:
            raise UnsupportedMode(f"mode {mode!r} is not served by this profile; it serves {', '.join(served)}")
        if mode == COMPARE and "old" not in served:
            raise UnsupportedMode(
                f"mode 'compare' needs a profile that serves 'old'; this one serves {', '.join(served)}"
            )
        for i, query in enumerate(queries):
            self._validate_query(i, query, mode)

    def _validate_query(self, i: int, query: Query, mode: str) -> None:
        """Check one query's text length or embedding dims and values, and that its mode has what it reads."""
        limit = self.settings.api.max_text_chars
        if query.content is not None and query.modality == "text":
            if len(query.content) > limit:
                raise InputError(f"queries[{i}] is {len(query.content)} characters; the limit is {limit}")
            if not query.content.strip():
                raise InputError(f"queries[{i}].text is empty")
        if query.content is not None:
            for role, batcher, needed in (
                ("old", self.old, Mode(mode).reads_old),
                ("new", self.new, Mode(mode).reads_new),
            ):
                if needed and query.modality not in modalities_of(batcher.encoder):
                    raise InputError(
                        f"queries[{i}] is a {query.modality} query, but the {role} model "
                        f"{batcher.encoder.model_id!r} encodes {' and '.join(modalities_of(batcher.encoder))} only"
                    )
        else:
            if query.old_embedding is None and Mode(mode).reads_old:
                raise InputError(
                    f"queries[{i}] has no old_embedding, which mode {mode!r} needs "
                    f"(modes that take new_embedding alone: {', '.join(sorted(OLD_FREE_MODES))})"
                )
            if query.new_embedding is None and Mode(mode).reads_new:
                raise InputError(f"queries[{i}] has no new_embedding, which mode {mode!r} needs")
        for name, row, dim in (
            ("old_embedding", query.old_embedding, self.profile.old_dim),
            ("new_embedding", query.new_embedding, self.profile.new_dim),
        ):
            if row is None:
                continue
            if row.shape != (dim,):
                raise InputError(f"queries[{i}].{name} has {row.size} values; expected {dim}")
            if not np.all(np.isfinite(row)):
                raise InputError(f"queries[{i}].{name} contains NaN or infinity")
            if not np.any(row):
                raise InputError(f"queries[{i}].{name} is all zeros")

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
        mode = mode or default_mode(self.settings, self.profile)
        nprobe = self.default_nprobe() if nprobe is None else nprobe
        self.validate(queries, k, mode, alpha, nprobe)
        if self.in_flight + len(queries) > self.settings.api.max_in_flight:
            raise Overloaded(f"{self.in_flight} queries in flight; the limit is {self.settings.api.max_in_flight}")
        self.in_flight += len(queries)
        metrics.IN_FLIGHT.inc()
        profile = self.profile  # one profile for the whole request, even if a reload lands meanwhile
        timings: dict[str, float] = {}
        try:
            need_old = Mode(mode).reads_old
            need_new = Mode(mode).reads_new
            old, new, cache_status = await self._embed(queries, profile, need_old, need_new, timings)
            results = await asyncio.to_thread(
                self._transform_and_search, profile, queries, old, new, mode, alpha, k, nprobe, timings
            )
        finally:
            self.in_flight -= len(queries)
            metrics.IN_FLIGHT.dec()
        for result, status in zip(results, cache_status, strict=True):
            result.cache = status
        if self.traffic is not None and Mode(mode).blends:
            # A blending answer read both embeddings: hand them to the sampler (a queue put, never a wait).
            self.traffic.offer_queries(queries, old, new)
        return SearchOutcome(results, timings)

    async def _embed(
        self,
        queries: list[Query],
        profile: CompatProfile,
        need_old: bool,
        need_new: bool,
        timings: dict[str, float],
    ) -> tuple[Embeddings, Embeddings, list[str]]:
        """Fill the old and new query embeddings: given by the caller, cached, or encoded."""
        n = len(queries)
        old = np.zeros((n, profile.old_dim), dtype=np.float32)
        new = np.zeros((n, profile.new_dim), dtype=np.float32)
        cache_status = ["off"] * n
        by_modality: dict[Modality, list[int]] = {}
        for i, query in enumerate(queries):
            if query.content is None:
                # As given: every head normalises what it reads, and PSP's softmax needs the logits' scale.
                if query.old_embedding is not None:
                    old[i] = query.old_embedding
                if query.new_embedding is not None:
                    new[i] = query.new_embedding
            else:
                by_modality.setdefault(query.modality, []).append(i)
        await asyncio.gather(
            *(
                self._encode_group(modality, rows, queries, old, new, cache_status, need_old, need_new, timings)
                for modality, rows in by_modality.items()
            )
        )
        return old, new, cache_status

    async def _encode_group(
        self,
        modality: Modality,
        rows: list[int],
        queries: list[Query],
        old: Embeddings,
        new: Embeddings,
        cache_status: list[str],
        need_old: bool,
        need_new: bool,
        timings: dict[str, float],
    ) -> None:
        """One modality: start the new encoder, look up the cache, encode the old misses meanwhile."""
        inputs = [queries[i].content or "" for i in rows]
        if need_old and not self.settings.compat.concurrent_encoders:
            await self._old_embeddings(modality, rows, inputs, old, cache_status, timings)
            need_old = False
        started = time.perf_counter()
        # Enqueued now, before the cache lookup, so the new encoder starts at once.
        new_rows = self.new.submit(inputs, modality) if need_new else None
        try:
            if need_old:
                await self._old_embeddings(modality, rows, inputs, old, cache_status, timings)
        finally:
            if new_rows is not None:
                new[rows] = await new_rows
                _record(timings, "new_encode", time.perf_counter() - started)

    async def _old_embeddings(
        self,
        modality: Modality,
        rows: list[int],
        inputs: list[str],
        old: Embeddings,
        cache_status: list[str],
        timings: dict[str, float],
    ) -> None:
        """Old embeddings from the cache, the misses from the old encoder (and back into the cache)."""
        cached = await _timed(timings, "cache_lookup", self.cache.get_many(modality, inputs))
        misses = [j for j, row in enumerate(cached) if row is None]
        caching = self.cache.kind != "off"
        for j, row in enumerate(cached):
            if row is not None:
                old[rows[j]] = normalize_rows(row[None])[0]
                cache_status[rows[j]] = "hit"
        if not misses:
            return
        miss_inputs = [inputs[j] for j in misses]
        encoded = await _timed(timings, "old_encode", self.old.encode(miss_inputs, modality))
        for j, row in zip(misses, encoded, strict=True):
            old[rows[j]] = row
            cache_status[rows[j]] = "miss" if caching else "off"
        if not caching:
            return
        usable = usable_rows(encoded)
        if not usable.all():
            # An all-zero row (no known token) is served by the fallback, never cached.
            miss_inputs = [text for text, ok in zip(miss_inputs, usable.tolist(), strict=True) if ok]
            encoded = encoded[usable]
        if miss_inputs:
            task = asyncio.create_task(self.cache.set_many(modality, miss_inputs, encoded))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _transform_and_search(
        self,
        profile: CompatProfile,
        queries: list[Query],
        old: Embeddings,
        new: Embeddings,
        mode: str,
        alpha: float | None,
        k: int,
        nprobe: int,
        timings: dict[str, float],
    ) -> list[QueryResult]:
        """Apply the head per modality, then one batched gallery search (worker thread)."""
        compare = mode == COMPARE
        head_mode = profile.head if compare else mode
        n = len(queries)
        batch = np.zeros((n, profile.old_dim), dtype=np.float32)
        thetas = np.full(n, np.nan)  # NaN: the mode reads one endpoint only, so there is no angle
        alphas = np.zeros(n)
        plan = _fallback_modes(profile, queries, old, new, head_mode)
        with _stage(timings, "transform"):
            for (modality, row_mode, fallback), rows in _groups(queries, plan).items():
                if fallback == "none":
                    continue  # no usable endpoint: the row stays zero and gets no results
                out = transform(
                    profile,
                    row_mode,
                    old[rows] if Mode(row_mode).reads_old else None,
                    new[rows] if Mode(row_mode).reads_new else None,
                    modality,
                    alpha if row_mode == head_mode else None,  # a fallback mode takes no weight
                )
                batch[rows] = out.queries
                alphas[rows] = out.row_alpha
                if Mode(row_mode).blends:  # theta needs both endpoints
                    thetas[rows] = out.theta
                    for theta in out.theta.tolist():
                        metrics.RESIDUAL_ANGLE.observe(theta)
        if compare:
            batch = np.concatenate([batch, normalize_rows(old)])  # a zero row stays zero: no old results
        with _stage(timings, "search"):
            scores, ids = self.gallery.search(batch, k, nprobe)
        id_lists, score_lists = ids.tolist(), scores.tolist()
        results = []
        for i, ((row_mode, fallback), alpha_i, theta_i) in enumerate(
            zip(plan, alphas.tolist(), thetas.tolist(), strict=True)
        ):
            found = fallback != "none"
            results.append(
                QueryResult(
                    ids=id_lists[i] if found else [],
                    scores=score_lists[i] if found else [],
                    mode=row_mode,
                    alpha=alpha_i,
                    cache="off",
                    theta=None if math.isnan(theta_i) else theta_i,
                    fallback=fallback,
                )
            )
            if fallback is not None:
                metrics.ZERO_EMBEDDING_FALLBACKS.labels(answered_by=fallback).inc()
        if compare:
            old_found = np.any(old != 0, axis=1).tolist()
            for i, result in enumerate(results):
                result.old_ids = id_lists[n + i] if old_found[i] else []
                result.old_scores = score_lists[n + i] if old_found[i] else []
                kept = {x for x in result.ids if x >= 0}
                result.overlap = len(kept & {x for x in result.old_ids if x >= 0}) / k
        return results

    # -- profile hot swap -------------------------------------------------------------------------

    async def reload_profile(self, profile_dir: Path | None = None) -> CompatProfile:
        """Load a profile and swap it in atomically; on any failure the current one stays."""
        path = profile_dir or self.settings.compat.profile_dir
        candidate = await asyncio.to_thread(load_profile, path)
        check_compatible(candidate, self.old.encoder, self.new.encoder, self.gallery, self.settings)
        default_mode(self.settings, candidate)
        self.profile = candidate
        metrics.PROFILE_INFO.info({"profile_id": candidate.profile_id, "head": candidate.head})
        return candidate

    def default_nprobe(self) -> int:
        """index.nprobe, capped at the gallery's nlist where it has one."""
        limit = self.gallery.max_nprobe
        return self.settings.index.nprobe if limit is None else min(self.settings.index.nprobe, limit)

    async def probe_gallery(self) -> str | None:
        """Ask the gallery whether it answers (bounded by its timeout, off the event loop); its problem or None."""
        return await asyncio.to_thread(self.gallery.probe)

    def info(self) -> dict[str, Any]:
        """What /v1/info reports: models, dims, devices, profile, gallery."""
        profile = self.profile
        return {
            "old_model": _model_info(self.old, self.settings.old),
            "new_model": _model_info(self.new, self.settings.new),
            "profile": {
                "id": profile.profile_id,
                "head": profile.head,
                "alphas": profile.alphas,
                "modes": profile.modes(),
            },
            "gallery": {**self.gallery.describe(), "nprobe_default": self.default_nprobe()},
            "cache": {"kind": self.cache.kind, "state": self.cache.state()},
            "default_mode": default_mode(self.settings, profile),
        }
