"""Which gallery items users actually get: sampled counts of returned ids, bounded, decaying, fail-open.

    offer(ids) (request path)                      the sink's thread (service/sink.py)
    ─────────────────────────                      ───────────────────────────────────
    rate draw per result list ──► bounded sink ──► every flush_s (or FLUSH_IDS) ──► store.add(counts)
           full: dropped, counted                   every half_life_s ──────────► store.age(0.5)

Counts halve every half-life, so they say what is hot now, and the store keeps at most `capacity`
ids (the lowest counts go first): memory and Redis stay bounded whatever the traffic.  Two stores:
a Redis sorted set (ZINCRBY; ZREMRANGEBYRANK caps it; ZUNIONSTORE WEIGHTS 0.5 halves it), shared by
every worker and replica; or, without Redis, one small file per process in a folder (rewritten whole
on each flush, atomically), summed by readers.  A failing store costs the sink's thread its
timeout; the counts of that flush are dropped and counted (logged at most once a minute), and no
request ever waits; close(timeout) returns in time even then, counting what it leaves as dropped.
`backfill run --order hot` reads the counts (`read_hits`), hottest first; `backfill status` reads
the share of the counted hits that land on moved items.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from service import metrics
from service.errors import InputError
from service.rows import F64, I64
from service.sink import BackgroundSink, Closed, Periodic
from service.traffic.sampling import Sampling

if TYPE_CHECKING:
    from service.settings import TrafficSettings

log = logging.getLogger("nobackfill")


class HitStore(Protocol):
    """Where decayed hit counts live."""

    kind: str

    def add(self, counts: dict[int, float]) -> None:
        """Add these counts to the stored ones (then cap the store at its capacity)."""
        ...

    def age(self, factor: float) -> None:
        """Multiply every count by `factor` (dropping those that fall below one half)."""
        ...

    def read(self) -> tuple[I64, F64]:
        """Every stored (id, count), hottest first."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


def _cap(table: dict[int, float], capacity: int) -> dict[int, float]:
    """The `capacity` highest counts of `table` (ties: the smaller id)."""
    if len(table) <= capacity:
        return table
    ranked = sorted(table.items(), key=lambda kv: (-kv[1], kv[0]))[:capacity]
    return dict(ranked)


class LocalHitStore:
    """This process's counts in FOLDER/hits-HOST-PID.npz (ids and counts), rewritten atomically on each flush."""

    kind = "local"

    def __init__(self, folder: Path, capacity: int) -> None:
        self.folder = folder
        self.capacity = capacity
        host = "".join(c for c in socket.gethostname() if c.isalnum())[:16] or "host"
        self.path = folder / f"hits-{host}-{os.getpid()}.npz"
        self._table: dict[int, float] = {}
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"cannot create the hit-count folder {folder}: {exc.strerror or exc}") from exc

    def add(self, counts: dict[int, float]) -> None:
        """Merge, cap, rewrite the file."""
        table = self._table
        for item, count in counts.items():
            table[item] = table.get(item, 0.0) + count
        self._table = _cap(table, self.capacity)
        self._write()

    def age(self, factor: float) -> None:
        """Scale every count; drop the ones below one half."""
        self._table = {i: c * factor for i, c in self._table.items() if c * factor >= 0.5}
        self._write()

    def _write(self) -> None:
        """ids and counts in one .npz, through a temp file and a rename (readers see a whole file)."""
        ids = np.fromiter(self._table.keys(), dtype=np.int64, count=len(self._table))
        counts = np.fromiter(self._table.values(), dtype=np.float64, count=len(self._table))
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with tmp.open("wb") as f:
            np.savez(f, ids=ids, counts=counts)
        tmp.replace(self.path)

    def read(self) -> tuple[I64, F64]:
        """The counts of every process's file in the folder, summed."""
        return read_local_hits(self.folder)

    def close(self) -> None:
        """Nothing to release: the file is complete after every flush."""


def read_local_hits(folder: Path) -> tuple[I64, F64]:
    """Sum of every hits-*.npz in `folder`, hottest first (an unreadable file is skipped)."""
    total: dict[int, float] = {}
    for path in sorted(folder.glob("hits-*.npz")):
        try:
            with np.load(path, allow_pickle=False) as table:
                ids, counts = table["ids"], table["counts"]
        except (OSError, ValueError, KeyError):
            continue
        if ids.shape != counts.shape or ids.dtype != np.int64:
            continue
        for item, count in zip(ids.tolist(), counts.tolist(), strict=True):
            total[item] = total.get(item, 0.0) + count
    return _ranked(total)


def _ranked(table: dict[int, float]) -> tuple[I64, F64]:
    """(ids, counts) hottest first, ties by id."""
    ranked = sorted(table.items(), key=lambda kv: (-kv[1], kv[0]))
    return np.array([i for i, _ in ranked], dtype=np.int64), np.array([c for _, c in ranked], dtype=np.float64)


