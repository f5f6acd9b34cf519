"""The sampler: picks queries at the configured rate on the event loop, stores them on its own thread.

    offer() (event loop)                       the sink's thread (service/sink.py)
    ───────────────────                        ───────────────────────────────────
    rate draw per query ──► float16 copies ──► bounded buffer ──► batch up to FLUSH_PAIRS or flush_s
                                 │ full: dropped, counted             │
                                                                      ▼
                                                   store.append ── error: failed, counted, dropped

The request never waits for the store: offer() does one vectorised random draw, copies the picked rows
and hands them to a BackgroundSink (a lock and a deque append).  At sample rate 0 the pipeline holds no
sampler at all.  A dead or slow store costs the sink's thread its timeouts; the buffer then fills and
later pairs are dropped (counted), so memory stays bounded by queue_size batches of at most
api.max_queries rows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service import metrics
from service.encoders.identity import ModelIdentity
from service.settings import Settings
from service.sink import BackgroundSink, Closed
from service.traffic.base import PairBatch, PairStore, models_key
from service.traffic.sampling import Sampling

log = logging.getLogger("nobackfill")

# One flush stores at most this many pairs: one Redis pipeline / one shard of a few MB at 768-d.
FLUSH_PAIRS = 1024


def _dropped(pairs: int) -> None:
    metrics.count_traffic("dropped", pairs)


def _failed(pairs: int) -> None:
    metrics.count_traffic("failed", pairs)


class TrafficSampler(Sampling[PairStore]):
    """Samples (old, new) pairs at `rate` into `store`, off the request path; fail-open."""

    def __init__(
        self,
        store: PairStore,
        rate: float,
        old: ModelIdentity,
        new: ModelIdentity,
        *,
        queue_size: int = 1024,
        flush_s: float = 0.5,
        seed: int | None = None,
    ) -> None:
        super().__init__(store, rate, flush_s, seed)
        self.models = models_key(old, new)
        self.dims = (old.dim, new.dim)
        self._sink: BackgroundSink[PairBatch] = BackgroundSink(
            self._store,
            thread_name="nobackfill-traffic",
            label=f"traffic sampler ({store.kind} store)",
            unit="pairs",
            capacity=queue_size,
            batch_size=FLUSH_PAIRS,
            interval_s=flush_s,
            size_of=len,
            on_drop=_dropped,
            on_failure=_failed,
        )

    def offer(
        self,
        old: npt.NDArray[np.float32],
        new: npt.NDArray[np.float32],
        modalities: Sequence[str],
        eligible: npt.NDArray[np.bool_] | None = None,
    ) -> int:
        """Pick rows at the sample rate (those `eligible`, with both rows non-zero) and queue them; returns how many."""
        n = len(old)
        picked = self._picked(n)
        if eligible is not None:
            picked &= eligible
        if not picked.any():
            return 0
        rows = np.flatnonzero(picked)
        o, w = old[rows], new[rows]
        usable = o.any(axis=1) & w.any(axis=1)  # a zero row has no direction: nothing to learn from
        if not usable.all():
            rows, o, w = rows[usable], o[usable], w[usable]
        if not len(rows):
            return 0
        batch = PairBatch(
            self.models, o.astype(np.float16), w.astype(np.float16), tuple(modalities[i] for i in rows.tolist())
        )
        metrics.count_traffic("sampled", len(batch))
        self._sink.offer(batch)  # full: dropped and counted by the sink
        return len(batch)

    def offer_queries(self, queries: Sequence[Any], old: npt.NDArray[np.float32], new: npt.NDArray[np.float32]) -> None:
        """The pipeline's hook: offer the encoders' rows (a caller's own embeddings never); fail-open."""
        try:
            encoded = np.fromiter((q.content is not None for q in queries), dtype=bool, count=len(queries))
            self.offer(old, new, [q.modality for q in queries], encoded)
        except Exception:  # noqa: BLE001 (sampling must never fail a request)
            metrics.count_traffic("failed", 1)
            log.debug("traffic sampler: offer failed", exc_info=True)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Store everything queued so far (tests, shutdown); False if the sink's thread did not finish in time."""
        return self._sink.flush(timeout_s)

    def close(self, timeout_s: float = 5.0) -> Closed:
        """Flush what is queued within timeout_s (what is left then is dropped, counted), close the store."""
        closed = self._sink.close(timeout_s)
        try:
            self.store.close()
        except Exception:  # noqa: BLE001 (closing a broken store must not fail shutdown)
            log.debug("traffic store close failed", exc_info=True)
        return closed

    def _store(self, batches: list[PairBatch]) -> None:
        """One append (on the sink's thread); an error raises to the sink, which counts the pairs failed."""
        rows = sum(len(b) for b in batches)
        stored = self.store.append(batches)
        metrics.count_traffic("stored", stored)
        if stored < rows:
            metrics.count_traffic("dropped", rows - stored)


def create_store(settings: Settings) -> PairStore:
    """The configured store: Redis when traffic.store is redis (or auto with a Redis URL), local shards otherwise."""
    from service.errors import InputError

    cfg = settings.traffic
    url = cfg.redis_url or settings.cache.redis_url
    kind = cfg.store if cfg.store != "auto" else ("redis" if url else "local")
    if kind == "redis":
        if not url:
            raise InputError(
                "traffic.store is redis but no Redis URL is set "
                "(NOBACKFILL_TRAFFIC__REDIS_URL or NOBACKFILL_CACHE__REDIS_URL)"
            )
        from service.traffic.redis_store import RedisPairStore

        return RedisPairStore(url, key=cfg.stream_key, max_pairs=cfg.max_pairs, ttl_s=cfg.ttl_s)
    from service.traffic.local import LocalPairStore

    return LocalPairStore(Path(cfg.local_dir), max_pairs=cfg.max_pairs, ttl_s=cfg.ttl_s)


def _writable_store(settings: Settings) -> PairStore:
    """The configured store, refused in one line when it is local shards in a folder that cannot be written."""
    from service.errors import ArtifactError
    from service.traffic.local import LocalPairStore

    store = create_store(settings)
    if isinstance(store, LocalPairStore):
        try:
            store.check_writable()
        except OSError as exc:
            raise ArtifactError(
                f"traffic.local_dir {store.folder} cannot hold the sampled pairs ({exc.strerror or exc}): "
                "set NOBACKFILL_TRAFFIC__LOCAL_DIR to a writable folder, store them in Redis "
                "(NOBACKFILL_TRAFFIC__STORE=redis), or sample nothing (NOBACKFILL_TRAFFIC__SAMPLE_RATE=0)"
            ) from exc
    return store


def create_sampler(settings: Settings, old: ModelIdentity, new: ModelIdentity) -> TrafficSampler | None:
    """A started sampler, or None when the sample rate is 0 (the default: nothing is stored).

    A store that cannot work is refused here, at startup, in one line; once serving, its errors are counted and dropped.
    """
    cfg = settings.traffic
    if cfg.sample_rate <= 0.0:
        return None
    store = _writable_store(settings)
    return TrafficSampler(store, cfg.sample_rate, old, new, queue_size=cfg.queue_size, flush_s=cfg.flush_s)
