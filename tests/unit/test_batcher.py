"""MicroBatcher with fake encoders: coalescing, limits, modalities, errors, concurrency, shutdown.

Batches are made deterministic with a gate: the encoder blocks on its worker thread until the test
opens the gate, so everything submitted meanwhile is pending when the next batch forms.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from service import metrics
from service.encoders.base import Embeddings, Modality
from service.encoders.batcher import MicroBatcher
from service.encoders.service_rate import ServiceRate
from service.encoders.ticket import Ticket
from service.errors import EncoderFailed, EncoderTimeout, NotReady, Overloaded, PoisonInput

DIM = 8


def expected(item: str, modality: str) -> np.ndarray:
    """The fake encoders' row for one item: deterministic, depends on modality."""
    seed = int.from_bytes(hashlib.sha256(f"{modality}:{item}".encode()).digest()[:8], "little")
    row = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return row / np.linalg.norm(row)


class FakeEncoder:
    """Records every batch; optionally blocks on a gate, sleeps, or fails on items named 'boom'."""

    dim = DIM
    model_id = "fake"
    device = "cpu"

    def __init__(self, sleep_s: float = 0.0, gated: bool = False) -> None:
        self.sleep_s = sleep_s
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.entered = threading.Event()
        self.calls: list[tuple[Modality, list[str]]] = []
        self.threads: set[str] = set()
        self.spans: list[tuple[float, float]] = []

    def encode(self, batch: list[str], modality: Modality = "text") -> Embeddings:
        start = time.perf_counter()
        self.threads.add(threading.current_thread().name)
        self.calls.append((modality, list(batch)))
        self.entered.set()
        self.gate.wait(10)
        if self.sleep_s:
            time.sleep(self.sleep_s)  # releases the GIL, like torch kernels do
        if any(item == "boom" for item in batch):
            raise ValueError(f"cannot encode {batch}")
        self.spans.append((start, time.perf_counter()))
        return np.stack([expected(item, modality) for item in batch])

    def warmup(self) -> None:
        self.encode(["warmup"])


def queue_depth(batcher: MicroBatcher) -> float:
    """Items waiting in the batcher, as /metrics shows them (nobackfill_encoder_queue_depth)."""
    return metrics.REGISTRY.get_sample_value("nobackfill_encoder_queue_depth", {"encoder": batcher.name}) or 0.0


async def wait_entered(encoder: FakeEncoder) -> None:
    """Wait (without blocking the loop) until the encoder is inside a batch."""
    await asyncio.to_thread(encoder.entered.wait, 10)


async def started(encoder: FakeEncoder, max_batch_size: int = 32, max_wait_ms: float = 5.0) -> MicroBatcher:
    """A started batcher around `encoder`."""
    batcher = MicroBatcher(encoder, max_batch_size, max_wait_ms, name="test")
    await batcher.start()
    return batcher


async def behind_a_held_batch(
    batcher: MicroBatcher,
    encoder: FakeEncoder,
    calls: list[tuple[list[str], Modality]],
    return_exceptions: bool = False,
) -> list[Any]:
    """The results of a call ["first"] and then of each (items, modality) call, all of `calls` submitted while the
    gated encoder holds the first one's batch: every one of them is pending when the next batches form."""
    first = asyncio.create_task(batcher.encode(["first"], "text"))
    await wait_entered(encoder)
    tasks = [asyncio.create_task(batcher.encode(items, modality)) for items, modality in calls]
    await asyncio.sleep(0.01)
    encoder.gate.set()
    return await asyncio.gather(first, *tasks, return_exceptions=return_exceptions)


async def test_results_match_the_inputs_in_order() -> None:
    batcher = await started(FakeEncoder())
    try:
        out = await batcher.encode(["a", "b", "c"], "text")
        empty = await batcher.encode([], "text")
    finally:
        await batcher.stop()
    np.testing.assert_array_equal(out, np.stack([expected(x, "text") for x in "abc"]))
    assert out.dtype == np.float32 and empty.shape == (0, DIM)


