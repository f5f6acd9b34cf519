"""What flows through the query path: the queries, one request's job, the results, the stage timings."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from service import metrics
from service.compat.profile import CompatProfile
from service.encoders.base import Embeddings
from service.query.plan import Plan
from service.vocabulary import Modality, Mode

T = TypeVar("T")


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
    segment_hits: int | None = None  # hybrid / new: how many of the ids came from the new-model segment
    # What the scores are: old (old-model cosines), new (new-model cosines), calibrated (segment scores on
    # the old scale), raw (both models' cosines side by side), rrf (fused ranks).
    score_scale: str = "old"
    reranked: int | None = None  # cascade: how many of the first ids were re-ranked in the new space
    compared: list[str] | None = None  # compare: the mode of ids / scores, then of old_ids / old_scores (old)


@dataclass
class SearchOutcome:
    """Results in request order and the time each stage took, in milliseconds."""

    results: list[QueryResult]
    timings_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class SearchJob:
    """One request on its way through the query path: what was asked, and what each stage has found so far.

    `profile` is the one profile of the whole request, even if a reload lands meanwhile (None after the
    cut-over: no map, only the new model's query over the segment).  `dims` are the old and new query widths
    (after the cut-over the new model's twice: no old row is read).  `old`, `new` and `cache_status` are
    filled by the embedding stage (embedding.py), one row per query.
    """

    queries: list[Query]
    k: int
    plan: Plan  # the mode as asked, parsed once (query/plan.py) after validation let it through
    alpha: float | None
    nprobe: int
    profile: CompatProfile | None
    dims: tuple[int, int]  # (old, new) query widths
    depth: int = 0  # hits stage 1 returns (0: k); the cascade asks for more, re-ranks them and cuts to k
    ef_search: int | None = None  # the segment's graphs search this wide (None: index.segment_ef_search)
    timings: dict[str, float] = field(default_factory=dict)
    old: Embeddings = field(init=False)
    new: Embeddings = field(init=False)
    cache_status: list[str] = field(init=False)
    new_failed: list[bool] = field(init=False)  # the new encoder failed for this row (a cascade answers without it)

    def __post_init__(self) -> None:
        """Stage 1 returns k hits unless asked for more."""
        self.depth = self.depth or self.k

    @property
    def mode(self) -> Mode:
        """The mode as asked."""
        return self.plan.mode

    @property
    def old_dim(self) -> int:
        """The old query's width (the gallery's)."""
        return self.dims[0]

    @property
    def new_dim(self) -> int:
        """The new query's width."""
        return self.dims[1]

    @property
    def mapping(self) -> CompatProfile:
        """The profile that maps this job's queries; only a plan with a map (plan.mapping) reads it."""
        if self.profile is None:  # validation serves no mapped mode without a profile: a bug if reached
            raise RuntimeError(f"mode {self.mode!r} needs a profile, and this service has none (cut over)")
        return self.profile

    @property
    def reads(self) -> Mode:
        """The mode as a vocabulary word: what it reads, whether it blends."""
        return self.plan.mode

    def start_rows(self) -> None:
        """Zero rows for both embeddings and "off" for every cache status (after validation bounded the count)."""
        n = len(self.queries)
        self.old = np.zeros((n, self.old_dim), dtype=np.float32)
        self.new = np.zeros((n, self.new_dim), dtype=np.float32)
        self.cache_status = ["off"] * n
        self.new_failed = [False] * n

    def record(self, name: str, elapsed: float) -> None:
        """Add a stage's seconds to the request's timings (ms) and the stage histogram."""
        self.timings[name] = self.timings.get(name, 0.0) + elapsed * 1000
        metrics.STAGE_DURATION.labels(stage=name).observe(elapsed)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time a stage into the request's timings and the stage histogram."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, time.perf_counter() - start)

    async def timed(self, name: str, work: Awaitable[T]) -> T:
        """Await `work`, timing it as a stage."""
        with self.stage(name):
            return await work
