"""Search latency (p50 / p99) and recall@10 of the milvus backend against the local FAISS gallery, side by side.

For each size N (default 10^5 and 10^6): the synthetic world's old-model vectors of items 0..N-1 go
into one .npy; from it `build_gallery` makes the local FAISS IVF-PQ gallery (builder defaults: nlist
about 4 sqrt N, PQ64x8) and `build_collection` loads a Milvus collection at the same nlist, in a server
process on this machine reached over gRPC as a remote Milvus would be: a `milvus-lite server` (IVF_FLAT:
milvus-lite has no PQ index), or with `--server standalone` a real Milvus 2.3.5 (IVF_PQ m=64, the same
code size as the local gallery).  Both are then searched through the service's own GalleryBackend objects
(`Gallery`, `MilvusGallery`), one query at a time, top-10 at the same nprobe, interleaved (the order
alternates per query) so the machine's noise falls on both alike.  Queries are caption views of random
items through the old encoder (as `gallery eval`); recall@10 is the overlap with the exact top-10 by
brute force over all N true vectors.  Prints one table of ratios (milvus / faiss) per size.

    .venv/bin/python loadtest/bench_milvus.py --sizes 100000,1000000 --json loadtest/results/milvus.json
    .venv/bin/python loadtest/bench_milvus.py --sizes 100000 --server standalone

Artifacts are kept under --work and reused by a re-run (the Milvus load resumes where it stopped).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import free_port, percentiles  # noqa: E402

from service.encoders.synthetic import SyntheticOldEncoder  # noqa: E402
from service.index.build import build_gallery  # noqa: E402
from service.index.gallery import Gallery  # noqa: E402
from service.index.milvus import MilvusGallery, connect  # noqa: E402
from service.index.milvus_build import build_collection  # noqa: E402
from service.index.params import resolve  # noqa: E402
from service.index.sources import NpySource, SyntheticSource  # noqa: E402
from service.settings import IndexSettings  # noqa: E402

CHUNK = 65_536
COLLECTION = "bench"


def write_vectors(path: Path, n: int) -> None:
    """Items 0..n-1 of the synthetic world through the old encoder, into one .npy (skipped if present)."""
    if path.exists():
        return
    source = SyntheticSource(n)
    tmp = path.with_name(path.name + ".tmp.npy")
    rows = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(n, source.dim))
    for start in range(0, n, CHUNK):
        stop = min(start + CHUNK, n)
        rows[start:stop] = source.rows(np.arange(start, stop, dtype=np.int64))
    rows.flush()
    del rows
    tmp.replace(path)


def start_milvus_lite(data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A `milvus-lite server` process on a free port; (process, uri) once it answers."""
    port = free_port()
    args = [sys.executable, "-m", "milvus_lite", "server", "--data-dir", str(data_dir)]
    process = subprocess.Popen([*args, "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL)
    uri = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            connect(uri, None, 1.0).close()
            return process, uri
        except Exception:  # noqa: BLE001 (still starting: it replays its data first)
            time.sleep(0.1)
    process.kill()
    raise TimeoutError("milvus-lite did not start in 60 s")


def exact_top10(queries: np.ndarray[Any, Any], vectors: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Exact top-10 ids by inner product over all rows, chunk by chunk."""
    best_scores = np.full((len(queries), 10), -np.inf, dtype=np.float32)
    best_ids = np.zeros((len(queries), 10), dtype=np.int64)
    for start in range(0, len(vectors), CHUNK):
        block = np.asarray(vectors[start : start + CHUNK], dtype=np.float32)
        scores = np.concatenate([best_scores, queries @ block.T], axis=1)
        ids = np.concatenate(
            [best_ids, np.broadcast_to(np.arange(start, start + len(block)), (len(queries), len(block)))], axis=1
        )
        keep = np.argsort(-scores, axis=1)[:, :10]
        best_scores, best_ids = np.take_along_axis(scores, keep, 1), np.take_along_axis(ids, keep, 1)
    return best_ids


class Server:
    """The Milvus server of a run: a `milvus-lite server` process (IVF_FLAT: it has no PQ), or a real Milvus 2.3.5
    standalone (tests/support/milvus.py, the `milvus` wheel) searched through IVF_PQ m=64 like the local gallery."""

    def __init__(self, kind: str, data_dir: Path) -> None:
        self.kind = kind
        self.data_dir = data_dir
        self.index_type = "IVF_PQ" if kind == "standalone" else "IVF_FLAT"
        self.version = _version("milvus") if kind == "standalone" else _version("milvus_lite")
        self.standalone: Any = None
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> str:
        """Start it; its URI once it answers."""
        if self.kind == "lite":
            self.process, uri = start_milvus_lite(self.data_dir)
            return uri
        from tests.support.milvus import MilvusStandalone

        self.standalone = MilvusStandalone(self.data_dir)
        self.standalone.start()
        return str(self.standalone.uri)

    def stop(self) -> None:
        """Stop it (milvus-lite by SIGTERM, so it flushes; the standalone by SIGKILL: its data is in its folder)."""
        if self.standalone is not None:
            self.standalone.stop()
        if self.process is not None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def run_size(n: int, work: Path, queries: int, nprobe: int, seed: int, server_kind: str) -> dict[str, Any]:
    """Build (or reuse) both galleries of n items, time and score them side by side."""
    folder = work / f"n{n}"
    folder.mkdir(parents=True, exist_ok=True)
    npy = folder / "old.npy"
    started = time.perf_counter()
    write_vectors(npy, n)
    vectors_s = time.perf_counter() - started
    source = NpySource(npy, model_id="synthetic-old")
    params = resolve(n, source.dim)
    gallery_dir = folder / "faiss"
    faiss_build_s = 0.0
    if not (gallery_dir / "gallery.json").exists():
        started = time.perf_counter()
        build_gallery(source, gallery_dir, params, force=True)
        faiss_build_s = time.perf_counter() - started
    faiss_gallery = Gallery.load(gallery_dir, coarse="flat")
    server = Server(server_kind, folder / ("milvus" if server_kind == "lite" else f"milvus-{server_kind}"))
    uri = server.start()
    try:
        started = time.perf_counter()
        client = connect(uri, None, 1800.0)
        stats = client.get_collection_stats(COLLECTION) if client.has_collection(COLLECTION) else {}
        if int(stats.get("row_count", 0)) == n and client.list_indexes(COLLECTION):
            # A finished load from an earlier run: asking for each batch's ids again costs minutes here.
            client.load_collection(COLLECTION, timeout=1800.0)
            built = {"inserted": 0}
        else:
            built = build_collection(
                client,
                COLLECTION,
                source,
                index_type=server.index_type,
                nlist=faiss_gallery.nlist,
                log=lambda line: print(line, file=sys.stderr),
            )
        client.close()
        milvus_build_s = time.perf_counter() - started
        milvus = MilvusGallery.open(
            IndexSettings(backend="milvus", milvus_uri=uri, milvus_collection=COLLECTION, milvus_timeout_s=30.0)
        )
        rng = np.random.default_rng(seed)
        items = rng.choice(n, size=queries, replace=False)
        encoder = SyntheticOldEncoder("cpu")
        q = encoder.encode([f"item-{int(i):010d} caption-0" for i in items], "text")
        truth = exact_top10(q, np.load(npy, mmap_mode="r"))
        backends: dict[str, Any] = {"faiss": faiss_gallery, "milvus": milvus}
        for backend in backends.values():  # warm: first touches of the lists, the gRPC channel
            for row in q[:20]:
                backend.search(row[None], 10, nprobe)
        times: dict[str, list[float]] = {name: [] for name in backends}
        found: dict[str, list[np.ndarray[Any, Any]]] = {name: [] for name in backends}
        names = list(backends)
        for i, row in enumerate(q):
            for name in names if i % 2 == 0 else names[::-1]:
                t0 = time.perf_counter()
                _, ids = backends[name].search(row[None], 10, nprobe)
                times[name].append(time.perf_counter() - t0)
                found[name].append(ids[0])
        # The round trip floor: a call that does no search (client, gRPC, the server's request handling).
        floor = []
        for _ in range(100):
            t0 = time.perf_counter()
            milvus._client.get_load_state(COLLECTION)
            floor.append(time.perf_counter() - t0)
        milvus.close()
    finally:
        server.stop()
    result: dict[str, Any] = {
        "n": n,
        "dim": source.dim,
        "queries": queries,
        "nprobe": nprobe,
        "faiss_index": faiss_gallery.meta.get("factory"),
        "milvus_index": f"{server.index_type} nlist={faiss_gallery.nlist} ({server.kind} {server.version})",
        "vectors_s": vectors_s,
        "faiss_build_s": faiss_build_s,
        "milvus_build_s": milvus_build_s,
        "milvus_inserted": built["inserted"],
        "milvus_rpc_floor_p50_ms": percentiles(floor)["p50_ms"],
    }
    for name in names:
        hits = [len(set(f.tolist()) & set(t.tolist())) / 10 for f, t in zip(found[name], truth, strict=True)]
        result[name] = {**percentiles(times[name]), "recall_at_10": float(np.mean(hits))}
    result["ratio"] = {
        key: result["milvus"][key] / result["faiss"][key] if result["faiss"][key] else None
        for key in ("p50_ms", "p99_ms", "recall_at_10")
    }
    return result


def _version(module: str) -> str:
    """An installed package's version."""
    from importlib.metadata import version

    return version(module.replace("_", "-"))


def table(results: list[dict[str, Any]]) -> str:
    """One markdown table: each size's figures and milvus / faiss ratios."""
    lines = [
        "| N | index (faiss / milvus) | faiss p50 / p99 ms | milvus p50 / p99 ms | p50 ratio | p99 ratio "
        "| faiss recall@10 | milvus recall@10 | recall ratio | milvus RPC floor p50 ms |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        f, m, ratio = r["faiss"], r["milvus"], r["ratio"]
        lines.append(
            f"| {r['n']:,} | {r['faiss_index']} / {r['milvus_index']} | {f['p50_ms']:.2f} / {f['p99_ms']:.2f} "
            f"| {m['p50_ms']:.2f} / {m['p99_ms']:.2f} | {ratio['p50_ms']:.1f}x | {ratio['p99_ms']:.1f}x "
            f"| {f['recall_at_10']:.3f} | {m['recall_at_10']:.3f} | {ratio['recall_at_10']:.2f} "
            f"| {r['milvus_rpc_floor_p50_ms']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    """Parse arguments, run each size, print the table, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100000,1000000", help="comma-separated gallery sizes")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-milvus"), help="artifacts (kept, reused)")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--nprobe", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--server", choices=("lite", "standalone"), default="lite", help="milvus-lite, or a real Milvus 2.3.5"
    )
    args = parser.parse_args()
    results = []
    for n in (int(s) for s in args.sizes.split(",") if s.strip()):
        started = time.perf_counter()
        result = run_size(n, args.work, args.queries, args.nprobe, args.seed, args.server)
        result["wall_s"] = time.perf_counter() - started
        result["loadavg"] = os.getloadavg()
        results.append(result)
        print(json.dumps(result, indent=2), file=sys.stderr)
        if args.json is not None:  # after each size: a long run that dies keeps what it measured
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(table(results))


if __name__ == "__main__":
    main()
