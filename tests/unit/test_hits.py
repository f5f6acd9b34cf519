"""Hit counting in local files: bounded, decaying counts, sampled off the request path (Redis: tests/integration)."""

from __future__ import annotations

import threading
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


class HangingStore(LocalHitStore):
    """Local files whose add() hangs until `release` is set, as a store behind a dead network would."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder, capacity=100)
        self.entered = threading.Event()
        self.release = threading.Event()

    def add(self, counts: dict[int, float]) -> None:
        self.entered.set()
        self.release.wait()
        super().add(counts)


def test_close_returns_with_a_full_queue_and_a_hung_store(tmp_path: Path) -> None:
    """Regression: close() used to put its stop marker on the full queue and block for good."""
    store = HangingStore(tmp_path)
    counter = HitCounter(store, rate=1.0, queue_size=2, flush_s=0.01)
    dropped = _hits("dropped")
    counter.offer(np.array([[1, 2]]))
    assert store.entered.wait(10.0)  # the flush of [1, 2] hangs in the store
    for item in range(3, 8):
        counter.offer(np.array([[item]]))  # the queue fills; the rest is dropped
    closer = threading.Thread(target=counter.close, kwargs={"timeout_s": 0.05}, daemon=True)
    closer.start()
    closer.join(10.0)
    stuck = closer.is_alive()
    store.release.set()  # let the hung flush end either way, so no thread outlives the test
    assert not stuck, "HitCounter.close blocked on a full queue"
    # 4 over the bound (one list in flight, one waiting), then the waiting one at close; [1, 2] was in flight
    assert _hits("dropped") - dropped == 5
