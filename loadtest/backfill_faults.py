"""`kill -9` a backfill run at random moments, resume it each time, and compare with one uninterrupted run.

    .venv/bin/python loadtest/backfill_faults.py --kills 20 --items 20000       # make backfill-faults
    .venv/bin/python loadtest/backfill_faults.py --kills 3 --items 3000 --json  # the short version (tests)
    .venv/bin/python loadtest/backfill_faults.py --kills 20 --items 20000 --parts 2   # parallel parts

Builds a synthetic gallery and its item store, backfills one segment in a single run (the reference),
then backfills a second one with `nobackfill backfill run` processes killed with SIGKILL after a random
0.1-1.5 s each, every kill followed by the same command again, until a run finishes; with --parts N,
N `--part i/N` runs fill it side by side and the kills fall on any of them.  Passes when both
segments hold the same ids with byte-identical rows, and no hidden half-written shard is left.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.segment.catalog import moved_ids  # noqa: E402
from service.segment.layout import SHARDS, shard_names  # noqa: E402
from service.segment.reader import Segment  # noqa: E402

NOBACKFILL = [sys.executable, "-m", "service.cli"]
SHARD_SIZE = 256


def _cli(*args: str | Path) -> None:
    """Run one nobackfill command to completion; raise with its output when it fails."""
    done = subprocess.run([*NOBACKFILL, *map(str, args)], capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"nobackfill {' '.join(map(str, args))} exited {done.returncode}: {done.stderr[-2000:]}")


def _content(segment: Path) -> dict[int, bytes]:
    """id -> row bytes of everything the service would read from the segment."""
    out: dict[int, bytes] = {}
    for block in Segment.open(segment).snapshot.blocks:
        for item, row in zip(block.ids.tolist(), block.vectors(), strict=True):
            out[item] = row.tobytes()
    return out


def _published(target: Path) -> set[str]:
    """The published shards of the segment."""
    return set(shard_names(target))


def _wait_until_writing(
    target: Path, process: subprocess.Popen[bytes], before: set[str], timeout_s: float = 120.0
) -> None:
    """Until `process` has published a shard of its own (one not published `before` it started), or ends.

    A published shard stays, so a poller that a busy box starves cannot miss it (a hidden folder being
    written lasts milliseconds: waiting for one made a run finish unkilled, and the test count fewer kills).
    """
    deadline = time.monotonic() + timeout_s
    while process.poll() is None and time.monotonic() < deadline and not (_published(target) - before):
        time.sleep(0.01)


def run(work: Path, items: int, kills: int, seed: int, parts: int = 1) -> dict[str, object]:
    """The whole experiment in `work`; returns what happened.  parts > 1: the killed target is filled by
    `backfill run --part i/parts` processes side by side, the kills spread over them at random."""
    rng = random.Random(seed)
    _cli("synth", "items", "--size", items, "--out", work / "items")
    _cli("gallery", "build", "--size", items, "--out", work / "gallery", "--items", work / "items")
    common = ["--input", work / "items", "--gallery", work / "gallery", "--backend", "synthetic-new",
              "--new-model-id", "synthetic-new"]  # fmt: skip
    common += ["--order", "random", "--batch-size", "32", "--shard-size", str(SHARD_SIZE), "--json"]
    started = time.perf_counter()
    _cli("backfill", "run", "--segment", work / "reference", *common)
    reference_s = time.perf_counter() - started
    target = work / "killed"
    # Slow enough that every kill lands mid-run (the whole run takes about 10 s at this rate), and each
    # kill comes within 1.5 shards' time of the run starting to write, so some kills hit a shard half-written.
    rate = max(100, items // 10 // parts)
    shard_s = SHARD_SIZE / rate
    split = [[]] if parts == 1 else [["--part", f"{i}/{parts}"] for i in range(parts)]

    logs = {part: work / f"part-{part}.stderr" for part in range(parts)}

    def start(part: int) -> subprocess.Popen[bytes]:
        command = [*NOBACKFILL, "backfill", "run", "--segment", str(target), *map(str, common), "--rate", str(rate)]
        with logs[part].open("wb") as stderr:  # this run's alone (the next start overwrites it): why it failed
            return subprocess.Popen([*command, *split[part]], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)

    running = {part: (start(part), _published(target)) for part in range(parts)}
    killed, moved_at_kill = 0, []
    while killed < kills:
        alive = [part for part, (process, _) in running.items() if process.poll() is None]
        if not alive:
            break
        part = rng.choice(alive)
        process, before = running[part]
        # Kill mid-run, not during the imports: once this process has published a shard, then after a
        # random part of 1.5 shards' time, so some kills land while the next shard is half-written.
        _wait_until_writing(target, process, before)
        time.sleep(rng.uniform(0.0, 1.5 * shard_s))
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
            killed += 1
            moved_at_kill.append(int(len(moved_ids(target))) if (target / "segment.json").exists() else 0)
            running[part] = (start(part), _published(target))  # the same command again, resumed
    for part, (process, _) in running.items():  # each part to its end, once its runs stop being killed
        while process.wait() != 0:
            if process.returncode != -signal.SIGKILL:
                said = logs[part].read_text(encoding="utf-8", errors="replace")[-2000:]
                raise RuntimeError(f"a resumed run of part {part} exited {process.returncode}: {said}")
            process = start(part)
    reference, resumed = _content(work / "reference"), _content(target)
    leftovers = [p.name for p in (target / SHARDS).iterdir() if p.name.startswith(".")]
    same = sorted(reference) == sorted(resumed) and all(reference[i] == resumed[i] for i in reference)
    return {
        "items": items,
        "parts": parts,
        "kills": killed,
        "moved_at_each_kill": moved_at_kill,
        "shards_reference": len(list((work / "reference" / SHARDS).iterdir())),
        "shards_resumed": len([p for p in (target / SHARDS).iterdir() if not p.name.startswith(".")]),
        "hidden_leftovers": leftovers,
        "identical": bool(same and not leftovers),
        "reference_s": round(reference_s, 1),
        "ids_covered": bool(np.array_equal(moved_ids(target), np.arange(items))),
    }


def main() -> None:
    """Parse flags, run in a temporary folder, print the result; exit 1 unless identical."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", type=int, default=1, help="Fill the killed segment with this many --part runs.")
    parser.add_argument("--json", action="store_true", help="Print the result as one JSON line.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="backfill-faults-") as tmp:
        result = run(Path(tmp), args.items, args.kills, args.seed, args.parts)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    sys.exit(0 if result["identical"] and result["ids_covered"] else 1)


if __name__ == "__main__":
    main()
