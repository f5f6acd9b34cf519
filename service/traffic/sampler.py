"""The sampler: picks queries at the configured rate on the event loop, stores them on its own thread.

    offer() (event loop)                       drain thread
    ───────────────────                        ────────────
    rate draw per query ──► float16 copies ──► bounded queue ──► batch up to FLUSH_PAIRS or flush_s
                                 │ full: dropped, counted             │
                                                                      ▼
                                                   store.append ── error: failed, counted, dropped

The request never waits for the store: offer() does one vectorised random draw, copies the picked rows
and calls put_nowait.  At sample rate 0 the pipeline holds no sampler at all.  A dead or slow store
costs the drain thread its timeouts; the queue then fills and later pairs are dropped (counted), so
memory stays bounded by queue_size batches of at most api.max_queries rows.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service import metrics
from service.encoders.identity import ModelIdentity
from service.settings import Settings
from service.traffic.base import PairBatch, PairStore, models_key

log = logging.getLogger("nobackfill")

# One flush stores at most this many pairs: one Redis pipeline / one shard of a few MB at 768-d.
FLUSH_PAIRS = 1024
# A failing store is logged at most this often (the metric counts every failure).
LOG_EVERY_S = 60.0


class _Marker:
    """A queue item that asks the drain thread to flush now (and, for stop, to exit)."""

    def __init__(self, stop: bool = False) -> None:
        self.stop = stop
        self.done = threading.Event()


class TrafficSampler:
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
        if not 0.0 < rate <= 1.0:
            raise ValueError("rate must be in (0, 1]")
        self.store = store
        self.rate = rate
        self.models = models_key(old, new)
        self.dims = (old.dim, new.dim)
        self.flush_s = flush_s
        self._rng = np.random.default_rng(seed)
        self._queue: queue.Queue[PairBatch | _Marker] = queue.Queue(maxsize=queue_size)
        self._last_log = 0.0
        self._thread = threading.Thread(target=self._run, name="nobackfill-traffic", daemon=True)
        self._thread.start()

    def offer(
        self,
        old: npt.NDArray[np.float32],
        new: npt.NDArray[np.float32],
        modalities: Sequence[str],
        eligible: npt.NDArray[np.bool_] | None = None,
    ) -> int:
        """Pick rows at the sample rate (those `eligible`, with both rows non-zero) and queue them; returns how many."""
        n = len(old)
        picked = np.ones(n, dtype=bool) if self.rate >= 1.0 else self._rng.random(n) < self.rate
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
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            metrics.count_traffic("dropped", len(batch))
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
        """Store everything queued so far (tests, shutdown); False if the drain thread did not finish in time."""
        marker = _Marker()
        try:
            self._queue.put(marker, timeout=timeout_s)
        except queue.Full:
            return False
        return marker.done.wait(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush what is queued, stop the drain thread, close the store."""
        marker = _Marker(stop=True)
        try:
            self._queue.put(marker, timeout=timeout_s)
            marker.done.wait(timeout_s)
        except queue.Full:
            log.warning("traffic sampler: queue still full at shutdown; queued pairs are dropped")
        self._thread.join(timeout_s)
        try:
            self.store.close()
        except Exception:  # noqa: BLE001 (closing a broken store must not fail shutdown)
            log.debug("traffic store close failed", exc_info=True)

    def _run(self) -> None:
        """Drain the queue into the store in batches, until a stop marker."""
        pending: list[PairBatch] = []
        rows = 0
        first = 0.0
        while True:
            timeout = None if not pending else max(0.0, first + self.flush_s - time.monotonic())
            try:
                item: PairBatch | _Marker | None = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = None
            if isinstance(item, PairBatch):
                if not pending:
                    first = time.monotonic()
                pending.append(item)
                rows += len(item)
            due = pending and (
                rows >= FLUSH_PAIRS or time.monotonic() - first >= self.flush_s or isinstance(item, _Marker)
            )
            if due:
                self._store(pending, rows)
                pending, rows = [], 0
            if isinstance(item, _Marker):
                item.done.set()
                if item.stop:
                    return

    def _store(self, pending: list[PairBatch], rows: int) -> None:
        """One append; any error is counted and the pairs dropped (fail-open)."""
        try:
            stored = self.store.append(pending)
        except Exception as exc:  # noqa: BLE001 (fail-open: any store error drops the batch)
            metrics.count_traffic("failed", rows)
            now = time.monotonic()
            if now - self._last_log >= LOG_EVERY_S:
                self._last_log = now
                log.warning("traffic sampler: %s store failed, %d pairs dropped: %s", self.store.kind, rows, exc)
            return
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
