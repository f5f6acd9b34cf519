"""Measure the numbers docs/deploy.md sizes a deployment with, on real artifacts and a real Redis.

    .venv/bin/python deploy/sizing.py [--sizes 100000,300000] [--redis-items 200000] [--json OUT]

1. Gallery: `nobackfill gallery build --size N` for each N (the real CLI), then index.faiss's bytes
   against the IVF-PQ layout from gallery.json:  N x (M x nbits / 8 + 8)   codes and int64 ids
                                                + nlist x d x 4              coarse centroids
                                                + 2^nbits x d x 4            PQ codebooks
   and the same layout extrapolated to 10^7 items (nlist ~ 4 sqrt(N), as the CLI picks).
2. Serving memory: `nobackfill serve` on the largest gallery (a small fitted profile), VmRSS after
   /readyz and 100 searches, and how much of index.faiss the page cache then holds for it.
3. Redis: a private redis-server (no maxmemory), N entries written by the service's own cache
   writer (keys and float16 / float32 values exactly as served), `used_memory` before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import redis

NOBACKFILL = [sys.executable, "-m", "service.cli"]


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cli(*args: str | int | Path) -> None:
    """Run one `nobackfill` command; stop with its output when it fails."""
    done = subprocess.run([*NOBACKFILL, *map(str, args)], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"nobackfill {' '.join(map(str, args))} failed:\n{done.stdout}{done.stderr}")


def layout_bytes(n: int, d: int, nlist: int, m: int, nbits: int) -> dict[str, int]:
    """The IVF-PQ index's parts in bytes (the formula in the module docstring)."""
    return {
        "codes_and_ids": n * (m * nbits // 8 + 8),
        "centroids": nlist * d * 4,
        "pq_codebooks": (1 << nbits) * d * 4,
    }


def measure_gallery(folder: Path, n: int) -> dict[str, Any]:
    """Build an N-item synthetic gallery; its file size against the layout."""
    start = time.perf_counter()
    cli("gallery", "build", "--size", n, "--out", folder, "--force")
    seconds = time.perf_counter() - start
    meta = json.loads((folder / "gallery.json").read_text())
    size = (folder / "index.faiss").stat().st_size
    parts = layout_bytes(n, meta["d"], meta["nlist"], meta["M"], meta["nbits"])
    return {
        "n": n,
        "d": meta["d"],
        "nlist": meta["nlist"],
        "M": meta["M"],
        "nbits": meta["nbits"],
        "index_bytes": size,
        "folder_bytes": sum(f.stat().st_size for f in folder.iterdir() if f.is_file()),
        "layout_bytes": sum(parts.values()),
        "layout": parts,
        "bytes_per_item": size / n,
        "build_s": round(seconds, 1),
    }


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def measure_serving(gallery: Path, work: Path) -> dict[str, Any]:
    """RSS of `nobackfill serve` on the gallery, after /readyz and 100 searches."""
    support, profile = work / "support", work / "profile"
    cli("synth", "support", "--n", 4000, "--out", support, "--force")
    cli("fit", support, "--out", profile, "--folds", 3, "--force")
    port = free_port()
    env = {
        **os.environ,
        "NOBACKFILL_INDEX__GALLERY_DIR": str(gallery),
        "NOBACKFILL_COMPAT__PROFILE_DIR": str(profile),
        "NOBACKFILL_API__PORT": str(port),
    }
    env.pop("NOBACKFILL_CACHE__REDIS_URL", None)
    process = subprocess.Popen([*NOBACKFILL, "serve"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                sys.exit("the service did not become ready")
            time.sleep(0.2)
        ready = rss_bytes(process.pid)
        with httpx.Client(base_url=base, timeout=10) as client:
            for i in range(100):
                body = {"queries": [{"text": f"item-{i * 997:010d} caption-1"}], "k": 10}
                assert client.post("/v1/search", json=body).status_code == 200
        return {"rss_ready_bytes": ready, "rss_after_100_searches_bytes": rss_bytes(process.pid)}
    finally:
        process.terminate()
        process.wait(timeout=60)


async def write_cache(url: str, items: int, dim: int, dtype: str, model_id: str) -> None:
    """Write `items` rows through the service's cache writer, 1,000 per call as the pipeline batches them."""
    from service.cache.factory import create_cache
    from service.settings import CacheSettings

    cache = create_cache(CacheSettings(redis_url=url, dtype=dtype, socket_timeout_s=5), model_id, dim)  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    for start in range(0, items, 1000):
        rows = rng.standard_normal((min(1000, items - start), dim)).astype(np.float32)
        rows /= np.linalg.norm(rows, axis=1, keepdims=True)
        texts = [f"item-{i:010d} caption-{i % 7} {dtype}" for i in range(start, start + len(rows))]
        await cache.set_many("text", texts, rows)
    await cache.aclose()


def measure_redis(items: int, dim: int, model_id: str, work: Path) -> dict[str, Any]:
    """used_memory per cached query, float16 and float32, in a private redis-server."""
    server = shutil.which("redis-server")
    if server is None:
        sys.exit("redis-server is not installed (make redis)")
    port = free_port()
    args = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen([*args, "--dir", str(work)], stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        out: dict[str, Any] = {"items": items, "dim": dim, "model_id": model_id}
        for dtype in ("float16", "float32"):
            client.flushall()
            before = int(client.info("memory")["used_memory"])
            asyncio.run(write_cache(f"redis://127.0.0.1:{port}/0", items, dim, dtype, model_id))
            assert client.dbsize() == items, client.dbsize()
            after = int(client.info("memory")["used_memory"])
            key = client.randomkey()
            out[dtype] = {
                "bytes_per_entry": (after - before) / items,
                "value_bytes": dim * (2 if dtype == "float16" else 4),
                "key_bytes": len(key) if key else 0,
                "per_million_gib": (after - before) / items * 1e6 / 2**30,
            }
        return out
    finally:
        process.terminate()
        process.wait(timeout=30)


def main() -> None:
    """Run the three measurements and print (and optionally save) them."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100000,300000", help="gallery sizes to build, comma-separated")
    parser.add_argument("--redis-items", type=int, default=200_000)
    parser.add_argument("--json", type=Path, help="also write the results here")
    options = parser.parse_args()
    sizes = [int(s) for s in options.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="nobackfill-sizing-") as tmp:
        work = Path(tmp)
        galleries = [measure_gallery(work / f"gallery-{n}", n) for n in sizes]
        largest = galleries[-1]
        model_id = json.loads((work / f"gallery-{largest['n']}" / "gallery.json").read_text()).get(
            "old_model_id", "synthetic-old"
        )
        n7 = 10**7
        nlist7 = int(round(4 * math.sqrt(n7)))
        extrapolated = layout_bytes(n7, largest["d"], nlist7, largest["M"], largest["nbits"])
        results = {
            "galleries": galleries,
            "gallery_1e7_layout": {"nlist": nlist7, **extrapolated, "total_bytes": sum(extrapolated.values())},
            "serving": {"gallery_n": largest["n"], **measure_serving(work / f"gallery-{largest['n']}", work)},
            "redis": measure_redis(options.redis_items, largest["d"], str(model_id), work),
        }
    print(json.dumps(results, indent=2))
    if options.json:
        options.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