async def test_submit_enqueues_before_the_caller_yields() -> None:
    # The pipeline submits the new-encoder call, then does its cache lookup: the items must already
    # be queued, with no task or await needed to get them there.
    encoder = FakeEncoder(gated=True)
    batcher = await started(encoder, max_batch_size=8)
    try:
        one = batcher.submit(["a", "b"], "text")
        split = batcher.submit([f"x{i}" for i in range(11)], "image")
        assert queue_depth(batcher) == 13
        encoder.gate.set()
        out_one, out_split = await one, await split
    finally:
        await batcher.stop()
    np.testing.assert_array_equal(out_one, np.stack([expected(x, "text") for x in "ab"]))
    np.testing.assert_array_equal(out_split, np.stack([expected(f"x{i}", "image") for i in range(11)]))


async def test_concurrent_calls_coalesce_into_one_batch() -> None:
    encoder = FakeEncoder(gated=True)
    batcher = await started(encoder)
    try:
        first = asyncio.create_task(batcher.encode(["first"], "text"))
        await wait_entered(encoder)  # the worker is busy with "first"
        rest = [asyncio.create_task(batcher.encode([f"q{i}"], "text")) for i in range(10)]
        await asyncio.sleep(0.01)
        assert queue_depth(batcher) == 10
        encoder.gate.set()
        results = await asyncio.gather(first, *rest)
    finally:
        await batcher.stop()
    assert [len(batch) for _, batch in encoder.calls] == [1, 10]
    for i, result in enumerate(results[1:]):
        np.testing.assert_array_equal(result[0], expected(f"q{i}", "text"))
    assert queue_depth(batcher) == 0


async def test_max_wait_gathers_calls_that_arrive_while_waiting() -> None:
    encoder = FakeEncoder()
    batcher = await started(encoder, max_wait_ms=200)
    try:

        async def late(i: int) -> Embeddings:
            await asyncio.sleep(0.01 * i)
            return await batcher.encode([f"q{i}"], "text")

        await asyncio.gather(*(late(i) for i in range(5)))
    finally:
        await batcher.stop()
    assert [len(batch) for _, batch in encoder.calls] == [5]


async def test_full_batch_does_not_wait() -> None:
    encoder = FakeEncoder()
    batcher = await started(encoder, max_batch_size=4, max_wait_ms=10_000)
    try:
        # A full batch goes at once; a 10 s wait would time this out.
        await asyncio.wait_for(batcher.encode(["a", "b", "c", "d"], "text"), 5)
    finally:
        await batcher.stop()


async def test_batches_respect_max_batch_size() -> None:
    encoder = FakeEncoder(gated=True)
    batcher = await started(encoder, max_batch_size=8)
    try:
        await behind_a_held_batch(batcher, encoder, [([f"q{i}", f"r{i}", f"s{i}"], "text") for i in range(7)])
    finally:
        await batcher.stop()
    sizes = [len(batch) for _, batch in encoder.calls]
    assert max(sizes) <= 8 and sum(sizes) == 22
    assert sizes[1:] == [6, 6, 6, 3]  # whole 3-item calls, two per batch


async def test_a_call_larger_than_max_batch_is_split_and_reassembled() -> None:
    encoder = FakeEncoder()
    batcher = await started(encoder, max_batch_size=8)
    items = [f"x{i}" for i in range(21)]
    try:
        out = await batcher.encode(items, "image")
    finally:
        await batcher.stop()
    assert [len(batch) for _, batch in encoder.calls] == [8, 8, 5]
    np.testing.assert_array_equal(out, np.stack([expected(x, "image") for x in items]))


