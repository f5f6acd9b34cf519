"""Locust load test for POST /v1/search, against the synthetic world or with real query texts.

Run: `locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8000` (nothing else is
required). By default queries are captions of random gallery items (`item-0000001234 caption-7`);
a chosen share repeats earlier queries so the old-embedding cache hits. Because the synthetic world
knows the ground truth, each answer is also scored: did the query's own item come back in the top 10?
That hit@10, per mode, is printed at the end and written to `--hit-report` as JSON.

`--queries-file A.jsonl,B.jsonl` sends real texts instead (a JSONL `query` field, or one text per
line): fresh queries walk the files' texts in one shuffled order (so they repeat only once all are
used), hot repeats come from the first `--hot-set` of that order. A JSONL row's `target_id`, when
present, is the gallery id that scores hit@10 (the real corpus's gallery ids are its corpus ids).

`--user-rate R` makes each user an independent Poisson source of R requests per second: it sends on
its own random schedule (exponential gaps, a random first send), not when the last answer came back.
U users offer U x R requests per second in Poisson arrivals, as open-loop clients would, as long as a
user's answer usually comes back before its next send (a late user sends at once to catch up): keep
R well under 1 / p99 (many users, each slow). Locust's constant_throughput is not used: users started
together stay in step with it and arrive in bursts of U. 0 (the default) is a closed loop, each user
sending its next request when the last returns.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import gevent
from locust import events, task
from locust.contrib.fasthttp import FastHttpUser

K = 10
CAPTION_VARIANTS = 1_000_000  # fresh queries pick a caption index from here, so they rarely repeat


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any) -> None:
    """Knobs of the query mix; every one has a default."""
    parser.add_argument("--repeat-ratio", type=float, default=0.8, help="share of queries repeating a hot one")
    parser.add_argument("--hot-set", type=int, default=2000, help="distinct queries that repeat")
    parser.add_argument("--batch-mix", default="1:0.9,8:0.1", help="batch size:weight, comma separated")
    parser.add_argument(
        "--mode-mix", default="slerp:0.7,aligned:0.1,old:0.1,compare:0.1", help="mode:weight, comma separated"
    )
    parser.add_argument("--gallery-size", type=int, default=0, help="items in the gallery (0: ask /v1/info)")
    parser.add_argument("--hit-report", default="loadtest/results/hit_at_10.json", help="where to write hit@10")
    parser.add_argument("--think-time", type=float, default=0.0, help="max seconds a user waits between requests")
    parser.add_argument("--user-rate", type=float, default=0.0, help="requests/s per user (0: closed loop)")
    parser.add_argument("--queries-file", default="", help="real query texts: JSONL or text files, comma separated")


def parse_mix(text: str) -> tuple[list[str], list[float]]:
    """'a:0.7,b:0.3' -> (['a', 'b'], [0.7, 0.3])."""
    names, weights = [], []
    for part in text.split(","):
        name, _, weight = part.partition(":")
        names.append(name.strip())
        weights.append(float(weight or 1))
    return names, weights


class HitCounter:
    """hit@10 per mode, shared by all users of this process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hits: dict[str, int] = defaultdict(int)
        self.total: dict[str, int] = defaultdict(int)

    def add(self, mode: str, hit: bool) -> None:
        """Count one answered query."""
        with self.lock:
            self.total[mode] += 1
            self.hits[mode] += int(hit)

    def report(self) -> dict[str, dict[str, float]]:
        """{mode: {queries, hits, hit@10}}."""
        with self.lock:
            return {
                mode: {"queries": n, "hits": self.hits[mode], "hit@10": self.hits[mode] / n}
                for mode, n in sorted(self.total.items())
                if n
            }


HITS = HitCounter()
GALLERY: dict[str, int] = {}


class QueryTexts:
    """Real query texts from files, walked in one shuffled order shared by all users of this process."""

    def __init__(self, spec: str) -> None:
        rows: list[tuple[int | None, str]] = []
        for name in filter(None, (part.strip() for part in spec.split(","))):
            path = Path(name)
            for line in path.read_text(encoding="utf-8").splitlines():
                if not line.strip():
                    continue
                if path.suffix == ".jsonl":
                    row = json.loads(line)
                    target = row.get("target_id")
                    rows.append((int(target) if target is not None else None, str(row["query"])))
                else:
                    rows.append((None, line))
        if not rows:
            raise ValueError(f"--queries-file {spec!r} holds no query")
        random.Random(0).shuffle(rows)
        self.rows = rows
        self.counter = itertools.count()
        self.lock = threading.Lock()

    def fresh(self) -> tuple[int | None, str]:
        """The next text of the shuffled order (cycling once every text was sent)."""
        with self.lock:
            return self.rows[next(self.counter) % len(self.rows)]

    def hot(self, rng: random.Random, hot_set: int) -> tuple[int | None, str]:
        """One of the first hot_set texts."""
        return self.rows[rng.randrange(min(hot_set, len(self.rows)))]


