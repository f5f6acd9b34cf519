"""What the benchmarks share: CLI runs, served processes, the re-indexed baseline, interleaved timing, ratio tables.

Every figure is a ratio measured side by side in one run (these machines are noisy): `interleave`
times each variant on the same query in turn, rotating which goes first, and `ratio_rows` reads every
variant against the re-indexed service and the bare floor of that same run.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from service.compat.profile import CompatProfile, save_profile
from service.encoders.base import Encoder
from service.encoders.batcher import MicroBatcher
from service.index.gallery import Gallery
from service.settings import EncoderSettings


def cli(*args: str | Path) -> None:
    """Run a `nobackfill` subcommand, failing loudly."""
    subprocess.run([sys.executable, "-m", "service.cli", *map(str, args)], check=True)


def write_identity_profile(path: Path, model_id: str, dim: int) -> None:
    """The profile of a re-indexed service: the new model on both sides, R = I, serving mode `old`."""
    identity = CompatProfile(
        head="aligned",
        old_model_id=model_id,
        new_model_id=model_id,
        old_dim=dim,
        new_dim=dim,
        alphas={},
        params={},
        fit_on="none: re-indexed baseline",
        folds=0,
        fit_report={},
        tensors={"R": np.eye(dim, dtype=np.float32)},
    )
    save_profile(identity, path, overwrite=True)


class Baseline:
    """The bare floor: the new encoder behind the same batcher, searching a new-model gallery, nothing else."""

    def __init__(self, encoder: Encoder, gallery: Gallery, nprobe: int, max_wait_ms: float) -> None:
        self.batcher = MicroBatcher(encoder, 32, max_wait_ms, name="new")
        self.gallery = gallery
        self.nprobe = nprobe

    async def search(self, text: str) -> None:
        """Encode and search, as the pipeline does (search on a worker thread)."""
        rows = await self.batcher.encode([text], "text")
        await asyncio.to_thread(self.gallery.search, rows, 10, self.nprobe)


def synthetic_encoders(**fields: Any) -> dict[str, EncoderSettings]:
    """Both synthetic encoders with the same further settings, as a Settings update ({"old": ..., "new": ...})."""
    return {side: EncoderSettings(backend=f"synthetic-{side}", **fields) for side in ("old", "new")}


def free_port() -> int:
    """A TCP port nobody listens on right now (tests/support/servers.py starts its servers on these too)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(
    url: str,
    timeout_s: float,
    process: subprocess.Popen[Any] | None = None,
    poll_s: float = 0.2,
    request_timeout_s: float = 1.0,
) -> bool:
    """Poll GET `url` (a server's readiness probe) until it answers 200: True; False once `timeout_s` have passed
    or `process` (the server, when given) has exited, so the caller can tell which and say so in its own words.

    Polled, never a fixed sleep: a server's start takes a second on an idle box and minutes on a busy one.
    A refused or timed-out request only means the server is not listening yet.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None and process.poll() is not None:
            return False
        try:
            if httpx.get(url, timeout=request_timeout_s).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def percentiles(samples: Sequence[float]) -> dict[str, float]:
    """p50 / p99 in milliseconds."""
    ordered = sorted(samples)
    return {
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


async def time_one(call: Awaitable[Any]) -> float:
    """Seconds one awaited call takes."""
    start = time.perf_counter()
    await call
    return time.perf_counter() - start


async def interleave(calls: dict[str, Callable[[int], Awaitable[Any]]], n: int) -> dict[str, list[float]]:
    """Seconds of call(i) for i < n, every variant on query i before any on i + 1.

    The variant that goes first rotates with i, so neither machine noise nor the order (a variant
    after an idle gap finds colder caches) favours one.
    """
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(n):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(await time_one(calls[name](i)))
    return samples


async def warmed_interleave(
    calls: dict[str, Callable[[int], Awaitable[Any]]], n: int, warm: int = 20
) -> dict[str, list[float]]:
    """interleave(calls, n) after `warm` untimed rounds of every call (caches, threads, connections, BLAS pools)."""
    for i in range(warm):
        for call in calls.values():
            await call(i)
    return await interleave(calls, n)


def ratio_interval(
    samples: Sequence[float], reference: Sequence[float], q: float, resamples: int = 1000
) -> tuple[float, float]:
    """95 % bootstrap interval of quantile_q(samples) / quantile_q(reference), queries resampled in pairs.

    Both lists are timed on the same queries in the same order, so a resample keeps each query's
    pair together: the interval says how much the ratio owes to which queries were drawn.
    """
    a, b = np.asarray(samples), np.asarray(reference)
    picks = np.random.default_rng(0).integers(0, a.size, (resamples, a.size))
    at = min(a.size - 1, int(q * a.size))  # the rank percentiles() reads
    ratios = np.sort(a[picks], axis=1)[:, at] / np.sort(b[picks], axis=1)[:, at]
    low, high = np.quantile(ratios, [0.025, 0.975])
    return float(low), float(high)


def ratio_rows(
    samples: dict[str, list[float]], labels: dict[str, str], base: str = "service", floor: str = "bare"
) -> list[dict[str, Any]]:
    """One row per variant: p50 / p99, their ratios to the `base` variant with 95 % intervals, p50 to the `floor`."""
    reference, bare = percentiles(samples[base]), percentiles(samples[floor])
    rows = []
    for name, label in labels.items():
        stats = percentiles(samples[name])
        p50_ci = ratio_interval(samples[name], samples[base], 0.5)
        p99_ci = ratio_interval(samples[name], samples[base], 0.99)
        rows.append(
            {
                "variant": label,
                **stats,
                "p50_ratio": stats["p50_ms"] / reference["p50_ms"],
                "p50_ratio_95ci": f"{p50_ci[0]:.3f}-{p50_ci[1]:.3f}",
                "p99_ratio": stats["p99_ms"] / reference["p99_ms"],
                "p99_ratio_95ci": f"{p99_ci[0]:.3f}-{p99_ci[1]:.3f}",
                "p50_ratio_vs_bare": stats["p50_ms"] / bare["p50_ms"],
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of dict rows."""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
    return "\n".join(lines)


def size_folder(work: Path, items: int) -> Path:
    """The work folder of one gallery size, `work`/`items`, created; kept between runs, so a rerun reuses what the
    last one built."""
    folder = work / f"{items}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def parse_args_and_work_folder(parser: argparse.ArgumentParser, work: Path) -> tuple[argparse.Namespace, Path]:
    """`parser`'s flags (it declares --items) with --work (default `work`) and --json added last, parsed, and the
    work folder of this gallery size."""
    parser.add_argument("--work", type=Path, default=work)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    return args, size_folder(args.work, args.items)


def store_bench_args(doc: str | None, work: Path) -> tuple[argparse.Namespace, Path]:
    """The flags of a store's served-against-bare benchmark (bench_pgvector.py, bench_qdrant.py), parsed, and the
    work folder of this gallery size (created; kept between runs)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--moved", type=float, default=0.5)
    parser.add_argument("--queries", type=int, default=300)
    return parse_args_and_work_folder(parser, work)
