"""Faults under load, measured against a real service process, a real Redis and real FAISS.

    .venv/bin/python loadtest/chaos.py [--world DIR] [--scenarios a,b,...] [--short] [--json OUT]

Scenarios (each starts its own redis-server and service process, and stops them):
    redis-kill      Redis SIGKILLed mid-run and restarted empty, under a Locust run: failed requests,
                    and how long until the cache hit ratio (scraped from /metrics) is back
    redis-pause     Redis frozen with SIGSTOP under load: failures and latency while it is frozen
    burst           the sustainable rate measured closed-loop, the p99 at a quarter of it (unloaded), then
                    4x it offered open-loop: how the excess is refused (503 + Retry-After, how fast), the
                    accepted p99 against its bound (2 x API__MAX_QUEUE_MS + the unloaded p99), the
                    goodput against the sustainable rate, the RSS, recovery
    encoder-faults  inputs that make the new model raise, return NaN or hang, mixed into normal load:
                    which requests fail with which code, how long they take, what /readyz says; then
                    each input that hung is sent again (it must be refused at once, 422 poison_input)
    sigterm         SIGTERM mid-load: accepted requests left unanswered, seconds until the process exits
    gallery-bytes   sha256 of every gallery file before and after a load run and two profile reloads
The service runs the synthetic encoders through the test-only `faulty-*` backends
(tests/support/faulty_encoder.py: simulated models that misbehave only on marked inputs) with a simulated
per-batch cost, so every fault is injected on purpose and nothing else differs from `nobackfill serve`.
`--short` runs every scenario in seconds (the version `make test` runs); the default is the long one
(`make chaos`).  `--real DIR --scenarios burst` runs the burst on the real upgrade `nobackfill demo --real`
builds (DIR: artifacts/real): its two sentence-transformers models in child processes, the new one as 2
copies x 1 thread, the corpus's test and support questions as the queries.  NOBACKFILL_* variables in
the environment reach the service (e.g. NOBACKFILL_API__MAX_QUEUE_MS=100 for the burst's latency /
refusal trade-off; CHAOS_SUSTAINABLE_RPS=92.5 to skip measuring the sustainable rate, which other load
on the box drags down).  Prints one JSON object per scenario (and writes them all to --json).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import hashlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from benchlib import free_port, wait_ready
from prometheus_client.parser import text_string_to_metric_families
from report import cache_counts  # loadtest/report.py: (hits, misses) of one scrape

from service.gc_pause import freeze_startup_objects

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
NOBACKFILL = [PYTHON, "-m", "service.cli"]
FAULTY_SERVE = [PYTHON, str(ROOT / "tests" / "support" / "faulty_encoder.py"), "serve"]
CAPTION = "item-{:010d} caption-{}"
ADMIN_KEY = "chaos-admin-key"
CACHE_DEADLINE_S = 4 * 0.05  # redis_cache.DEADLINE_TIMEOUTS x the default socket timeout
# The service's api.max_queue_ms as this run sets it (its default otherwise): the burst's bound reads it.
MAX_QUEUE_MS = float(os.environ.get("NOBACKFILL_API__MAX_QUEUE_MS", "250"))


@dataclass(frozen=True)
class Plan:
    """Durations and rates of one run: long (make chaos) or short (make test)."""

    gallery_size: int
    nlist: int
    locust_s: int
    kill_at_s: int
    down_s: int
    pause_run_s: float
    pause_at_s: float
    pause_s: float
    capacity_s: float
    burst_s: float
    recover_s: float
    faults_s: float
    sigterm_after_s: float


LONG = Plan(100_000, 256, 120, 40, 20, 30, 10, 10, 10, 30, 10, 30, 5)
SHORT = Plan(20_000, 64, 12, 4, 2, 5, 1.5, 2, 2, 3, 2, 4, 1.5)


def build_world(root: Path, plan: Plan) -> Path:
    """Gallery, support set and profile of the synthetic world under root (built once, then reused)."""
    if (root / "profile" / "profile.json").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    run = [
        [
            "gallery",
            "build",
            "--size",
            str(plan.gallery_size),
            "--out",
            str(root / "gallery"),
            "--nlist",
            str(plan.nlist),
        ],
        ["synth", "support", "--n", "4000", "--out", str(root / "support")],
        ["fit", str(root / "support"), "--out", str(root / "profile"), "--folds", "3"],
    ]
    for args in run:
        subprocess.run([*NOBACKFILL, *args], check=True, cwd=ROOT, capture_output=True)
    return root


class Redis:
    """A throwaway redis-server on a fixed port that can be killed, restarted, paused and resumed."""

    def __init__(self) -> None:
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.025)
        raise TimeoutError("redis-server did not start")

    def kill(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait()
            self.process = None

    def signal(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)


class Service:
    """`nobackfill serve` with the faulty backends, on its own port; RSS read from /proc."""

    def __init__(self, world: Path, redis_url: str | None, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "NOBACKFILL_INDEX__GALLERY_DIR": str(world / "gallery"),
            "NOBACKFILL_COMPAT__PROFILE_DIR": str(world / "profile"),
            "NOBACKFILL_API__PORT": str(self.port),
            "NOBACKFILL_API__ADMIN_KEY": ADMIN_KEY,
            "NOBACKFILL_OLD__BACKEND": "faulty-old",
            "NOBACKFILL_NEW__BACKEND": "faulty-new",
            # A real model's cost, simulated (a sleep, like GPU work that releases the GIL).
            "NOBACKFILL_OLD__SIMULATED_COST_MS": "3",
            "NOBACKFILL_OLD__SIMULATED_COST_PER_ITEM_MS": "0.3",
            "NOBACKFILL_NEW__SIMULATED_COST_MS": "4",
            "NOBACKFILL_NEW__SIMULATED_COST_PER_ITEM_MS": "0.5",
            "OMP_NUM_THREADS": "1",
            **({"NOBACKFILL_CACHE__REDIS_URL": redis_url} if redis_url else {}),
            **env,
        }
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, log: Path) -> None:
        # The log goes to a file, never an unread pipe: a full pipe would block the service's writes.
        self.log = log
        with log.open("wb") as sink:
            self.process = subprocess.Popen(FAULTY_SERVE, env=self.env, cwd=ROOT, stdout=sink, stderr=sink)
        if wait_ready(self.url + "/readyz", 180, self.process):
            return
        if self.process.poll() is not None:
            raise RuntimeError(f"service exited: {log.read_text()[-2000:]}")
        raise TimeoutError("service did not become ready")

    def rss_mb(self) -> float:
        assert self.process is not None
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


# ---- load ---------------------------------------------------------------------------------------------


@dataclass
class Shot:
    """One request: when it was sent (s from the start), how long it took, what came back."""

    sent: float
    seconds: float
    status: int  # 0: no HTTP answer
    code: str = ""  # error code from the envelope, or the transport error's class name
    retry_after: str | None = None
    tag: str = ""


@dataclass
class Queries:
    """Captions of random gallery items; a share repeats a hot set so the old-embedding cache hits."""

    gallery_size: int
    hot: int = 500
    repeat: float = 0.8
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def text(self) -> str:
        if self.rng.random() < self.repeat:
            i = self.rng.randrange(self.hot)
            return CAPTION.format(i * 7919 % self.gallery_size, 1)
        return CAPTION.format(self.rng.randrange(self.gallery_size), self.rng.randrange(2, 10_000))


class RawClient:
    """A minimal HTTP/1.1 keep-alive client on asyncio streams.

    httpx spends about a millisecond of CPU per request, so on a 2-core box a burst generator built on
    it saturates itself before the service: its own queue would be measured as the service's latency.
    This one writes the request bytes and reads the status, the headers and Content-Length bytes.
    """

    def __init__(self, url: str) -> None:
        host, _, port = url.removeprefix("http://").partition(":")
        self.host, self.port = host, int(port)
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """(status, lower-cased headers, body); OSError / IncompleteReadError when the connection fails.

        A kept-alive connection the server has since closed (uvicorn drops them after 5 idle seconds)
        fails before a byte of answer: that request is sent again on a new connection, as browsers and
        HTTP libraries do; any other failure is the caller's to count.
        """
        while self.idle:
            try:
                return await self._exchange(*self.idle.pop(), path, body)
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                if isinstance(exc, asyncio.IncompleteReadError) and exc.partial:
                    raise  # the server had begun answering: not a stale connection
        return await self._exchange(*await asyncio.open_connection(self.host, self.port), path, body)

    async def _exchange(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str, body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        head = f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
        try:
            writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            status_line = await reader.readuntil(b"\r\n")
            headers = {}
            while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            payload = await reader.readexactly(int(headers.get("content-length", "0")))
        except BaseException:
            writer.close()
            raise
        if headers.get("connection", "").lower() == "close":
            writer.close()
        else:
            self.idle.append((reader, writer))
        return int(status_line.split()[1]), headers, payload

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


async def _shoot(client: RawClient, start: float, text: str, tag: str, shots: list[Shot]) -> None:
    body = json.dumps({"queries": [{"text": text}], "k": 10, "mode": "slerp"}).encode()
    sent = time.perf_counter()
    try:
        status, headers, payload = await client.post("/v1/search", body)
    except (OSError, asyncio.IncompleteReadError) as exc:
        shots.append(Shot(sent - start, time.perf_counter() - sent, 0, type(exc).__name__, tag=tag))
        return
    took = time.perf_counter() - sent
    code = json.loads(payload).get("error", {}).get("code", "") if status != 200 else ""
    shots.append(Shot(sent - start, took, status, code, headers.get("retry-after"), tag))


async def _paced(rate: float, seconds: float, shoot: Callable[[float], Awaitable[None]]) -> float:
    """Start shoot(start) `rate` times a second for `seconds` whatever the answers (open loop), then wait
    for every answer; returns the rate actually offered."""
    start = time.perf_counter()
    tasks: set[asyncio.Task[None]] = set()
    n = 0
    while (now := time.perf_counter() - start) < seconds:
        while n < int(now * rate) + 1:
            task = asyncio.create_task(shoot(start))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            n += 1
        await asyncio.sleep(0.002)
    sent_for = time.perf_counter() - start
    await asyncio.gather(*tasks)
    return n / sent_for


async def open_loop(
    url: str, rate: float, seconds: float, text_of: Callable[[], tuple[str, str]], shots: list[Shot]
) -> float:
    """The open loop on RawClient, light enough to offer several times the service's capacity."""
    client = RawClient(url)
    try:
        return await _paced(rate, seconds, lambda start: _shoot(client, start, *text_of(), shots))
    finally:
        client.close()


