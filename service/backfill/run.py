"""`backfill run`: re-encode gallery items with the new model into shards of the segment, resumably.

    plan (order)          given: the source's order; random: a seeded permutation; hot: the hit counts'
                          order (hottest first), then the rest in the seeded random order
    skip what moved       the ids already in the segment's shards (any writer's) are never encoded again,
                          nor those another writer (the service's cascade) publishes while the run goes
    goal                  --fraction F: until the segment holds ceil(F x gallery items); --limit N: N more
    encode                batch_size items per encoder call; all-zero rows (no known token) stay in the
                          old gallery and are counted
    publish               every shard_size rows one shard (layout.write_shard: hidden, fsynced, renamed)
    throttle              --rate: never more than that many items per second, averaged over the run

A shard is written on its own thread while the next is encoded.  A run killed at any moment loses
at most the rows not yet published (the shard being written and the one being encoded); a re-run
with the same plan skips everything published and continues, so the segment ends with the same ids
and rows as one uninterrupted run (for an encoder whose rows do not depend on the batch they are
in).  Ctrl-C and SIGTERM publish the rows already encoded, then stop.  One run at a time fills a
segment (an flock; a second is refused in one line); the service's cascade writer may add beside it.
"""

from __future__ import annotations

import fcntl
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service.backfill.sources import ItemSource
from service.backfill.targets import BackfillTarget, FolderTarget
from service.bulk.encode import encode_batch
from service.encoders.base import Encoder
from service.encoders.identity import ModelIdentity
from service.errors import InputError
from service.rows import F32, I64
from service.segment.layout import GalleryRef
from service.segment.sealed import SealReport
from service.vocabulary import Order

DEFAULT_SHARD_SIZE = 4096
LOCK_NAME = "backfill.lock"
DEFAULT_SEAL_ROWS = 10_000  # below this an exact scan costs about as much as a graph search (docs/backfill.md)


@dataclass(frozen=True)
class RunOptions:
    """How one `backfill run` goes."""

    order: Order = Order.given
    fraction: float | None = None
    limit: int | None = None
    rate: float | None = None
    batch_size: int = 64
    shard_size: int = DEFAULT_SHARD_SIZE
    seed: int = 0
    progress: bool = True
    # At the end of a run, the rows no sealed index covers become one (segment/sealed.py) once there
    # are this many; 0: never (`backfill index` seals on demand).
    seal_rows: int = DEFAULT_SEAL_ROWS
    # This run's share of the items: part i of n (0 <= i < n), a fixed hash of each id; None: all of them.
    part: Part | None = None
    # Served new-model queries the seal measures its index's width on (sealed.measured_width); None: its own rows.
    seal_queries: F32 | None = None
    seal_queries_kind: str = "served"  # what they are: "served" (a traffic export's) or "support"


@dataclass
class RunReport:
    """What a run did."""

    planned: int = 0
    moved: int = 0
    zero_rows: int = 0
    shards: list[str] = field(default_factory=list)
    seconds: float = 0.0
    moved_before: int = 0
    moved_meanwhile: int = 0  # planned items another writer moved while this run went
    interrupted: str | None = None  # the signal that stopped the run early: "SIGINT" or "SIGTERM"
    sealed: SealReport | None = None  # the sealed index built at the end, if any

    @property
    def rate(self) -> float:
        """Items encoded per second over the run."""
        return (self.moved + self.zero_rows) / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Part:
    """Part `index` of `count` (0-based, as a Kubernetes Indexed Job numbers its pods)."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Part:
        """'I/N' -> Part(I, N); InputError unless 0 <= I < N."""
        head, _, tail = text.partition("/")
        if not (head.strip().isdigit() and tail.strip().isdigit()):
            raise InputError(f"--part must be I/N (part I of N, counted from 0), got {text!r}")
        part = cls(int(head), int(tail))
        if not 0 <= part.index < part.count:
            raise InputError(f"--part {text}: I must be in 0..{part.count - 1} (parts are counted from 0)")
        return part

    def holds(self, ids: I64) -> npt.NDArray[np.bool_]:
        """Which of `ids` are this part's: a multiplicative hash of the id, so every process agrees without talking."""
        mixed = (ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32)
        mine: npt.NDArray[np.bool_] = (mixed % np.uint64(self.count)).astype(np.int64) == self.index
        return mine

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def plan(ids: I64, order: Order, seed: int, hot: I64 | None = None) -> I64:
    """Every id once, in the order the run moves them."""
    if order == Order.given:
        return ids
    shuffled = ids[np.random.default_rng(seed).permutation(len(ids))]
    if order == Order.random:
        return shuffled
    if hot is None:
        raise InputError("--order hot needs the service's hit counts (none were found)")
    first = hot[np.isin(hot, ids)]
    _, where = np.unique(first, return_index=True)
    first = first[np.sort(where)]  # each hot id once, hottest first
    return np.concatenate([first, shuffled[~np.isin(shuffled, first)]])


