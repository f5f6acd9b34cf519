"""Two service workers filling one segment from their cascades while `backfill run` fills it too: no row lost or twice.

Three writers (two `nobackfill serve --workers 2` processes and a throttled `backfill run`) publish
shards into one segment at the same time, with no lock between them.  Afterwards every gallery item
is in the segment exactly once as every reader sees it, with the new model's row for it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from service.encoders.synthetic import SyntheticNewEncoder, format_item
from service.segment.layout import IDS, SHARD_JSON, SHARDS, shard_names
from service.segment.reader import Segment
from tests.support.cli import cli
from tests.support.servers import metric_writer_pids, serve_process
from tests.support.world import WORLD_GALLERY_SIZE, World

CAPTION = "item-{:010d} caption-1"


def shard_writers(segment: Path) -> dict[str, set[int]]:
    """Writer name -> the pids that published shards under it."""
    found: dict[str, set[int]] = {}
    for name in shard_names(segment):
        meta = json.loads((segment / SHARDS / name / SHARD_JSON).read_text())
        found.setdefault(meta["writer"], set()).add(meta["pid"])
    return found


def test_two_workers_and_a_backfill_run_write_one_segment_without_losing_or_doubling_a_row(
    world: World, tmp_path: Path, new: SyntheticNewEncoder
) -> None:
    items, segment = tmp_path / "items", tmp_path / "segment"
    assert cli("synth", "items", "--size", WORLD_GALLERY_SIZE, "--out", items).returncode == 0
    env = {
        "NOBACKFILL_INDEX__ITEM_STORE": str(items),
        "NOBACKFILL_INDEX__SEGMENT_DIR": str(segment),
        "NOBACKFILL_INDEX__SEGMENT_REFRESH_S": "0.2",
        "NOBACKFILL_CASCADE__CANDIDATES": "30",
        "NOBACKFILL_CASCADE__ENCODE_BUDGET": "30",
        "NOBACKFILL_CASCADE__FLUSH_S": "0.2",
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics"),
    }
    with serve_process(world, "--workers", "2", env=env) as base:
        # Which worker accepts a connection is the kernel's choice, and on a busy box the second one may get
        # none until the backfill has moved every item (nothing left for it to encode): search until both
        # workers have answered (each keeps its metrics in a file named by its pid) before the backfill starts.
        sent = 0
        while len(metric_writer_pids(tmp_path / "metrics")) < 2 and sent < 400:
            body = {"queries": [{"text": CAPTION.format((sent * 104729) % WORLD_GALLERY_SIZE)}], "k": 10}
            with httpx.Client() as fresh:
                assert fresh.post(f"{base}/v1/search", json=body, timeout=30).status_code == 200
            sent += 1
        backfill = subprocess.Popen(
            [
                sys.executable, "-m", "service.cli", "backfill", "run", "--segment", segment, "--input", items,
                "--gallery", world.gallery_dir, "--backend", "synthetic-new", "--profile", world.profile_dir,
                "--order", "random", "--rate", "2500", "--shard-size", "500", "--json",
            ],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        errors: list[str] = []

        def searching() -> None:
            """Fresh connections, so both workers get traffic, until the backfill ends."""
            i = 0
            while backfill.poll() is None or i < 40:
                body = {"queries": [{"text": CAPTION.format((i * 7919) % WORLD_GALLERY_SIZE)}], "k": 10}
                with httpx.Client() as fresh:
                    response = fresh.post(f"{base}/v1/search", json=body, timeout=30)
                if response.status_code != 200:
                    errors.append(response.text)
                i += 1
                time.sleep(0.01)

        clients = [threading.Thread(target=searching) for _ in range(2)]
        for client in clients:
            client.start()
        out, err = backfill.communicate(timeout=300)
        for client in clients:
            client.join()
        assert backfill.returncode == 0, err[-2000:]
        assert not errors, errors[:3]
    # The workers published what still waited when they stopped.
    report = json.loads(out)
    writers = shard_writers(segment)
    assert len(writers.get("service-cascade", set())) == 2, writers  # both workers wrote
    assert report["moved_meanwhile"] > 0 or report["moved_before"] > 0  # the run skipped what the service moved

    snapshot = Segment.open(segment).snapshot
    searched = np.concatenate([block.ids for block in snapshot.blocks])
    assert snapshot.count == WORLD_GALLERY_SIZE  # no row lost
    assert len(searched) == len(np.unique(searched)) == WORLD_GALLERY_SIZE  # none searched twice
    on_disk = np.concatenate([np.load(segment / SHARDS / name / IDS) for name in shard_names(segment)])
    assert np.array_equal(np.unique(on_disk), np.arange(WORLD_GALLERY_SIZE))
    # Every row is the new model's row of its item, whoever wrote it.
    sample = np.random.default_rng(0).choice(WORLD_GALLERY_SIZE, 500, replace=False)
    found, rows = snapshot.rows_of(sample.astype(np.int64))
    expected = new.encode([format_item(int(i)) for i in sample], "text")
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    assert found.all()
    np.testing.assert_allclose(rows, expected, atol=1e-5)
    print(f"rows on disk {len(on_disk)}, distinct {len(np.unique(on_disk))}, writers {writers}")