async def closed_loop(url: str, clients: int, seconds: float, text_of: Callable[[], tuple[str, str]]) -> float:
    """Answered requests per second with `clients` callers each sending as soon as the last answer came."""
    shots: list[Shot] = []
    start = time.perf_counter()

    async def caller() -> None:
        client = RawClient(url)
        while time.perf_counter() - start < seconds:
            await _shoot(client, start, *text_of(), shots)
        client.close()

    await asyncio.gather(*(caller() for _ in range(clients)))
    return sum(s.status == 200 for s in shots) / (time.perf_counter() - start)


SUSTAINED_P99_S = 0.25


async def sustainable_rate(url: str, seconds: float, text_of: Callable[[], tuple[str, str]]) -> float:
    """The highest open-loop rate, in steps of a quarter of the closed-loop maximum, that is answered
    in full with a p99 under SUSTAINED_P99_S (the closed-loop maximum itself queues without bound)."""
    ceiling = await closed_loop(url, 16, seconds, text_of)
    sustained = ceiling / 8
    for share in (0.25, 0.5, 0.75, 1.0):
        shots: list[Shot] = []
        await open_loop(url, share * ceiling, seconds, text_of, shots)
        if any(s.status != 200 for s in shots) or pct([s.seconds for s in shots], 99) > SUSTAINED_P99_S * 1000:
            break
        sustained = share * ceiling
        await asyncio.sleep(0.5)
    return sustained


