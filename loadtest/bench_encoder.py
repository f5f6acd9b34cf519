"""The bare new encoder's batched throughput: `SentenceTransformer.encode` at batch size B, nothing around it.

    python loadtest/bench_encoder.py --model artifacts/real/models/all-MiniLM-L6-v2 \\
        --queries artifacts/real/corpus/test.jsonl,artifacts/real/corpus/support.jsonl \\
        --metrics loadtest/results/real-closed/metrics-final.txt [--batch-sizes 1 8] [--threads 2] [--bf16]

The reference for the served throughput (issue 10): B is the mean batch size the service's NEW
micro-batcher reached under load (`nobackfill_encoder_batch_size{encoder="new"}` in a /metrics
scrape, --metrics), measured at floor(B) and ceil(B) and interpolated (time per batch is close to
linear in B over one step); --batch-sizes adds others.  The texts are the same real queries the
load test sends, in batches cut in order, each encoded as the service encodes it: sorted by length
and run in forward passes of --forward-batch-size texts (the service's cpu_forward_batch_size).
Every batch size is timed in each round in turn, so machine noise hits them alike; texts/s is over
all rounds.  --backend-too also times the service's own sentence-transformers backend (`create_encoder`,
in process, same threads, dtype and passes) on each batch right after `encode`: what the backend adds
to or saves over the library's call.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from report import mean_batch_sizes

from service.settings import Settings


def read_texts(spec: str) -> list[str]:
    """Query texts from JSONL (`query` field) or text files, comma separated, in file order."""
    texts: list[str] = []
    for name in filter(None, (part.strip() for part in spec.split(","))):
        path = Path(name)
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                texts.append(str(json.loads(line)["query"]) if path.suffix == ".jsonl" else line)
    return texts


def main() -> None:
    """Time encode() per batch size and print texts/s (and the interpolated figure at the served B)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("artifacts/real/models/all-MiniLM-L6-v2"))
    parser.add_argument(
        "--queries", default="artifacts/real/corpus/test.jsonl,artifacts/real/corpus/support.jsonl", help="texts"
    )
    parser.add_argument("--metrics", type=Path, help="a /metrics scrape of the loaded service (gives B)")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[], help="more batch sizes to time")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    parser.add_argument(
        "--forward-batch-size",
        type=int,
        default=Settings().new.cpu_forward_batch_size,  # the service's, from the same environment
        help="texts per length-sorted forward pass, as the service's cpu_forward_batch_size (0: one pass)",
    )
    parser.add_argument("--bf16", action="store_true", help="bfloat16 weights, as the service's cpu_bf16 setting")
    parser.add_argument("--backend-too", action="store_true", help="also time the service's backend on each batch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--texts-per-round", type=int, default=256, help="texts per batch size per round")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    served = mean_batch_sizes(args.metrics.read_text()).get("new") if args.metrics else None
    sizes = sorted(set(args.batch_sizes) | ({math.floor(served), math.ceil(served)} if served else set()))
    if not sizes:
        parser.error("give --metrics or --batch-sizes")
    model = SentenceTransformer(str(args.model), device="cpu", local_files_only=True)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model.to(dtype)
    texts = read_texts(args.queries)
    model.encode(texts[:32], batch_size=32)  # warm-up: lazy init, allocator, first touches
    backend = service_backend(args) if args.backend_too else None
    seconds = dict.fromkeys(sizes, 0.0)
    backend_seconds = dict.fromkeys(sizes, 0.0)
    done = dict.fromkeys(sizes, 0)
    cursor = 0
    for _ in range(args.rounds):
        for size in sizes:
            for _ in range(max(1, args.texts_per_round // size)):
                batch = [texts[(cursor + j) % len(texts)] for j in range(size)]
                cursor += size
                start = time.perf_counter()
                model.encode(batch, batch_size=args.forward_batch_size or size)
                seconds[size] += time.perf_counter() - start
                done[size] += size
                if backend is not None:
                    start = time.perf_counter()
                    backend.encode(batch)
                    backend_seconds[size] += time.perf_counter() - start
    rates = {size: done[size] / seconds[size] for size in sizes}
    passes = f"passes of {args.forward_batch_size}" if args.forward_batch_size else "one pass per batch"
    name = str(dtype).removeprefix("torch.")
    result: dict[str, object] = {
        "threads": args.threads,
        "dtype": name,
        "forward_batch_size": args.forward_batch_size,
        "texts_per_s": {str(k): v for k, v in rates.items()},
    }
    print(f"bare encoder {args.model.name}, {name}, {args.threads} torch threads, {passes}, {args.rounds} rounds")
    for size in sizes:
        per_batch_ms = 1000 * seconds[size] * size / done[size]
        print(f"  batch {size:3d}: {rates[size]:8.1f} texts/s ({per_batch_ms:.1f} ms per batch)")
    if served:
        low, high = math.floor(served), math.ceil(served)
        per_batch = {b: seconds[b] * b / done[b] for b in (low, high)}
        t = per_batch[low] + (served - low) * (per_batch[high] - per_batch[low])
        result |= {"served_batch_size": served, "texts_per_s_at_served_batch": served / t}
        print(f"  at the served mean batch size {served:.2f}: {served / t:.1f} texts/s (interpolated)")
    if backend is not None:
        result["backend_texts_per_s"] = {str(k): done[k] / backend_seconds[k] for k in sizes}
        print("the service's backend on the same batches, each timed just after encode:")
        for size in sizes:
            rate, ratio = done[size] / backend_seconds[size], backend_seconds[size] / seconds[size]
            print(f"  batch {size:3d}: {rate:8.1f} texts/s ({ratio:.3f} of encode's time)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


def service_backend(args: argparse.Namespace) -> Any:
    """The service's sentence-transformers backend on the same model, threads, dtype and passes, in process."""
    from service.encoders.registry import create_encoder
    from service.settings import EncoderSettings

    settings = EncoderSettings(
        backend="sentence-transformers",
        path=str(args.model),
        device="cpu",
        threads=args.threads,
        cpu_bf16=args.bf16,
        cpu_forward_batch_size=args.forward_batch_size,
    )
    encoder = create_encoder(settings, "new")
    encoder.warmup()
    return encoder


if __name__ == "__main__":
    main()