async def test_modalities_are_batched_separately() -> None:
    encoder = FakeEncoder(gated=True)
    batcher = await started(encoder)
    mixed = [("text", "t1"), ("image", "i1"), ("text", "t2"), ("image", "i2"), ("text", "t3")]
    calls = [([item], modality) for modality, item in mixed]
    try:
        results = await behind_a_held_batch(batcher, encoder, calls)  # type: ignore[arg-type]
    finally:
        await batcher.stop()
    assert encoder.calls[1:] == [("text", ["t1", "t2", "t3"]), ("image", ["i1", "i2"])]
    for (modality, item), result in zip(mixed, results[1:], strict=True):
        np.testing.assert_array_equal(result[0], expected(item, modality))


async def test_an_encoder_error_fails_only_the_call_that_causes_it() -> None:
    encoder = FakeEncoder(gated=True)
    batcher = await started(encoder, max_batch_size=2)
    names = ["a", "boom", "c", "d"]  # batches [a, boom] (raises, then retried call by call) and [c, d]
    calls: list[tuple[list[str], Modality]] = [*(([name], "text") for name in names), (["boom-free"], "image")]
    try:
        results = await behind_a_held_batch(batcher, encoder, calls, return_exceptions=True)
        after = await batcher.encode(["later"], "text")  # the batcher keeps serving
    finally:
        await batcher.stop()
    outcomes = [isinstance(r, EncoderFailed) and isinstance(r.__cause__, ValueError) for r in results]
    assert outcomes == [False, False, True, False, False, False]
    assert [batch for _, batch in encoder.calls[1:4]] == [["a", "boom"], ["a"], ["boom"]]
    assert after.shape == (1, DIM)


async def test_a_failing_chunk_fails_the_whole_split_call() -> None:
    batcher = await started(FakeEncoder(), max_batch_size=2)
    try:
        with pytest.raises(EncoderFailed) as failed:
            await batcher.encode(["a", "b", "boom", "c"], "text")
        assert "boom" in str(failed.value.__cause__) and "boom" not in failed.value.message
    finally:
        await batcher.stop()


async def test_two_batchers_encode_concurrently() -> None:
    # Each batch sleeps 0.2 s on its encoder's own thread; in series the pair would take the sum.
    old_encoder, new_encoder = FakeEncoder(sleep_s=0.2), FakeEncoder(sleep_s=0.2)
    old = MicroBatcher(old_encoder, 32, 0.0, name="test-old")
    new = MicroBatcher(new_encoder, 32, 0.0, name="test-new")
    await old.start()
    await new.start()
    try:
        start = time.perf_counter()
        for i in range(3):
            await asyncio.gather(old.encode([f"q{i}"], "text"), new.encode([f"q{i}"], "text"))
        elapsed = time.perf_counter() - start
    finally:
        await old.stop()
        await new.stop()
    busy = sum(end - begin for begin, end in old_encoder.spans + new_encoder.spans)
    assert elapsed / busy < 0.75, f"elapsed {elapsed:.3f}s vs summed encoder time {busy:.3f}s"
    assert len(old_encoder.threads) == 1 and len(new_encoder.threads) == 1
    assert old_encoder.threads != new_encoder.threads


async def test_the_event_loop_keeps_running_during_a_batch() -> None:
    encoder = FakeEncoder(sleep_s=0.3)
    batcher = await started(encoder, max_wait_ms=0)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    try:
        await batcher.encode(["slow"], "text")
    finally:
        task.cancel()
        await batcher.stop()
    # A blocked loop would tick about once; a free one about 30 times in 0.3 s.
    assert ticks >= 10


async def test_batching_off_encodes_each_call_alone() -> None:
    encoder = FakeEncoder(gated=True)
    batcher = MicroBatcher(encoder, 32, 50.0, name="test", batching=False)
    await batcher.start()
    try:
        await behind_a_held_batch(batcher, encoder, [([f"q{i}", f"r{i}"], "text") for i in range(4)])
    finally:
        await batcher.stop()
    assert [len(batch) for _, batch in encoder.calls] == [1, 2, 2, 2, 2]