def pct(values: list[float], q: float) -> float:
    """q-th percentile in milliseconds (nan for none)."""
    return float(np.percentile(np.array(values) * 1000, q)) if values else float("nan")


def scrape(url: str) -> str:
    """The service's /metrics text."""
    return httpx.get(url + "/metrics", timeout=5).text


# ---- scenarios ---------------------------------------------------------------------------------------


def redis_kill(world: Path, plan: Plan, out: Path) -> dict[str, Any]:
    """Locust runs for locust_s; Redis is SIGKILLed at kill_at_s and restarted (empty) down_s later."""
    redis = Redis()
    redis.start()
    service = Service(world, redis.url)
    service.start(out / "chaos-redis-kill-service.log")
    samples: list[tuple[float, float, float]] = []
    prefix = out / "chaos-redis-kill"
    locust = subprocess.Popen(
        [
            str(Path(PYTHON).with_name("locust")), "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless",
            "-u", "16", "-r", "16", "-t", f"{plan.locust_s}s", "--host", service.url, "--csv", str(prefix),
            "--user-rate", "10", "--mode-mix", "slerp:1", "--batch-mix", "1:1", "--hot-set", "500",
            "--repeat-ratio", "0.8", "--gallery-size", str(plan.gallery_size), "--only-summary",
            "--hit-report", str(out / "chaos-hit.json"), "--loglevel", "WARNING",
        ],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    start = time.monotonic()
    killed_at = restarted_at = None
    try:
        while locust.poll() is None:
            t = time.monotonic() - start
            if killed_at is None and t >= plan.kill_at_s:
                redis.kill()
                killed_at = t
            if killed_at is not None and restarted_at is None and t >= plan.kill_at_s + plan.down_s:
                redis.start()
                restarted_at = t
            samples.append((t, *cache_counts(scrape(service.url))))
            time.sleep(0.5)
    finally:
        service.stop()
        redis.kill()
    stats = _locust_totals(prefix)
    ratio = _windowed_hit_ratio(samples, window_s=2.0)
    before = [r for t, r in ratio if plan.kill_at_s * 0.5 <= t < plan.kill_at_s]
    baseline = float(np.mean(before)) if before else float("nan")
    back = next((t for t, r in ratio if restarted_at is not None and t > restarted_at and r >= 0.9 * baseline), None)
    down = [
        r for t, r in ratio if killed_at is not None and restarted_at is not None and killed_at + 1 < t < restarted_at
    ]
    return {
        "scenario": "redis-kill",
        "requests": stats["requests"],
        "failed": stats["failures"],
        "p50_ms": stats["p50"],
        "p99_ms": stats["p99"],
        "max_ms": stats["max"],
        "hit_ratio_before": round(baseline, 3),
        "hit_ratio_down": round(float(np.mean(down or [np.nan])), 3),
        "seconds_to_hit_ratio_back": None if back is None or restarted_at is None else round(back - restarted_at, 1),
        "killed_at_s": killed_at,
        "down_s": plan.down_s,
    }  # fmt: skip


def _locust_totals(prefix: Path) -> dict[str, float]:
    with open(f"{prefix}_stats.csv", newline="") as fh:
        row = next(r for r in csv.DictReader(fh) if r["Name"] == "Aggregated")
    return {
        "requests": int(row["Request Count"]),
        "failures": int(row["Failure Count"]),
        "p50": float(row["50%"]),
        "p99": float(row["99%"]),
        "max": float(row["Max Response Time"]),
    }


def _windowed_hit_ratio(samples: list[tuple[float, float, float]], window_s: float) -> list[tuple[float, float]]:
    """(end time, hits / (hits + misses)) over each window of the scraped counters."""
    out = []
    j = 0
    for i, (t, hits, misses) in enumerate(samples):
        while samples[j][0] < t - window_s:
            j += 1
        if i > j:
            dh, dm = hits - samples[j][1], misses - samples[j][2]
            if dh + dm > 0:
                out.append((t, dh / (dh + dm)))
    return out


def redis_pause(world: Path, plan: Plan, out: Path) -> dict[str, Any]:
    """Open-loop load; Redis SIGSTOPped at pause_at_s for pause_s, then SIGCONT."""
    redis = Redis()
    redis.start()
    service = Service(world, redis.url)
    service.start(out / "chaos-redis-pause-service.log")
    queries = Queries(plan.gallery_size)
    shots: list[Shot] = []

    async def run() -> float:
        load = asyncio.create_task(open_loop(service.url, 100, plan.pause_run_s, lambda: (queries.text(), ""), shots))
        await asyncio.sleep(plan.pause_at_s)
        redis.signal(signal.SIGSTOP)
        await asyncio.sleep(plan.pause_s)
        redis.signal(signal.SIGCONT)
        return await load

    try:
        rate = asyncio.run(run())
    finally:
        service.stop()
        redis.kill()
    paused = [s for s in shots if plan.pause_at_s <= s.sent < plan.pause_at_s + plan.pause_s]
    other = [s for s in shots if s not in paused]
    # A search shed for want of CPU is the overload rule at work, not a Redis fault getting through: counted
    # apart, so a starved box reads as such.
    shed = _shed(shots)
    return {
        "scenario": "redis-pause",
        "requests": len(shots),
        "rate_rps": round(rate, 1),
        "failed": sum(s.status != 200 for s in shots) - len(shed),
        "shed": len(shed),
        "paused_answered": sum(s.status == 200 for s in paused),
        "paused_requests": len(paused),
        "paused_p50_ms": round(pct([s.seconds for s in paused], 50), 1),
        "paused_p99_ms": round(pct([s.seconds for s in paused], 99), 1),
        "paused_max_ms": round(max((s.seconds for s in paused), default=float("nan")) * 1000, 1),
        "other_p99_ms": round(pct([s.seconds for s in other], 99), 1),
        "cache_deadline_ms": CACHE_DEADLINE_S * 1000,
    }


# Model-bound, as on a GPU box: the encoders' simulated time, not this box's 2 cores, sets the
# sustainable rate (so 4x it is a rate this box can still offer and refuse), and requests take long
# enough that many are in flight when SIGTERM comes.
MODEL_BOUND = {
    f"NOBACKFILL_{role}__{name}": value
    for role in ("OLD", "NEW")
    for name, value in (("SIMULATED_COST_MS", "20"), ("SIMULATED_COST_PER_ITEM_MS", "5"), ("MAX_BATCH_SIZE", "4"))
}


def real_upgrade(real: Path) -> dict[str, str]:
    """The service settings of demo --real's upgrade in `real`, the new model as 2 copies x 1 thread."""
    models = real / "models"
    return {
        "NOBACKFILL_OLD__BACKEND": "sentence-transformers",
        "NOBACKFILL_OLD__PATH": str(models / "minilm-static-256"),
        "NOBACKFILL_OLD__THREADS": "1",
        "NOBACKFILL_NEW__BACKEND": "sentence-transformers",
        "NOBACKFILL_NEW__PATH": str(models / "all-MiniLM-L6-v2"),
        "NOBACKFILL_NEW__REPLICAS": "2",
        "NOBACKFILL_NEW__THREADS": "1",
        "NOBACKFILL_INDEX__NPROBE": "32",
        "HF_HUB_OFFLINE": "1",
    }


def real_questions(real: Path) -> Callable[[], str]:
    """Random questions of the real corpus's test and support pairs."""
    questions = [
        json.loads(line)["query"]
        for name in ("test.jsonl", "support.jsonl")
        for line in (real / "corpus" / name).read_text().splitlines()
        if line.strip()
    ]
    rng = random.Random(0)
    return lambda: rng.choice(questions)


def burst(world: Path, plan: Plan, out: Path, real: Path | None = None) -> dict[str, Any]:
    """Find the sustainable rate, offer 4x it open-loop, then half of it: refusals, p99, RSS, recovery.

    `real`: serve the real upgrade in that folder (demo --real's) instead of the simulated models.
    """
    service = Service(world, None, **(real_upgrade(real) if real else MODEL_BOUND))
    service.start(out / "chaos-burst-service.log")
    question = real_questions(real) if real else Queries(plan.gallery_size).text
    text = lambda: (question(), "")  # noqa: E731
    rss: list[float] = []
    server: list[dict[str, tuple[float, float]]] = []

    unloaded: list[Shot] = []
    refusal_reasons: dict[str, float] = {}
    generator_lag: list[float] = []
    server_lag: list[float] = []  # the service's own loop lag (its moving average), sampled

    async def run() -> tuple[float, float, list[Shot], float, list[Shot]]:
        # CHAOS_SUSTAINABLE_RPS: a rate measured before on a quiet box, when this one is shared and noisy.
        given = os.environ.get("CHAOS_SUSTAINABLE_RPS")
        capacity = float(given) if given else await sustainable_rate(service.url, plan.capacity_s, text)
        await asyncio.sleep(0.5)
        await open_loop(service.url, 0.25 * capacity, plan.capacity_s, text, unloaded)
        rss.append(service.rss_mb())

        async def sample_rss() -> None:
            while True:
                rss.append(service.rss_mb())
                text = await asyncio.to_thread(scrape, service.url)
                server_lag.append(float(re.search(r"^nobackfill_event_loop_lag_seconds (\S+)", text, re.M)[1]))
                await asyncio.sleep(0.25)

        # The generator's own full collections would stall its loop and count as the service's latency (the
        # service freezes what its startup made too: service/gc_pause.py).
        freeze_startup_objects()
        sampler = asyncio.create_task(sample_rss())
        own_lag = asyncio.create_task(_lateness(generator_lag))
        shots: list[Shot] = []
        server.append(_histograms(service.url))
        offered = await open_loop(service.url, 4 * capacity, plan.burst_s, text, shots)
        server.append(_histograms(service.url))
        sampler.cancel()
        own_lag.cancel()
        refusal_reasons.update(_refusals(service.url))
        after: list[Shot] = []
        await asyncio.sleep(1.0)
        await open_loop(service.url, 0.5 * capacity, plan.recover_s, text, after)
        return capacity, offered, shots, service.rss_mb(), after

    try:
        capacity, offered, shots, rss_after, after = asyncio.run(run())
    finally:
        service.stop()
    with (out / "chaos-burst-shots.csv").open("w", newline="") as fh:  # every burst request, for a closer look
        writer = csv.writer(fh)
        writer.writerow(["sent_s", "seconds", "status", "code"])
        writer.writerows((f"{s.sent:.4f}", f"{s.seconds:.4f}", s.status, s.code) for s in shots)
    ok = [s for s in shots if s.status == 200]
    refused = [s for s in shots if s.status == 503]
    after_non_200 = [s for s in after if s.status != 200]
    after_shed = _shed(after_non_200)
    unloaded_p99 = pct([s.seconds for s in unloaded], 99)
    bound = 2 * MAX_QUEUE_MS + unloaded_p99
    goodput = sum(s.sent < plan.burst_s for s in ok) / plan.burst_s  # answered 200 per second of the burst
    return {
        "scenario": "burst",
        "models": "real (demo --real; new: 2 copies x 1 thread)" if real else "simulated, model-bound",
        "sustainable_rps": round(capacity, 1),
        "max_queue_ms": MAX_QUEUE_MS,
        "unloaded_p99_ms": round(unloaded_p99, 1),
        "offered_rps": round(offered, 1),
        "requests": len(shots),
        "accepted": len(ok),
        "refused_503": len(refused),
        "refused_with_retry_after": sum(s.retry_after is not None for s in refused),
        "other_failures": len(shots) - len(ok) - len(refused),
        "refusal_p50_ms": round(pct([s.seconds for s in refused], 50), 1),
        "refusal_p99_ms": round(pct([s.seconds for s in refused], 99), 1),
        "accepted_p50_ms": round(pct([s.seconds for s in ok], 50), 1),
        "accepted_p99_ms": round(pct([s.seconds for s in ok], 99), 1),
        "accepted_p99_bound_ms": round(bound, 1),
        "accepted_max_ms": round(pct([s.seconds for s in ok], 100), 1),
        "goodput_rps": round(goodput, 1),
        "goodput_share": round(goodput / capacity, 3) if capacity else None,
        "retry_after_values": sorted({s.retry_after for s in refused if s.retry_after is not None}),
        "refusals_by_reason": refusal_reasons,  # deadline: per encoder call; since the start (sustainable rate too)
        # The generator's own event loop, late by this much, adds it to what it measures of the service.
        "generator_lag_p50_ms": round(pct(generator_lag, 50), 1),
        "generator_lag_p99_ms": round(pct(generator_lag, 99), 1),
        "service_loop_lag_p50_ms": round(pct(server_lag, 50), 1),
        "service_loop_lag_max_ms": round(pct(server_lag, 100), 1),
        # Inside the service during the burst, means: "request" from middleware to response (the rest of a
        # client's wait is queueing before it), then each stage and each encoder's batches.
        "server_means": _means_between(*server),
        "rss_mb_before": round(rss[0], 1),
        "rss_mb_max": round(max(rss), 1),
        "rss_mb_after": round(rss_after, 1),
        "recovery_requests": len(after),
        "recovery_answered": len(after) - len(after_non_200),
        # Half the rate measured before the burst is more than a box whose cores were taken since can serve:
        # what it sheds then (503 overloaded, Retry-After) is admission at work, counted apart from failures.
        "recovery_shed": len(after_shed),
        "recovery_failures": len(after_non_200) - len(after_shed),
        "recovery_non_200_answers": _named(after_non_200),
        "recovery_p99_ms": round(pct([s.seconds for s in after], 99), 1),
    }


def _named(shots: list[Shot]) -> dict[str, int]:
    """How many of `shots` got each answer, as "status code" (e.g. "503 overloaded")."""
    return dict(sorted(Counter(f"{s.status} {s.code}" for s in shots).items()))


def _shed(shots: list[Shot]) -> list[Shot]:
    """The searches shed by admission for want of CPU: 503 overloaded with a Retry-After (not a failure)."""
    return [s for s in shots if s.status == 503 and s.code == "overloaded" and s.retry_after]


async def _lateness(samples: list[float], tick_s: float = 0.01) -> None:
    """Append how late this loop wakes a tick_s timer, tick after tick, until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + tick_s
        await asyncio.sleep(tick_s)
        samples.append(max(loop.time() - due, 0.0))


def _refusals(url: str) -> dict[str, float]:
    """The service's 503 refusals so far by reason: admission's (queue_time, in_flight, deadline) and loop_lag."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(scrape(url)):
        for sample in family.samples:
            if sample.name == "nobackfill_admission_refusals_total":
                found[sample.labels["reason"]] = sample.value
            elif sample.name == "nobackfill_shed_requests_total":
                found["loop_lag"] = sample.value
    return found


def _histograms(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of the service's latency histograms: the search route's whole request, each stage, each
    encoder's batches (keys "request", "stage:<name>", "batch:<encoder>", "batch_size:<encoder>")."""
    names = {
        "nobackfill_request_duration_seconds": ("request", "route"),
        "nobackfill_stage_duration_seconds": ("stage:", "stage"),
        "nobackfill_encoder_batch_duration_seconds": ("batch:", "encoder"),
        "nobackfill_encoder_batch_size": ("batch_size:", "encoder"),
    }
    found: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(scrape(url)):
        if family.name not in names:
            continue
        prefix, label = names[family.name]
        for sample in family.samples:
            suffix = sample.name.removeprefix(family.name)
            if suffix not in ("_sum", "_count"):
                continue
            value = sample.labels.get(label, "")
            if prefix == "request" and value != "/v1/search":
                continue
            key = prefix if prefix == "request" else prefix + value
            found.setdefault(key, [0.0, 0.0])[suffix == "_count"] += sample.value
    return {key: (total, count) for key, (total, count) in found.items()}


def _means_between(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Each histogram's mean over the observations between two scrapes (ms; items for batch sizes)."""
    means = {}
    for key, (total, count) in after.items():
        total0, count0 = before.get(key, (0.0, 0.0))
        if count > count0:
            scale = 1 if key.startswith("batch_size:") else 1000
            means[key] = round(scale * (total - total0) / (count - count0), 1)
    return means


HANG_S = 2.0
PROBE = "chaos probe: a caption that hangs the new model !hang-new"


def encoder_faults(world: Path, plan: Plan, out: Path) -> dict[str, Any]:
    """Marked inputs make the new model raise (3 %), return NaN (3 %) or hang 2 s (0.5 %; timeout 1 s)."""
    service = Service(
        world,
        None,
        NOBACKFILL_NEW__TIMEOUT_S="1",
        NOBACKFILL_NEW__REPLICAS=os.environ.get("CHAOS_FAULT_REPLICAS", "2"),
        FAULTY_HANG_S=str(HANG_S),
    )
    service.start(out / "chaos-encoder-faults-service.log")
    queries = Queries(plan.gallery_size)
    rng = random.Random(1)

    def text() -> tuple[str, str]:
        draw = rng.random()
        for tag, share in (("raise", 0.03), ("nan", 0.03), ("hang", 0.005)):
            if draw < share:
                return f"{queries.text()} !{tag}-new", tag
            draw -= share
        return queries.text(), ""

    shots: list[Shot] = []
    readiness: list[int] = []

    repeats: list[Shot] = []
    probes: list[Shot] = []
    refusal_reasons: dict[str, float] = {}
    texts: dict[int, str] = {}

    def remembered() -> tuple[str, str]:  # each shot's text, so the hung ones can be sent again
        text_now, tag = text()
        texts[len(texts)] = text_now
        return text_now, f"{tag}#{len(texts) - 1}"

    async def run() -> float:
        async def poll() -> None:
            async with httpx.AsyncClient(base_url=service.url, timeout=5) as client:
                while True:
                    readiness.append((await client.get("/readyz")).status_code)
                    await asyncio.sleep(0.1)

        poller = asyncio.create_task(poll())
        rate = await open_loop(service.url, 60, plan.faults_s, remembered, shots)
        poller.cancel()
        refusal_reasons.update(_refusals(service.url))
        # A client retrying an input that hung: refused at once, without sticking a replica again.  One
        # probe hangs alone first (once the replicas stuck by the load are back), so there is one at least.
        await asyncio.sleep(HANG_S + 0.5)
        client = RawClient(service.url)
        await _shoot(client, time.perf_counter(), PROBE, "probe", probes)
        timed_out = [s for s in shots if s.code == "encoder_timeout" and s.tag.startswith("hang")]
        hung = [texts[int(s.tag.partition("#")[2])] for s in timed_out]
        for again in [*hung, PROBE]:
            await _shoot(client, time.perf_counter(), again, "repeat", repeats)
        client.close()
        return rate

    try:
        rate = asyncio.run(run())
    finally:
        service.stop()
    for s in shots:
        s.tag = s.tag.partition("#")[0]
    by_tag: dict[str, Any] = {}
    for tag in ("", "raise", "nan", "hang", "probe", "repeat"):
        mine = [s for s in (repeats + probes if tag in ("probe", "repeat") else shots) if s.tag == tag]
        codes: dict[str, int] = {}
        for s in mine:
            key = "200" if s.status == 200 else f"{s.status} {s.code}"
            codes[key] = codes.get(key, 0) + 1
        by_tag[{"": "clean", "probe": "hang_probe", "repeat": "hang_repeated"}.get(tag, tag)] = {
            "requests": len(mine),
            "answers": codes,
            "p99_ms": round(pct([s.seconds for s in mine], 99), 1),
            "max_ms": round(pct([s.seconds for s in mine], 100), 1),
        }
    clean = [s for s in shots if s.tag == ""]
    return {
        "scenario": "encoder-faults",
        "rate_rps": round(rate, 1),
        "clean_200_share": round(sum(s.status == 200 for s in clean) / max(len(clean), 1), 4),
        "refusals_by_reason": refusal_reasons,
        "by_input": by_tag,
        "readyz_polls": len(readiness),
        "readyz_503": sum(code == 503 for code in readiness),
    }  # fmt: skip


def sigterm(world: Path, plan: Plan, out: Path) -> dict[str, Any]:
    """Open-loop load on the model-bound service; SIGTERM after sigterm_after_s; keep sending 3 s more."""
    service = Service(world, None, **MODEL_BOUND)
    service.start(out / "chaos-sigterm-service.log")
    queries = Queries(plan.gallery_size)
    shots: list[Shot] = []
    exit_s: list[float] = []
    signalled: list[float] = []
    assert service.process is not None
    process = service.process

    async def run() -> None:
        started = time.perf_counter()  # the open loop's clock starts within a millisecond of this
        load = asyncio.create_task(
            open_loop(service.url, 60, plan.sigterm_after_s + 3, lambda: (queries.text(), ""), shots)
        )
        await asyncio.sleep(plan.sigterm_after_s)
        sent = time.perf_counter()
        signalled.append(sent - started)
        process.send_signal(signal.SIGTERM)
        while process.poll() is None:
            await asyncio.sleep(0.01)
        exit_s.append(time.perf_counter() - sent)
        await load

    try:
        asyncio.run(run())
    finally:
        service.stop()
    at = signalled[0] if signalled else float("inf")
    answered = [s for s in shots if s.status != 0]
    # The server has surely read a request sent SETTLE_S before the signal: it must be answered.  One
    # sent later may still sit unread in a socket when uvicorn closes its idle connections and its
    # listener; it is refused, never half-served.
    had = [s for s in shots if s.sent < at - SETTLE_S]
    dropped = [s for s in had if s.status == 0]
    in_flight = [s for s in answered if s.sent < at < s.sent + s.seconds]
    late = [s for s in shots if s.sent >= at - SETTLE_S]
    non_200 = [s for s in answered if s.status != 200]
    # As in redis-pause: a search shed for want of CPU is admission at work on a busy box, not the drain
    # failing; counted apart, and every other non-200 answer named.
    shed = _shed(non_200)
    return {
        "scenario": "sigterm",
        "requests": len(shots),
        "answered": len(answered),
        "answered_non_200": len(non_200),
        "shed": len(shed),
        "non_200_answers": _named(non_200),
        "sent_before_signal": len(had),
        "accepted_but_unanswered": len(dropped),
        "in_flight_at_sigterm_answered": len(in_flight),
        "later_answered": sum(s.status != 0 for s in late),
        "later_refused": sum(s.status == 0 for s in late),
        "unanswered_errors": sorted({s.code for s in dropped}),
        "exit_seconds": round(exit_s[0], 2) if exit_s else None,
        "exit_code": process.returncode,
    }  # fmt: skip


SETTLE_S = 0.05


def gallery_bytes(world: Path, plan: Plan, out: Path) -> dict[str, Any]:
    """sha256 of every gallery file, before and after load plus two admin profile reloads."""

    def digests() -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((world / "gallery").iterdir())}

    before = digests()
    service = Service(world, None)
    service.start(out / "chaos-gallery-bytes-service.log")
    queries = Queries(plan.gallery_size)
    shots: list[Shot] = []
    reloads = []
    try:
        asyncio.run(open_loop(service.url, 50, plan.sigterm_after_s, lambda: (queries.text(), ""), shots))
        for _ in range(2):
            response = httpx.post(
                service.url + "/v1/admin/reload-profile", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
            )
            reloads.append(response.status_code)
        asyncio.run(open_loop(service.url, 50, plan.sigterm_after_s, lambda: (queries.text(), ""), shots))
    finally:
        service.stop()
    after = digests()
    return {
        "scenario": "gallery-bytes",
        "files": len(before),
        "requests": len(shots),
        "failed": sum(s.status != 200 for s in shots),
        "reloads": reloads,
        "identical": before == after,
    }


SCENARIOS: dict[str, Callable[[Path, Plan, Path], dict[str, Any]]] = {
    "redis-kill": redis_kill,
    "redis-pause": redis_pause,
    "burst": burst,
    "encoder-faults": encoder_faults,
    "sigterm": sigterm,
    "gallery-bytes": gallery_bytes,
}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the chosen scenarios; print and return one result each."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=Path, default=None, help="world folder (built when empty)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--short", action="store_true", help="seconds per scenario (the make test version)")
    parser.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--real", type=Path, default=None, help="burst on demo --real's upgrade in this folder")
    args = parser.parse_args(argv)
    plan = SHORT if args.short else LONG
    scenarios = dict(SCENARIOS)
    if args.real is not None:
        if args.scenarios != "burst":
            parser.error("--real runs the burst scenario only: add --scenarios burst")
        if not (args.real / "profile" / "profile.json").exists():
            parser.error(f"--real {args.real}: no profile there (nobackfill demo --real --prepare-only builds it)")
        world = args.real
        scenarios["burst"] = partial(burst, real=args.real)
    else:
        world = build_world(args.world or ROOT / "artifacts" / ("chaos-short" if args.short else "chaos"), plan)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.scenarios.split(","):
        started = time.monotonic()
        result = scenarios[name](world, plan, args.out)
        result["seconds"] = round(time.monotonic() - started, 1)
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
