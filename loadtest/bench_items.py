"""Item store lookups: a few hundred random ids from a store of N items, SQLite against a memory-mapped table.

    .venv/bin/python loadtest/bench_items.py --items 10000000 --lookup 300

Builds an item store (service/items/store.py) of N synthetic texts of ~60 bytes, then times lookups
of `--lookup` random ids, in one process, interleaved round by round with the alternative: an
offsets array and one blob file, both memory-mapped (np.searchsorted on sorted ids, then slices).
Prints the median and p99 per lookup for both, and their ratio; docs/benchmarks.md records a run.
"""

from __future__ import annotations

import argparse
import mmap
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.items.store import ItemStore, write_item_store  # noqa: E402
from service.vocabulary import Modality  # noqa: E402


def _text(i: int) -> str:
    """A text of about 60 bytes for item i."""
    return f"item {i:010d}: a caption long enough to look like a real one, {i % 97}"


def _mmap_table(folder: Path, n: int) -> tuple[np.ndarray, np.ndarray, mmap.mmap]:
    """ids, offsets and the blob of the alternative layout."""
    lengths = np.fromiter((len(_text(i).encode()) for i in range(n)), dtype=np.int64, count=n)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    with (folder / "blob").open("wb") as f:
        for start in range(0, n, 100_000):
            f.write("".join(_text(i) for i in range(start, min(n, start + 100_000))).encode())
    np.save(folder / "offsets.npy", offsets)
    with (folder / "blob").open("rb") as f:
        blob = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return np.arange(n, dtype=np.int64), np.load(folder / "offsets.npy", mmap_mode="r"), blob


def _mmap_lookup(ids: np.ndarray, offsets: np.ndarray, blob: mmap.mmap, wanted: np.ndarray) -> list[str | None]:
    """Values of `wanted` in the memory-mapped layout."""
    pos = np.searchsorted(ids, wanted)
    starts, stops = offsets[pos].tolist(), offsets[pos + 1].tolist()
    return [blob[a:b].decode() for a, b in zip(starts, stops, strict=True)]


def main() -> None:
    """Build both layouts, time interleaved lookups, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--lookup", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--dir", type=Path, default=None, help="Work folder (default: a temporary one).")
    args = parser.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench-items-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        started = time.perf_counter()
        write_item_store(work / "store", ((i, _text(i)) for i in range(args.items)), Modality.text, "bench", force=True)
        build_s = time.perf_counter() - started
        store = ItemStore.open(work / "store")
        open_s = time.perf_counter() - started - build_s
        ids, offsets, blob = _mmap_table(work, args.items)
        rng = np.random.default_rng(0)
        sqlite_s, mmap_s = [], []
        for _ in range(args.rounds):
            wanted = rng.integers(0, args.items, args.lookup)
            t0 = time.perf_counter()
            got = store.get_many(wanted)
            t1 = time.perf_counter()
            alt = _mmap_lookup(ids, offsets, blob, wanted)
            t2 = time.perf_counter()
            assert got == alt
            sqlite_s.append(t1 - t0)
            mmap_s.append(t2 - t1)
        size = (work / "store" / "items.sqlite").stat().st_size
        print(f"{args.items:,} items, {args.lookup} random ids per lookup, {args.rounds} rounds interleaved")
        print(f"store: built in {build_s:.1f} s, opened (sha256 checked) in {open_s:.1f} s, {size / 2**20:,.0f} MiB")
        for name, times in (("sqlite", sqlite_s), ("mmap", mmap_s)):
            ms = np.array(times) * 1000
            print(f"{name:7s} p50 {np.median(ms):.3f} ms  p99 {np.percentile(ms, 99):.3f} ms")
        print(f"sqlite / mmap p50 ratio: {np.median(sqlite_s) / np.median(mmap_s):.2f}")
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