def goal(total: int, moved: int, fraction: float | None, limit: int | None) -> int:
    """How many more items this run moves: up to `fraction` of the gallery, at most `limit`."""
    more = total - moved
    if fraction is not None:
        if not 0.0 <= fraction <= 1.0:
            raise InputError(f"--fraction must be in [0, 1], got {fraction}")
        more = max(0, math.ceil(fraction * total) - moved)
    if limit is not None:
        more = min(more, limit)
    return more


def run_backfill(
    target: Path | BackfillTarget,
    source: ItemSource,
    encoder: Encoder,
    model: ModelIdentity,
    gallery: GalleryRef,
    options: RunOptions,
    hot: I64 | None = None,
    writer: str = "backfill",
    on_shard: Callable[[str], None] | None = None,
) -> RunReport:
    """Move items per `options` into the segment (a folder, or any BackfillTarget); returns what was done.

    See the module docstring.  One run at a time per segment (another is refused in one line), and
    SIGTERM stops it as Ctrl-C does.
    """
    ids = source.ids()
    if len(ids) != gallery.ntotal:
        raise InputError(
            f"{source.where} holds {len(ids):,} items, but the gallery holds {gallery.ntotal:,}; "
            "backfill needs exactly the gallery's items"
        )
    into = FolderTarget(target) if isinstance(target, Path) else target
    try:
        into.prepare(model, gallery)
        with into.locked(options.part), stopped_by_sigterm():
            return _run(into, source, encoder, model, gallery, options, hot, writer, on_shard, ids)
    finally:
        into.close()


def _run(
    target: BackfillTarget,
    source: ItemSource,
    encoder: Encoder,
    model: ModelIdentity,
    gallery: GalleryRef,
    options: RunOptions,
    hot: I64 | None,
    writer: str,
    on_shard: Callable[[str], None] | None,
    ids: I64,
) -> RunReport:
    """run_backfill's work, under the segment's run lock."""
    from service.progress import progress_bar

    report = RunReport()
    moved = target.moved()  # and again before each batch: the service (cascade) may be writing too
    order = plan(ids, options.order, options.seed, hot)
    total = gallery.ntotal
    if options.part is not None:  # this part's items, in the plan's order (hot first stays hot first)
        order = order[options.part.holds(order)]
        moved = moved[options.part.holds(moved)]
        total = len(order)
    report.moved_before = len(moved)
    todo = order[~np.isin(order, moved)][: goal(total, len(moved), options.fraction, options.limit)]
    report.planned = len(todo)
    started = time.perf_counter()
    buffer_ids: list[I64] = []
    buffer_rows: list[F32] = []
    buffered = 0
    # A shard is written (files, fsync, sha256, rename) on its own thread while the next one is encoded;
    # at most one is in flight, so memory stays at two shards.
    writer_pool = ThreadPoolExecutor(1, thread_name_prefix="nobackfill-shard")
    in_flight: tuple[Future[str], int] | None = None

    def written() -> None:
        nonlocal in_flight
        if in_flight is None:
            return
        future, rows = in_flight
        in_flight = None
        name = future.result()
        report.shards.append(name)
        report.moved += rows
        if on_shard is not None:
            on_shard(name)

    def publish() -> None:
        nonlocal buffered, in_flight
        if not buffered:
            return
        written()
        shard_ids, shard_rows = np.concatenate(buffer_ids), np.concatenate(buffer_rows)
        in_flight = (writer_pool.submit(target.write, shard_ids, shard_rows, model, writer), buffered)
        buffer_ids.clear()
        buffer_rows.clear()
        buffered = 0

    bar = progress_bar(total=len(todo), unit="item", desc="backfill", enabled=options.progress)
    try:
        for start in range(0, len(todo), options.batch_size):
            planned = todo[start : start + options.batch_size]
            batch = planned[~target.moved_among(planned)]  # another writer (the service) moved some meanwhile
            report.moved_meanwhile += len(planned) - len(batch)
            if len(batch):
                rows, usable = _encode(encoder, source, batch)
                report.zero_rows += int((~usable).sum())
                if usable.any():
                    buffer_ids.append(batch[usable])
                    buffer_rows.append(rows[usable])
                    buffered += int(usable.sum())
            if buffered >= options.shard_size:
                publish()
            bar.update(len(planned))
            _throttle(started, start + len(planned), options.rate)
        publish()
        written()
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (Terminated)
        publish()  # what is encoded is kept: the next run continues after it
        written()
        report.interrupted = "SIGTERM" if isinstance(stop, Terminated) else "SIGINT"
    finally:
        writer_pool.shutdown(wait=True)  # a shard under way still lands, even when encoding failed
        bar.close()
        report.seconds = time.perf_counter() - started
    if not report.interrupted:  # a stopped run stops now; the next one seals
        report.sealed = target.finish(options.seal_rows, writer, options.seal_queries, options.seal_queries_kind)
    return report


