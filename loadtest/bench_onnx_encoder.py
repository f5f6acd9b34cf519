"""The bare new encoder on each CPU runtime, side by side: torch fp32, torch bf16, ONNX fp32, ONNX int8 (issue 50).

    python loadtest/bench_onnx_encoder.py [--model MODEL_DIR] [--texts 300] [--batch-sizes 1 8] \\
        [--threads 1] [--rounds 3] [--onnx-fp32 DIR --onnx-int8 DIR] [--json OUT.json]
    python loadtest/bench_onnx_encoder.py --quality-only --real-test artifacts/real/test \
        --pairs artifacts/real/corpus/test.jsonl --write-tests /tmp/onnx-tests --onnx-fp32 DIR --onnx-int8 DIR

Each runtime is the service's own encoder (`create_encoder` with the settings a deployment would set:
cpu_bf16, runtime onnx + onnx_dir), in this process, with the same threads and the same length-sorted
passes of cpu_forward_batch_size texts, so what differs between the rows of the table is the runtime
alone.  Batch 1 is a single query (its mean and p50 latency are printed too); larger sizes are the
micro-batcher's batches.  Every round times every runtime and batch size in turn, so the VM's drift
hits them alike; items/s is over all rounds.  The texts are docstring queries of the installed numpy
and scipy (what the real corpus's queries are made of).  Without --onnx-fp32 / --onnx-int8 the model
is exported into a temporary folder first (`nobackfill encoder export`, ~15 s each).

Also printed: each runtime's rows against torch fp32's on all the texts (cosine min / mean), since a
faster runtime whose rows moved is not the same model.

--real-test: a test folder `support build` wrote with torch float32 (the real corpus's test pairs,
--pairs the JSONL it was built from).  Each export encodes the same queries and targets; printed: R@1
and R@10 of the new model alone (queries against the re-indexed targets) and the paired difference
to torch's rows with its 95 % bootstrap interval (compat/uncertainty.py), and the rows' cosines.
--write-tests OUT copies the folder once per export with its new rows in place of torch's, for
`nobackfill eval PROFILE OUT/test-int8`: the bridge (the profile fitted on torch rows) on ONNX rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from service.encoders.base import Encoder
from service.settings import EncoderSettings


def query_texts(count: int) -> list[str]:
    """`count` docstring queries of numpy, then scipy, in file order."""
    from service.realdata.docstrings import package_docstrings

    pairs = itertools.islice(itertools.chain(package_docstrings("numpy"), package_docstrings("scipy")), count)
    return [pair.query for pair in pairs]


def runtimes(args: argparse.Namespace, exports: dict[str, Path]) -> dict[str, EncoderSettings]:
    """The four configurations, as the service's settings would name them."""
    base = {"backend": "sentence-transformers", "path": str(args.model), "device": "cpu", "threads": args.threads}
    return {
        "torch fp32": EncoderSettings.model_validate(base),
        "torch bf16": EncoderSettings.model_validate({**base, "cpu_bf16": True}),
        "onnx fp32": EncoderSettings.model_validate({**base, "runtime": "onnx", "onnx_dir": str(exports["fp32"])}),
        "onnx int8": EncoderSettings.model_validate({**base, "runtime": "onnx", "onnx_dir": str(exports["int8"])}),
    }


def exported(args: argparse.Namespace, scratch: Path) -> dict[str, Path]:
    """The fp32 and int8 exports: the ones given, else fresh ones in `scratch`."""
    from service.encoders.onnx_export import export_model

    found = {"fp32": args.onnx_fp32, "int8": args.onnx_int8}
    for precision, folder in found.items():
        if folder is None:
            folder = scratch / precision
            start = time.perf_counter()
            export_model(args.model, folder, int8=precision == "int8")
            print(f"exported {precision} to {folder} in {time.perf_counter() - start:.1f} s")
            found[precision] = folder
    return {precision: Path(folder) for precision, folder in found.items()}