async def test_cancelled_callers_are_not_encoded() -> None:
    encoder = FakeEncoder(gated=True)
    batcher = await started(encoder)
    try:
        first = asyncio.create_task(batcher.encode(["first"], "text"))
        await wait_entered(encoder)
        gone = asyncio.create_task(batcher.encode(["gone"], "text"))
        kept = asyncio.create_task(batcher.encode(["kept"], "text"))
        await asyncio.sleep(0.01)
        gone.cancel()
        encoder.gate.set()
        await asyncio.gather(first, kept)
    finally:
        await batcher.stop()
    assert encoder.calls[1] == ("text", ["kept"])


@dataclass
class Stopping:
    """A batcher asked to stop while one call is inside its gated encoder and three more wait behind it."""

    encoder: FakeEncoder
    batcher: MicroBatcher
    calls: list[asyncio.Task[Embeddings]]  # the one inside first, then the three waiting
    stop: asyncio.Task[None]


async def stopping_with_three_pending(drain: bool) -> Stopping:
    """The stop begun (draining or not) with the gate still shut, so the waiting calls are still pending."""
    encoder = FakeEncoder(gated=True)
    batcher = await started(encoder)
    first = asyncio.create_task(batcher.encode(["first"], "text"))
    await wait_entered(encoder)
    pending = [asyncio.create_task(batcher.encode([f"q{i}"], "text")) for i in range(3)]
    await asyncio.sleep(0.01)
    stop = asyncio.create_task(batcher.stop(drain=drain))
    await asyncio.sleep(0.01)
    return Stopping(encoder, batcher, [first, *pending], stop)


async def test_stop_drains_pending_calls() -> None:
    stopping = await stopping_with_three_pending(drain=True)
    with pytest.raises(NotReady):
        await stopping.batcher.encode(["late"], "text")  # stopping: no new work
    stopping.encoder.gate.set()
    await stopping.stop
    results = await asyncio.gather(*stopping.calls)
    assert all(r.shape == (1, DIM) for r in results)
    assert stopping.batcher.problem() == "stopped"


async def test_stop_without_drain_fails_pending_calls() -> None:
    stopping = await stopping_with_three_pending(drain=False)
    stopping.encoder.gate.set()  # let the worker thread finish so the executor can join
    await stopping.stop
    results = await asyncio.gather(*stopping.calls, return_exceptions=True)
    assert all(isinstance(r, NotReady) for r in results)
    assert queue_depth(stopping.batcher) == 0


async def test_encode_before_start_is_not_ready() -> None:
    batcher = MicroBatcher(FakeEncoder(), 4, 1.0, name="test")
    with pytest.raises(NotReady):
        await batcher.encode(["a"], "text")
    await batcher.stop()  # stopping a batcher that never started is a no-op


async def test_batch_size_queue_wait_and_depth_are_recorded() -> None:
    def sample(name: str, labels: dict[str, str]) -> float:
        return metrics.REGISTRY.get_sample_value(name, labels) or 0.0

    sizes_before = sample("nobackfill_encoder_batch_size_sum", {"encoder": "metrics-test"})
    waits_before = sample("nobackfill_stage_duration_seconds_count", {"stage": "queue_wait"})
    batcher = MicroBatcher(FakeEncoder(), 32, 1.0, name="metrics-test")
    await batcher.start()
    try:
        await asyncio.gather(batcher.encode(["a", "b"], "text"), batcher.encode(["c"], "text"))
    finally:
        await batcher.stop()
    assert sample("nobackfill_encoder_batch_size_sum", {"encoder": "metrics-test"}) - sizes_before == 3
    assert sample("nobackfill_stage_duration_seconds_count", {"stage": "queue_wait"}) - waits_before == 2
    assert sample("nobackfill_encoder_queue_depth", {"encoder": "metrics-test"}) == 0
    assert sample("nobackfill_encoder_batch_duration_seconds_count", {"encoder": "metrics-test"}) >= 1


# -- replicas: copies of one model, each on its own worker thread --------------------------------


