"""Hit counting in local files: bounded, decaying counts, sampled off the request path (Redis: tests/integration)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from service import metrics
from service.traffic.hits import HitCounter, LocalHitStore, read_hits, read_local_hits


def _hits(event: str) -> float:
    return metrics.REGISTRY.get_sample_value("nobackfill_hits_total", {"event": event}) or 0.0


def test_local_counts_add_up_decay_and_stay_bounded(tmp_path: Path) -> None:
    store = LocalHitStore(tmp_path, capacity=3)
    store.add({1: 5.0, 2: 1.0, 3: 2.0})
    store.add({2: 4.0, 4: 0.5})  # 4 is the lowest: capped away
    ids, counts = store.read()
    assert ids.tolist() == [1, 2, 3] and counts.tolist() == [5.0, 5.0, 2.0]  # a tie goes to the smaller id
    store.age(0.5)
    ids, counts = read_local_hits(tmp_path)
    assert ids.tolist() == [1, 2, 3] and counts.tolist() == [2.5, 2.5, 1.0]
    store.age(0.4)  # 3 falls below one half
    assert read_local_hits(tmp_path)[0].tolist() == [1, 2]


def test_readers_sum_every_process_file(tmp_path: Path) -> None:
    LocalHitStore(tmp_path, capacity=10).add({7: 1.0})
    other = LocalHitStore(tmp_path, capacity=10)
    other.path = tmp_path / "hits-otherhost-1.npz"  # another worker's file
    other.add({7: 2.0, 8: 1.0})
    ids, counts = read_hits(str(tmp_path))
    assert dict(zip(ids.tolist(), counts.tolist(), strict=True)) == {7: 3.0, 8: 1.0}


def test_the_counter_samples_flushes_on_close_and_skips_padding(tmp_path: Path) -> None:
    counter = HitCounter(LocalHitStore(tmp_path, capacity=100), rate=1.0, flush_s=60.0)
    before = _hits("counted")
    counter.offer(np.array([[1, 2, -1], [2, 3, -1]]))
    counter.close()
    ids, counts = read_local_hits(tmp_path)
    assert dict(zip(ids.tolist(), counts.tolist(), strict=True)) == {1: 1.0, 2: 2.0, 3: 1.0}
    assert _hits("counted") - before == 4