def main() -> None:
    """Time each runtime at each batch size, interleaved over rounds; print items/s, ratios and row agreement."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="sentence-transformers folder (default: the packaged MiniLM)")
    parser.add_argument("--texts", type=int, default=300, help="query texts per batch size per round")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--threads", type=int, default=1, help="threads of each encoder (the service's default on 2 cores)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--onnx-fp32", type=Path, help="an existing fp32 export of --model")
    parser.add_argument("--onnx-int8", type=Path, help="an existing int8 export of --model")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--real-test", type=Path, help="a torch-built test folder: R@k of each export against it")
    parser.add_argument("--pairs", type=Path, help="--real-test: the pairs JSONL the folder was built from")
    parser.add_argument("--write-tests", type=Path, help="--real-test: write its copies with each export's rows here")
    parser.add_argument("--quality-only", action="store_true", help="--real-test alone, no timing")
    args = parser.parse_args()
    if args.real_test is not None and args.pairs is None:
        parser.error("--real-test needs --pairs (the JSONL the test folder was built from)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from service.encoders.registry import create_encoder
    from service.realdata.models import packaged_minilm

    args.model = args.model or packaged_minilm()
    texts = query_texts(args.texts)
    result: dict[str, Any] = {"model": str(args.model), "threads": args.threads}
    with tempfile.TemporaryDirectory(prefix="bench-onnx-") as scratch:
        configs = runtimes(args, exported(args, Path(scratch)))
        encoders: dict[str, Encoder] = {}
        for name, settings in configs.items():
            encoders[name] = create_encoder(settings, "new")
            encoders[name].warmup()
        if not args.quality_only:
            result |= measure(encoders, texts, args.batch_sizes, args.rounds)
            result |= {"texts": len(texts), "rounds": args.rounds}
            report(result, args.batch_sizes)
        if args.real_test is not None:
            onnx = {name: encoder for name, encoder in encoders.items() if name.startswith("onnx")}
            result["real_test"] = real_test_quality(onnx, args.real_test, args.pairs, args.write_tests)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


def measure(encoders: dict[str, Encoder], texts: list[str], sizes: list[int], rounds: int) -> dict[str, Any]:
    """items/s per runtime and batch size over interleaved rounds, batch-1 latencies, and rows against torch fp32."""
    seconds = {(name, size): 0.0 for name in encoders for size in sizes}
    single_ms: dict[str, list[float]] = {name: [] for name in encoders}
    for _ in range(rounds):
        for size in sizes:
            for name, encoder in encoders.items():
                for start in range(0, len(texts), size):
                    began = time.perf_counter()
                    encoder.encode(texts[start : start + size])
                    took = time.perf_counter() - began
                    seconds[name, size] += took
                    if size == 1:
                        single_ms[name].append(1000 * took)
    rates = {name: {str(size): rounds * len(texts) / seconds[name, size] for size in sizes} for name in encoders}
    reference = encoders["torch fp32"].encode(texts)
    agreement = {}
    for name, encoder in encoders.items():
        cosines = (encoder.encode(texts) * reference).sum(axis=1)
        agreement[name] = {"min_cosine": float(cosines.min()), "mean_cosine": float(cosines.mean())}
    latency = {
        name: {
            "mean_ms": statistics.fmean(ms),
            "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)),
        }
        for name, ms in single_ms.items()
        if ms
    }
    return {"items_per_s": rates, "single_query_ms": latency, "rows_vs_torch_fp32": agreement}


def report(result: dict[str, Any], sizes: list[int]) -> None:
    """The table: items/s per batch size, each as a ratio to torch bf16 and torch fp32, then latency and agreement."""
    rates = result["items_per_s"]
    print(
        f"bare encoder {result['model']}, {result['threads']} thread(s), {result['texts']} query texts "
        f"x {result['rounds']} rounds per batch size, interleaved"
    )
    for size in map(str, sizes):
        print(f"batch {size}:")
        for name, by_size in rates.items():
            rate = by_size[size]
            bf16, fp32 = rate / rates["torch bf16"][size], rate / rates["torch fp32"][size]
            print(f"  {name:11s} {rate:8.1f} items/s   {bf16:5.2f}x torch bf16   {fp32:5.2f}x torch fp32")
    if result["single_query_ms"]:
        print("single query (batch 1), ms: mean / p50 / p99")
        for name, ms in result["single_query_ms"].items():
            print(f"  {name:11s} {ms['mean_ms']:6.2f} / {ms['p50_ms']:6.2f} / {ms['p99_ms']:6.2f}")
    print("rows against torch fp32's, cosine min / mean")
    for name, agree in result["rows_vs_torch_fp32"].items():
        print(f"  {name:11s} {agree['min_cosine']:.5f} / {agree['mean_cosine']:.5f}")


def encode_all(encoder: Encoder, texts: Any) -> Any:
    """Every text's row, in calls of 64."""
    return np.concatenate([encoder.encode(list(texts[i : i + 64])) for i in range(0, len(texts), 64)])