class RedisHitStore:
    """One sorted set: member = gallery id, score = decayed count."""

    kind = "redis"

    def __init__(self, url: str, key: str, capacity: int, timeout_s: float = 1.0) -> None:
        from service.traffic.redis_store import _client

        self.key = key
        self.capacity = capacity
        self._client = _client(url, timeout_s)

    def add(self, counts: dict[int, float]) -> None:
        """ZINCRBY each id, then keep the `capacity` highest: one round trip."""
        if not counts:
            return
        pipe = self._client.pipeline(transaction=False)
        for item, count in counts.items():
            pipe.zincrby(self.key, count, str(item))
        pipe.zremrangebyrank(self.key, 0, -(self.capacity + 1))
        pipe.execute()

    def age(self, factor: float) -> None:
        """Scale every score in place, drop what fell below one half."""
        pipe = self._client.pipeline(transaction=False)
        pipe.zunionstore(self.key, {self.key: factor})
        pipe.zremrangebyscore(self.key, "-inf", "(0.5")
        pipe.execute()

    def read(self) -> tuple[I64, F64]:
        """Every (id, count), hottest first."""
        rows = self._client.zrevrange(self.key, 0, -1, withscores=True)
        table = {int(member): float(score) for member, score in rows}
        return _ranked(table)

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()


def _hits_dropped(ids: int) -> None:
    metrics.HITS.labels(event="dropped").inc(ids)


def _hits_failed(ids: int) -> None:
    metrics.HITS.labels(event="failed").inc(ids)


class HitCounter(Sampling[HitStore]):
    """Counts a sampled share of the returned ids into a store, off the request path; fail-open."""

    # Result lists held between flushes (each one array of ids).  They wait in the sink until the
    # flush, so the bound is larger than the sampler's: 65,536 lists of k=10 ids is about 12 MB, and
    # lasts 65 s at 1,000 requests/s, well past flush_s.
    QUEUE_SIZE = 65_536
    # A flush is due early once this many ids wait, so a burst costs one more store call, not memory.
    FLUSH_IDS = 262_144

    def __init__(
        self,
        store: HitStore,
        rate: float,
        *,
        queue_size: int = QUEUE_SIZE,
        flush_s: float = 5.0,
        half_life_s: float = 86_400.0,
        seed: int | None = None,
    ) -> None:
        super().__init__(store, rate, flush_s, seed)
        self.half_life_s = half_life_s
        self._closed: Closed | None = None
        self._sink: BackgroundSink[I64] = BackgroundSink(
            self._flush,
            thread_name="nobackfill-hits",
            label="hit counting",
            unit="ids",
            capacity=queue_size,
            batch_size=self.FLUSH_IDS,
            interval_s=flush_s,
            size_of=len,
            on_drop=_hits_dropped,
            on_failure=_hits_failed,
            periodic=Periodic(half_life_s, "age", lambda: store.age(0.5)),
        )

    def offer(self, ids: I64) -> None:
        """Queue the returned ids of a sampled share of the result lists (rows of `ids`; -1 pads)."""
        if not len(ids):
            return
        picked = ids[self._picked(len(ids))]
        flat = picked[picked >= 0]
        if not len(flat):
            return
        self._sink.offer(flat.astype(np.int64, copy=True))  # full: dropped and counted by the sink

    def _flush(self, batch: list[I64]) -> None:
        """Add the batch's counts to the store (on the sink's thread); an error raises to the sink (failed)."""
        ids, counts = np.unique(np.concatenate(batch), return_counts=True)
        self.store.add(dict(zip(ids.tolist(), counts.astype(np.float64).tolist(), strict=True)))
        metrics.HITS.labels(event="counted").inc(int(counts.sum()))

    def close(self, timeout_s: float = 10.0) -> Closed:
        """Flush what is pending within timeout_s (what is left then is dropped, counted), close the store.

        Returns in time even with the queue full and the store hung (it used to block on the full queue).
        """
        if self._closed is not None:  # a second close: the store is closed already
            return self._closed
        self._closed = self._sink.close(timeout_s)
        try:
            self.store.close()
        except Exception:  # noqa: BLE001 (closing a broken store must not fail shutdown)
            log.debug("hit store close failed", exc_info=True)
        return self._closed


DEFAULT_KEY = "nobackfill:hits"
DEFAULT_FOLDER = Path("artifacts/hits")


def create_hit_counter(traffic: TrafficSettings, cache_redis_url: str | None) -> HitCounter | None:
    """The service's hit counter (None at traffic.hit_rate 0): Redis when a URL is set, the local folder otherwise."""
    if traffic.hit_rate == 0.0:
        return None
    url = traffic.redis_url or cache_redis_url
    store: HitStore = (
        RedisHitStore(url, traffic.hits_key, traffic.hits_capacity)
        if url
        else LocalHitStore(traffic.hits_dir, traffic.hits_capacity)
    )
    return HitCounter(store, traffic.hit_rate, half_life_s=traffic.hits_half_life_s)


def read_hits(where: str | None, key: str = DEFAULT_KEY, missing_ok: bool = False) -> tuple[I64, F64]:
    """Hit counts, hottest first, from a redis:// URL or a folder (None: the default folder).

    A folder that does not exist is no counts (or an InputError unless `missing_ok`); Redis that does
    not answer is an InputError naming the URL.
    """
    if where is not None and where.startswith(("redis://", "rediss://", "unix://")):
        store = RedisHitStore(where, key, capacity=1)
        try:
            return store.read()
        except Exception as exc:
            raise InputError(f"hit counts at {where}: {type(exc).__name__}: {exc}") from exc
        finally:
            store.close()
    folder = Path(where) if where is not None else DEFAULT_FOLDER
    if not folder.is_dir():
        if missing_ok:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
        raise InputError(f"hit counts: {folder} is not a folder (point --hits at the service's hits folder or Redis)")
    return read_local_hits(folder)