TEXTS: dict[str, QueryTexts] = {}


@events.test_start.add_listener
def _load_query_texts(environment: Any, **_: Any) -> None:
    """Read --queries-file once per process."""
    spec = environment.parsed_options.queries_file if environment.parsed_options else ""
    if spec:
        TEXTS["real"] = QueryTexts(spec)


@events.test_start.add_listener
def _learn_gallery_size(environment: Any, **_: Any) -> None:
    """Use --gallery-size, or ask the service how many items its gallery holds."""
    options = environment.parsed_options
    if options and options.queries_file:
        return  # real texts: no synthetic item ids to draw
    size = options.gallery_size if options else 0
    if not size:
        import urllib.request

        with urllib.request.urlopen(f"{environment.host}/v1/info", timeout=30) as response:
            size = int(json.load(response)["gallery"]["ntotal"])
    GALLERY["size"] = size


@events.test_stop.add_listener
def _write_hit_report(environment: Any, **_: Any) -> None:
    """Print hit@10 per mode and save it beside the CSVs."""
    report = HITS.report()
    print("hit@10 by mode:", json.dumps(report, indent=2))
    target = Path(environment.parsed_options.hit_report if environment.parsed_options else "hit_at_10.json")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=2))


class SearchUser(FastHttpUser):
    """One client sending caption queries in the configured mix."""

    def on_start(self) -> None:
        """Read the mix once per user."""
        options = self.environment.parsed_options
        self.repeat_ratio = options.repeat_ratio if options else 0.8
        self.hot_set = options.hot_set if options else 2000
        self.batch_sizes, self.batch_weights = parse_mix(options.batch_mix if options else "1:1")
        self.modes, self.mode_weights = parse_mix(options.mode_mix if options else "slerp:1")
        self.think_time = options.think_time if options else 0.0
        self.rate = options.user_rate if options else 0.0
        self.rng = random.Random()
        if self.rate > 0:  # a Poisson source's first send is an exponential gap away, like every later one
            self.next_send = time.monotonic() + self.rng.expovariate(self.rate)
            gevent.sleep(self.next_send - time.monotonic())
        # The compose stack sets an API key (docs/deploy.md); a bare local service has none.
        key = os.environ.get("NOBACKFILL_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def wait_time(self) -> float:
        """Seconds to pause: to the next send of this user's Poisson schedule at --user-rate, else uniform
        in [0, --think-time] (0: closed loop)."""
        if self.rate > 0:
            self.next_send += self.rng.expovariate(self.rate)
            return max(0.0, self.next_send - time.monotonic())
        return self.rng.uniform(0, self.think_time) if self.think_time else 0.0

    def next_query(self) -> tuple[int | None, str]:
        """(relevant gallery id or None, text): a hot repeat with probability repeat_ratio, else a fresh one."""
        texts = TEXTS.get("real")
        if texts is not None:
            repeat = self.rng.random() < self.repeat_ratio
            return texts.hot(self.rng, self.hot_set) if repeat else texts.fresh()
        size = GALLERY.get("size", 1)
        if self.rng.random() < self.repeat_ratio:
            hot = self.rng.randrange(min(self.hot_set, size))
            item = hot * max(size // max(self.hot_set, 1), 1) % size
            return item, f"item-{item:010d} caption-0"
        item = self.rng.randrange(size)
        return item, f"item-{item:010d} caption-{self.rng.randrange(1, CAPTION_VARIANTS)}"

    @task
    def search(self) -> None:
        """One POST /v1/search, checked for status, result count and hit@10."""
        batch = self.rng.choices(self.batch_sizes, self.batch_weights)[0]
        mode = self.rng.choices(self.modes, self.mode_weights)[0]
        picks = [self.next_query() for _ in range(int(batch))]
        body = {"queries": [{"text": text} for _, text in picks], "k": K, "mode": mode}
        with self.client.post(
            "/v1/search", json=body, headers=self.headers, name=f"/v1/search [{mode} x{batch}]", catch_response=True
        ) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            results = response.json()["results"]
            if len(results) != len(picks) or any(len(r["ids"]) != K for r in results):
                response.failure(f"expected {len(picks)} results of {K} ids")
                return
            for (item, _), result in zip(picks, results, strict=True):
                if item is not None:
                    HITS.add(mode, item in result["ids"])
            response.success()