def real_test_quality(
    encoders: dict[str, Encoder], test: Path, pairs_path: Path, write_to: Path | None
) -> dict[str, Any]:
    """Each encoder's R@1 / R@10 (new model alone) on the test pairs, paired against the folder's torch rows."""
    import shutil

    from service.bulk.pairs import read_pairs
    from service.compat.metrics import ranks, recall_at_k, relevance
    from service.compat.uncertainty import paired_differences
    from service.vocabulary import Modality

    pairs = read_pairs(pairs_path, Modality.text, Modality.text, skip_bad=False)
    relevant = relevance(np.load(test / "query_ids.npy"), np.load(test / "target_ids.npy"))
    torch_queries, torch_targets = np.load(test / "new_query.npy"), np.load(test / "new_target.npy")
    torch_rank = ranks(torch_queries, torch_targets, relevant)
    torch_recall = recall_at_k(torch_rank, (1, 10))
    print(f"{test}: {len(pairs.queries)} queries, new model alone; torch fp32 R@1 {torch_recall[1]:.3f}, "
          f"R@10 {torch_recall[10]:.3f}")  # fmt: skip
    found: dict[str, Any] = {"torch fp32": {"R@1": torch_recall[1], "R@10": torch_recall[10]}}
    for name, encoder in encoders.items():
        queries, targets = encode_all(encoder, pairs.queries), encode_all(encoder, pairs.targets)
        if queries.shape != torch_queries.shape or targets.shape != torch_targets.shape:
            raise SystemExit(f"{test} does not hold the rows of {pairs_path}'s pairs")
        rank = ranks(queries, targets, relevant)
        recall, diff = recall_at_k(rank, (1, 10)), paired_differences(rank, torch_rank)
        cosines = np.concatenate([(queries * torch_queries).sum(axis=1), (targets * torch_targets).sum(axis=1)])
        found[name] = {"R@1": recall[1], "R@10": recall[10], "vs_torch": diff, "min_cosine": float(cosines.min()),
                       "mean_cosine": float(cosines.mean())}  # fmt: skip
        at1, at10 = diff["recall@1"], diff["recall@10"]
        print(
            f"  {name:11s} R@1 {recall[1]:.3f} ({100 * at1['diff']:+.1f} pt [{100 * at1['low']:+.1f}, "
            f"{100 * at1['high']:+.1f}])  R@10 {recall[10]:.3f} ({100 * at10['diff']:+.1f} pt "
            f"[{100 * at10['low']:+.1f}, {100 * at10['high']:+.1f}])  rows' cosine to torch min {cosines.min():.4f} "
            f"mean {cosines.mean():.4f}"
        )
        if write_to is not None:
            copy = write_to / f"{test.name}-{name.replace(' ', '-')}"
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(test, copy)
            np.save(copy / "new_query.npy", queries)
            np.save(copy / "new_target.npy", targets)
            print(f"  wrote {copy} (nobackfill eval PROFILE {copy})")
    return found


if __name__ == "__main__":
    main()