async def test_replicas_run_batches_side_by_side() -> None:
    first, second = FakeEncoder(gated=True), FakeEncoder(gated=True)
    batcher = MicroBatcher([first, second], 4, 0.0, name="test")
    await batcher.start()
    a = asyncio.ensure_future(batcher.encode(["a1", "a2"]))
    await wait_entered(first)
    b = asyncio.ensure_future(batcher.encode(["b1"]))
    await wait_entered(second)  # the second batch started while the first is still running
    c = asyncio.ensure_future(batcher.encode(["c1"]))
    d = asyncio.ensure_future(batcher.encode(["d1"]))
    await asyncio.sleep(0.05)
    assert queue_depth(batcher) == 2  # both replicas busy: c and d wait, and will share a batch
    first.gate.set()
    second.gate.set()
    rows = await asyncio.gather(a, b, c, d)
    for got, items in zip(rows, (["a1", "a2"], ["b1"], ["c1"], ["d1"]), strict=True):
        np.testing.assert_array_equal(got, np.stack([expected(i, "text") for i in items]))
    batches = sorted(items for _, items in first.calls + second.calls)
    assert batches == [["a1", "a2"], ["b1"], ["c1", "d1"]]
    assert len(first.threads | second.threads) == 2 and first.threads != second.threads
    await batcher.stop()


async def test_stop_without_drain_fails_running_and_pending_calls_on_every_replica() -> None:
    first, second = FakeEncoder(gated=True), FakeEncoder(gated=True)
    batcher = MicroBatcher([first, second], 1, 0.0, name="test")
    await batcher.start()
    calls = [asyncio.ensure_future(batcher.encode([f"x{i}"])) for i in range(3)]
    await wait_entered(first)
    await wait_entered(second)
    stopping = asyncio.ensure_future(batcher.stop(drain=False))
    await asyncio.sleep(0.05)
    first.gate.set()
    second.gate.set()
    await stopping
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(o, NotReady) for o in outcomes), outcomes
    assert batcher.problem() == "stopped"


# -- bounded waits: the split of a failed batch, the poison memory, the queue deadline ------------


class HangingEncoder(FakeEncoder):
    """A FakeEncoder on which any batch holding 'hang' sleeps hang_s first (a stuck model call)."""

    def __init__(self, hang_s: float) -> None:
        super().__init__()
        self.hang_s = hang_s

    def encode(self, batch: list[str], modality: Modality = "text") -> Embeddings:
        self.calls.append((modality, list(batch)))
        if "hang" in batch:
            time.sleep(self.hang_s)
        return np.stack([expected(item, modality) for item in batch])


def sample(name: str, labels: dict[str, str]) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


async def test_a_hung_batch_costs_only_the_input_that_hangs_alone_and_a_retry_is_refused_at_once() -> None:
    # Two copies of one model (shared call log); a batch holding 'hang' outlives the timeout.
    encoder = HangingEncoder(hang_s=0.4)  # back before the split calls expire (2 x timeout_s)
    batcher = MicroBatcher([encoder, encoder], 32, 20.0, name="split-test", timeout_s=0.2, poison_ttl_s=60)
    refusals = sample("nobackfill_poison_refusals_total", {"encoder": "split-test"})
    await batcher.start()
    try:
        clean, bad = batcher.submit(["a"]), batcher.submit(["hang"])  # queued together: one batch
        outcomes = await asyncio.gather(clean, bad, return_exceptions=True)
        with pytest.raises(PoisonInput):  # refused before it is queued: no replica is stuck again
            batcher.submit(["hang"])
        with pytest.raises(PoisonInput):  # inside another call too
            batcher.submit(["b", "hang"])
        assert (await batcher.encode(["b"])).shape == (1, DIM)  # its batch-mates are not refused
    finally:
        await batcher.stop()
    np.testing.assert_array_equal(outcomes[0], expected("a", "text")[None])
    assert isinstance(outcomes[1], EncoderTimeout)
    batches = [items for _, items in encoder.calls]
    assert batches[0] == ["a", "hang"] and sorted(batches[1:3]) == [["a"], ["hang"]] and batches[3:] == [["b"]]
    assert sample("nobackfill_poison_refusals_total", {"encoder": "split-test"}) == refusals + 2
    assert sample("nobackfill_encoder_splits_total", {"encoder": "split-test", "cause": "timeout"}) >= 1


