"""Encoders in the service's process or in child processes of their own: what the GIL costs a real model.

    python loadtest/bench_isolation.py [--model artifacts/real/models/all-MiniLM-L6-v2] [--batch-size 4]

Every case runs the service's own encoder code (backend sentence-transformers, one torch thread per
copy) on the real test queries, in batches of --batch-size, each case in turn per round so machine
noise hits them alike:
    alone              one copy in this process, nothing beside it
    2 copies: threads  two copies in this process, each on its own thread (isolation: thread, replicas 2)
    2 copies: procs    two copies in child processes (isolation: process, replicas 2), one thread each
                       calling its copy, as the batcher's worker threads do
    + neighbour: ...   one copy (in this process / in a child) beside a thread that runs pure Python
                       --neighbour-ms of every 10 ms, as the event loop does under load
texts/s over every round; the ratios read against `alone` (copies) or against each other (neighbour).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench_encoder import read_texts

from service.encoders.base import Encoder
from service.encoders.process import ProcessEncoder
from service.encoders.registry import create_encoder
from service.settings import EncoderSettings

PERIOD_S = 0.010


def neighbour(stop: threading.Event, busy_s: float) -> None:
    """Hold the GIL with pure Python for busy_s of every PERIOD_S until stopped (an event loop's share)."""
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < busy_s:
            sum(range(200))
        time.sleep(PERIOD_S - busy_s)


def run_copies(copies: list[Encoder], texts: list[str], batch: int, batches: int, busy_s: float = 0.0) -> float:
    """Texts/s of `copies` each encoding `batches` batches on its own thread at once (optionally beside a neighbour)."""
    stop = threading.Event()
    side = threading.Thread(target=neighbour, args=(stop, busy_s)) if busy_s else None
    if side is not None:
        side.start()
        time.sleep(0.1)

    def work(encoder: Encoder, offset: int) -> None:
        for i in range(batches):
            start = (offset + i * batch) % (len(texts) - batch)
            encoder.encode(texts[start : start + batch], "text")

    threads = [threading.Thread(target=work, args=(c, 997 * k)) for k, c in enumerate(copies)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    stop.set()
    if side is not None:
        side.join()
    return len(copies) * batches * batch / elapsed


def main() -> None:
    """Build the copies, run every case per round, print texts/s and the ratios."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("artifacts/real/models/all-MiniLM-L6-v2"))
    parser.add_argument(
        "--queries", default="artifacts/real/corpus/test.jsonl", help="JSONL or text files, comma separated"
    )
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--batches", type=int, default=40, help="batches per copy per case per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--neighbour-ms", type=float, default=2.0, help="pure-Python ms of every 10 ms")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    settings = EncoderSettings(backend="sentence-transformers", path=str(args.model), device="cpu", threads=1)
    texts = read_texts(args.queries)
    local = [create_encoder(settings, "new") for _ in range(2)]
    children = [ProcessEncoder(settings, "new") for _ in range(2)]
    busy = args.neighbour_ms / 1000
    cases: dict[str, Callable[[], float]] = {
        "alone": lambda: run_copies(local[:1], texts, args.batch_size, args.batches),
        "2 copies: threads": lambda: run_copies(local, texts, args.batch_size, args.batches),
        "2 copies: procs": lambda: run_copies(children, texts, args.batch_size, args.batches),
        "+ neighbour: thread": lambda: run_copies(local[:1], texts, args.batch_size, args.batches, busy),
        "+ neighbour: proc": lambda: run_copies(children[:1], texts, args.batch_size, args.batches, busy),
    }
    try:
        for encoder in [*local, *children]:
            encoder.warmup()
        rates: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, case in cases.items():
                rates[name].append(case())
    finally:
        for child in children:
            child.close()
    mean = {name: sum(values) / len(values) for name, values in rates.items()}
    print(
        f"{args.model.name}, batches of {args.batch_size}, 1 torch thread per copy, "
        f"{args.rounds} rounds, {os.cpu_count()} CPUs"
    )
    for name, values in rates.items():
        print(f"  {name:20s} {mean[name]:7.1f} texts/s   rounds: {', '.join(f'{v:.1f}' for v in values)}")
    print(
        f"  two copies / alone: threads {mean['2 copies: threads'] / mean['alone']:.2f}x, "
        f"processes {mean['2 copies: procs'] / mean['alone']:.2f}x"
    )
    print(
        f"  beside a {args.neighbour_ms:g}-in-10 ms Python neighbour: in a process / in this one "
        f"{mean['+ neighbour: proc'] / mean['+ neighbour: thread']:.2f}x"
    )
    if args.json:
        args.json.write_text(json.dumps({"texts_per_s": mean, "rounds": rates}, indent=2))


if __name__ == "__main__":
    main()