def _encode(encoder: Encoder, source: ItemSource, batch: I64) -> tuple[F32, npt.NDArray[np.bool_]]:
    """New-model rows for the ids of `batch`, and which of them are usable (not all-zero)."""
    values = source.values(batch)
    missing = [int(i) for i, v in zip(batch, values, strict=True) if v is None]
    if missing:
        raise InputError(f"{source.where}: no item for gallery id {missing[0]} ({len(missing)} missing in a batch)")
    where = f"{source.where} (gallery ids {int(batch[0])}..{int(batch[-1])})"
    rows = encode_batch(encoder, [v for v in values if v is not None], source.modality, where, allow_zero=True)
    return rows, np.any(rows != 0, axis=1)


def _throttle(started: float, done: int, rate: float | None) -> None:
    """Sleep until `done` items fit under `rate` items per second since `started`."""
    if rate is None:
        return
    wait = started + done / rate - time.perf_counter()
    if wait > 0:
        time.sleep(wait)


def describe_report(report: RunReport, total: int) -> dict[str, Any]:
    """JSON-ready summary of a run."""
    return {
        "planned": report.planned,
        "moved": report.moved,
        "zero_rows": report.zero_rows,
        "shards": len(report.shards),
        "seconds": round(report.seconds, 2),
        "items_per_s": round(report.rate, 1),
        "moved_before": report.moved_before,
        "moved_meanwhile": report.moved_meanwhile,
        "gallery_items": total,
        "interrupted": report.interrupted is not None,
        "signal": report.interrupted,
        "sealed": None if report.sealed is None or report.sealed.name is None else sealed_summary(report.sealed),
    }


def sealed_summary(done: SealReport) -> dict[str, Any]:
    """JSON-ready summary of a seal."""
    return {
        "index": done.name,
        "rows": done.rows,
        "shards": done.shards,
        "absorbed": done.absorbed,
        "seconds": round(done.seconds, 2),
        "ef_search": done.ef_search,  # the width its seal measured, and the recall@10 found there
        "recall": None if done.recall is None else round(done.recall, 4),
        "probes": done.probes,  # what it measured them on: its own rows, or served queries
    }


class Terminated(KeyboardInterrupt):
    """SIGTERM (a pod's stop, `kill`): the run stops as it does on Ctrl-C, keeping what was encoded."""


@contextmanager
def stopped_by_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM raises Terminated in the main thread (elsewhere it is left as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:  # noqa: ARG001 (signal handler's signature)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def one_run_at_a_time(segment_dir: Path, part: Part | None = None) -> Iterator[None]:
    """Hold the segment's run lock; InputError at once, in one line, when another run holds what this one needs.

    A whole run holds SEGMENT/backfill.lock alone (an exclusive flock); a run of one part shares it
    with the other parts and holds its own SEGMENT/backfill.part-I-of-N.lock alone, so N parts run
    side by side while a second run of the same part, or a whole run beside them, is refused.  Two
    runs of one plan would encode the same items twice and race on what each counts; the cascade
    writer in the service needs no lock (it skips what moved).  A lock goes with its process, so a
    run killed with -9 never leaves one held.  flock needs a filesystem that honours it (local disks,
    most NFS v4 mounts).
    """
    with ExitStack() as held:
        holder = _flock(held, segment_dir / LOCK_NAME, exclusive=part is None)
        if holder is not None:
            what = f"a `backfill run` (pid {holder})" if holder else "parts of a `backfill run --part`"
            raise InputError(
                f"segment {segment_dir}: {what} {'is' if holder else 'are'} moving items into it; "
                "wait for it to finish, or stop it (what it encoded is kept)"
            )
        if part is not None:
            holder = _flock(held, segment_dir / f"backfill.part-{part.index}-of-{part.count}.lock", exclusive=True)
            if holder is not None:
                raise InputError(
                    f"segment {segment_dir}: part {part} is being moved by another run (pid {holder}); "
                    "each part runs once at a time"
                )
        yield


def _flock(held: ExitStack, path: Path, exclusive: bool) -> str | None:
    """An flock on `path` for the life of `held`; None when taken, else the holder's pid ("" for shared holders)."""
    try:
        handle = held.enter_context(path.open("a+", encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"cannot open the run lock {path}: {exc.strerror or exc}") from exc
    try:
        fcntl.flock(handle.fileno(), (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        return handle.read().strip()  # only an exclusive holder writes its pid
    if exclusive:
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
    held.callback(_release, handle, exclusive)
    return None


def _release(handle: Any, exclusive: bool) -> None:
    """Unlock (an exclusive holder first clears its pid, so no later reader names a finished run)."""
    if exclusive:
        handle.seek(0)
        handle.truncate()
    fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