class BlockingEncoder(FakeEncoder):
    """A FakeEncoder on which a batch holding 'hang' blocks until the test releases it (a hung model call)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def encode(self, batch: list[str], modality: Modality = "text") -> Embeddings:
        self.threads.add(threading.current_thread().name)
        if "hang" in batch:
            self.entered.set()
            self.release.wait(10)
        return np.stack([expected(item, modality) for item in batch])


@pytest.mark.parametrize("stuck_threads", [1, 0])
async def test_a_hung_call_keeps_its_thread_while_a_fresh_one_serves_the_replica(stuck_threads: int) -> None:
    # One replica: without a fresh thread, nothing is answered until the hung call returns.
    encoder = BlockingEncoder()
    batcher = MicroBatcher(encoder, 32, 1.0, name="thread-test", timeout_s=0.1, stuck_threads=stuck_threads)
    await batcher.start()
    try:
        with pytest.raises(EncoderTimeout):
            await batcher.encode(["hang"])
        clean = asyncio.ensure_future(batcher.encode(["a"]))
        done, _ = await asyncio.wait([clean], timeout=2.0)  # the hung call is still held, whatever happens
        answered_while_hung = clean in done and clean.exception() is None
        problem = batcher.problem()
    finally:
        encoder.release.set()
        await asyncio.gather(clean, return_exceptions=True)
        await batcher.stop()
    if stuck_threads:
        assert answered_while_hung and problem is None  # the replica kept serving
    else:
        assert not answered_while_hung and problem is not None and "stuck" in problem


async def test_a_slow_call_hands_its_replica_on_and_still_returns_its_rows() -> None:
    # One replica, a timeout far off: the slow call is left its thread after SLOW_FLOOR_S, the replica
    # answers the next call meanwhile, and the slow call, released in time, gets its own rows.
    encoder = BlockingEncoder()
    batcher = MicroBatcher(encoder, 32, 1.0, name="slow-test", timeout_s=30.0, stuck_threads=1)
    before = sample("nobackfill_encoder_threads_replaced_total", {"encoder": "slow-test"})
    await batcher.start()
    try:
        slow = asyncio.ensure_future(batcher.encode(["hang"]))
        await wait_entered(encoder)  # its batch holds it alone
        clean = asyncio.ensure_future(batcher.encode(["a"]))
        done, _ = await asyncio.wait([clean], timeout=5.0)
        answered_while_slow = clean in done and not slow.done()
        encoder.release.set()
        rows = await slow
    finally:
        encoder.release.set()
        await asyncio.gather(clean, return_exceptions=True)
        await batcher.stop()
    assert answered_while_slow
    np.testing.assert_array_equal(rows, expected("hang", "text")[None])
    assert len(encoder.threads) == 2  # the slow call's thread and the fresh one
    assert sample("nobackfill_encoder_threads_replaced_total", {"encoder": "slow-test"}) == before + 1


async def test_a_call_queued_past_its_deadline_is_refused_before_it_is_encoded() -> None:
    encoder = FakeEncoder(gated=True)
    batcher = await started(encoder)
    before = sample("nobackfill_admission_refusals_total", {"reason": "deadline"})
    try:
        first = asyncio.create_task(batcher.encode(["first"]))
        await wait_entered(encoder)  # the only replica is busy: what comes now queues
        late = batcher.submit(["late"], ticket=Ticket(time.perf_counter() + 0.01))
        kept = batcher.submit(["kept"], ticket=Ticket(time.perf_counter() + 60))
        await asyncio.sleep(0.05)  # past the first deadline, well before the second
        encoder.gate.set()
        outcomes = await asyncio.gather(first, late, kept, return_exceptions=True)
    finally:
        await batcher.stop()
    assert isinstance(outcomes[1], Overloaded) and outcomes[1].retry_after_s >= 1
    assert outcomes[2].shape == (1, DIM)  # type: ignore[union-attr]
    assert [items for _, items in encoder.calls] == [["first"], ["kept"]]  # "late" never reached the model
    assert sample("nobackfill_admission_refusals_total", {"reason": "deadline"}) == before + 1


async def test_the_expected_wait_counts_the_batches_ahead_at_the_measured_cost() -> None:
    encoder = FakeEncoder(gated=True)
    batcher = await started(encoder, max_batch_size=4)
    for _ in range(50):  # a cost of 10 ms + 5 ms per item
        batcher.rate.observe(1, 0.015)
        batcher.rate.observe(4, 0.030)
    try:
        assert batcher.expected_wait_s(1) == 0.0  # an idle replica takes it at once
        first = asyncio.create_task(batcher.encode(["first"]))
        await wait_entered(encoder)
        queued = [batcher.submit([f"q{i}"]) for i in range(8)]
        # 8 queued + 1: two full batches before its own, behind half a running one, on one replica.
        assert batcher.expected_wait_s(1) == pytest.approx(2.5 * 0.030)
        encoder.gate.set()
        await asyncio.gather(first, *queued)
    finally:
        await batcher.stop()


def test_the_largest_batch_within_a_time_follows_the_measured_cost() -> None:
    rate = ServiceRate()
    assert rate.largest_within(0.125, 32) == 32  # nothing measured yet: the configured size
    rate.observe(1, 0.200)
    assert rate.largest_within(0.125, 32) == 32  # one size seen, no slope: no cap (not 0 items per batch)
    for _ in range(50):  # then a cost of 14 ms + 10 ms per item (MiniLM on a CPU core)
        rate.observe(3, 0.044)
        rate.observe(10, 0.114)
    assert rate.largest_within(0.125, 32) == 11  # (125 - 14) / 10
    assert rate.largest_within(0.125, 8) == 8
    assert rate.largest_within(0.001, 32) == 2  # never below where the fixed cost is half a batch: ceil(14 / 10)
    for _ in range(2000):  # a sustained burst: every batch at the cap, the slope unseen for a long while
        rate.observe(11, 0.124)
    assert rate.largest_within(0.125, 32) == 11  # the last line fitted still speaks
    per_call = ServiceRate()
    for _ in range(50):  # a GPU: the cost is per call, not per item
        per_call.observe(1, 0.010)
        per_call.observe(32, 0.010)
    assert per_call.largest_within(0.125, 32) == 32
    busy = ServiceRate()
    for _ in range(50):  # a busy box: 150 ms a call whatever its size, 2 ms per item
        busy.observe(1, 0.152)
        busy.observe(8, 0.166)
    assert busy.largest_within(0.125, 32) == 32  # capping would split what batching amortises


async def test_a_batch_gathers_no_more_than_fits_in_its_time() -> None:
    encoder = FakeEncoder(gated=True)
    batcher = MicroBatcher(encoder, 32, 5.0, name="test", max_batch_s=0.05)
    await batcher.start()
    for _ in range(50):  # 10 ms per item: 5 items fit in 50 ms
        batcher.rate.observe(1, 0.010)
        batcher.rate.observe(4, 0.040)
    try:
        assert batcher.expected_wait_s(20) == 0.0  # one call is one chunk, taken whole by an idle replica
        first = asyncio.create_task(batcher.encode(["first"]))
        await wait_entered(encoder)
        queued = [batcher.submit([f"q{i}"]) for i in range(12)]
        assert batcher.expected_wait_s(1) == pytest.approx(0.5 * 0.05 + 2 * 0.05)  # batches of 5 ahead, not 13
        encoder.gate.set()
        await asyncio.gather(first, *queued)
    finally:
        await batcher.stop()
    sizes = [len(batch) for _, batch in encoder.calls[1:]]  # (the gated first batch, measured too, costs more)
    assert sum(sizes) == 12 and max(sizes) <= 5 and len(sizes) >= 3
