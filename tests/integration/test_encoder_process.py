"""Encoders in child processes (`isolation: process`): same rows, failures that stay contained, no orphans.

The child runs the configured backend itself (`python -m service.encoders.process`); these tests use
the synthetic models (real torch, deterministic) so each child starts in a second or two.  The real
MiniLM runs in a child in tests/system/test_real_serving_text.py, where `auto` puts it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from service import metrics
from service.encoders.batcher import MicroBatcher
from service.encoders.process import ProcessEncoder, isolation_of
from service.encoders.registry import create_encoder
from service.errors import ArtifactError, EncoderFailed, EncoderProcessExited, EncoderTimeout, InputError
from service.pipeline import Pipeline
from service.settings import EncoderSettings, Settings
from tests.support.app import Running, serving
from tests.support.faulty_encoder import plugin_path
from tests.support.servers import encoder_children
from tests.support.world import World, isolated_settings

TEXTS = ["item-0000000007 caption-1", "item-0000000042 caption-2", "item-0000001234 caption-3"]
# The tests below wait for what they need to see, never a guessed delay.  This bound only stops a test
# that would otherwise hang; a busy box's slowest start is far below it, and a passing wait ends early.
HANG_GUARD_S = 120.0


def wait_until_gone(pids: set[int], timeout_s: float = HANG_GUARD_S) -> set[int]:
    """The pids of `pids` still running once they are all gone, or after timeout_s (then the test fails)."""
    deadline = time.monotonic() + timeout_s
    while (left := pids & encoder_children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait for `condition` to hold (HANG_GUARD_S at most: past it the test fails, naming `what`)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"still waiting for {what} after {HANG_GUARD_S:g} s")
        await asyncio.sleep(0.02)


def bytes_read(pid: int) -> int:
    """What a process has read so far (its read_chars): an idle encoder child reads nothing but its next call."""
    return int(psutil.Process(pid).io_counters().read_chars)


def settings_for(world: World, isolation: str) -> Settings:
    """The synthetic world served with both encoders under `isolation`, no cache."""
    return isolated_settings(world, isolation)


@pytest.fixture(scope="module")
def child() -> Iterator[ProcessEncoder]:
    """One synthetic-new encoder in a child process, shared by the tests that only read from it."""
    encoder = ProcessEncoder(EncoderSettings(backend="synthetic-new", device="cpu"), "new")
    yield encoder
    encoder.close()


def test_the_child_returns_the_rows_and_facts_of_the_same_encoder_in_process(child: ProcessEncoder) -> None:
    local = create_encoder(EncoderSettings(backend="synthetic-new", device="cpu"), "new")
    rows = child.encode(TEXTS)
    assert rows.dtype == np.float32 and rows.shape == (3, local.dim)
    np.testing.assert_array_equal(rows, local.encode(TEXTS))
    assert (child.dim, child.model_id, child.device) == (local.dim, local.model_id, local.device)
    assert child.pid is not None and child.pid != os.getpid()


def test_ctrl_c_or_sigterm_to_the_process_group_leaves_the_child_to_its_parent(child: ProcessEncoder) -> None:
    # The parent drains its requests first and then stops its children; they must not die under it.
    # No delay to guess: a child that acted on a signal would be dead by the time it answered (the call
    # would fail), or before the call (it would be replaced: another pid).
    pid = child.pid
    assert pid is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        os.kill(pid, sig)
    assert child.encode(TEXTS[:1]).shape == (1, child.dim)
    assert child.pid == pid


def test_a_child_killed_between_calls_is_replaced_before_the_next_call() -> None:
    encoder = ProcessEncoder(EncoderSettings(backend="synthetic-old", device="cpu"), "old")
    try:
        before = encoder.encode(TEXTS)
        first_pid = encoder.pid
        assert first_pid is not None
        os.kill(first_pid, signal.SIGKILL)
        # Dead and reapable, not only dying: a zombie leader whose other threads still exit is not yet.
        while os.waitid(os.P_PID, first_pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            time.sleep(0.01)
        np.testing.assert_array_equal(encoder.encode(TEXTS), before)  # no call of its was in flight: none fails
        assert encoder.pid not in (None, first_pid)
    finally:
        encoder.close()
    assert encoder.pid is None
    with pytest.raises(EncoderProcessExited, match="stopped"):
        encoder.encode(TEXTS)


def test_a_child_that_cannot_build_its_encoder_refuses_with_the_childs_message(tmp_path: Path) -> None:
    missing = tmp_path / "no-model-here"
    before = encoder_children()
    with pytest.raises(InputError, match=f"model folder {missing} does not exist"):
        ProcessEncoder(EncoderSettings(backend="sentence-transformers", path=str(missing)), "old")
    assert encoder_children() == before


@pytest.fixture
def hang_load_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Encoder children find backend `faulty-hang-load` (tests/support/faulty_encoder.py), loading FAULTY_LOAD_S."""
    monkeypatch.setenv("PYTHONPATH", plugin_path(tmp_path / "plugin"))
    # Far longer than any deadline below: were a hung load waited for, the test would see it load instead.
    monkeypatch.setenv("FAULTY_LOAD_S", "60")


@pytest.mark.usefixtures("hang_load_plugin")
def test_a_child_that_hangs_while_loading_is_killed_at_the_load_deadline() -> None:
    before = encoder_children()
    hung = EncoderSettings(backend="faulty-hang-load", device="cpu", load_timeout_s=1.0)
    with pytest.raises(EncoderFailed, match=r"within 1 s \(NOBACKFILL_NEW__LOAD_TIMEOUT_S\); it was killed"):
        ProcessEncoder(hung, "new")
    assert encoder_children() == before  # killed and reaped: not even a zombie is left


@pytest.mark.usefixtures("hang_load_plugin")
async def test_a_start_that_hangs_while_loading_fails_in_one_line_and_leaves_no_child(world: World) -> None:
    settings = settings_for(world, "thread")
    settings.new = EncoderSettings(backend="faulty-hang-load", device="cpu", isolation="process", load_timeout_s=1.0)
    before = encoder_children()
    with pytest.raises(EncoderFailed) as refused:
        await Pipeline.build(settings)
    assert refused.value.message == (
        "new encoder (NOBACKFILL_NEW__BACKEND=faulty-hang-load): the encoder process did not load the model "
        "within 1 s (NOBACKFILL_NEW__LOAD_TIMEOUT_S); it was killed"
    )
    assert encoder_children() == before


@pytest.mark.usefixtures("hang_load_plugin")
async def test_an_interrupt_while_the_child_is_replaced_keeps_the_timed_out_batch_off_the_new_child(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FAULTY_LOAD_S", "0")
    monkeypatch.setenv("FAULTY_HANG_S", "3600")  # a batch marked !hang never returns in the child
    encoder = ProcessEncoder(EncoderSettings(backend="faulty-hang-load", device="cpu"), "new")
    # Long enough for a warm child's call on a busy box: only the call held up by the gated load times out.
    batcher = MicroBatcher([encoder], max_batch_size=8, max_wait_ms=0, name="new", timeout_s=3.0)
    await batcher.start()
    try:
        expected = await batcher.encode(TEXTS)
        before, dead_pid = restarts("new"), encoder.pid
        assert dead_pid is not None
        load_may_end = tmp_path / "load-may-end"
        monkeypatch.setenv("FAULTY_LOAD_GATE", str(load_may_end))  # the replacement loads until the test says
        os.kill(dead_pid, signal.SIGKILL)
        while os.waitid(os.P_PID, dead_pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            await asyncio.sleep(0.01)
        # The call finds its child dead and waits for a new one; the batcher gives up and interrupts it
        # while no child is there to kill.  Sent to the new child, the batch would hang it for good.
        with pytest.raises(EncoderTimeout):
            await batcher.encode([f"!hang {TEXTS[0]}"])
        assert batcher.problem() is not None  # the replica is stuck in that call until the new child is ready
        load_may_end.touch()
        await until(
            lambda: batcher.problem() is None,
            "the replica to be free (stuck: the timed-out batch ran on the new child?)",
        )
        np.testing.assert_array_equal(await batcher.encode(TEXTS), expected)
        assert encoder.pid not in (None, dead_pid) and restarts("new") == before + 1
    finally:
        encoder.interrupt()  # were the batch running on the new child, this ends it so the test can stop
        await batcher.stop()
        encoder.close()


@pytest.mark.usefixtures("hang_load_plugin")
async def test_readiness_is_refused_while_the_only_child_loads_its_replacement(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # /readyz used to say 200 here: the next request then spent its whole deadline on the model's load.
    monkeypatch.setenv("FAULTY_LOAD_S", "0")
    encoder = ProcessEncoder(EncoderSettings(backend="faulty-hang-load", device="cpu"), "new")
    batcher = MicroBatcher([encoder], max_batch_size=8, max_wait_ms=0, name="new", timeout_s=60.0)
    await batcher.start()
    try:
        expected = await batcher.encode(TEXTS)
        assert batcher.problem() is None and not encoder.replacing
        load_may_end = tmp_path / "load-may-end"
        monkeypatch.setenv("FAULTY_LOAD_GATE", str(load_may_end))  # the replacement loads until the test says
        dead_pid = encoder.pid
        assert dead_pid is not None
        os.kill(dead_pid, signal.SIGKILL)
        while os.waitid(os.P_PID, dead_pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            await asyncio.sleep(0.01)
        waiting = asyncio.create_task(batcher.encode(TEXTS))  # finds the child dead, waits for a new one
        await until(lambda: encoder.replacing, "the call to start the replacement")
        assert batcher.problem() == "every replica's encoder process is loading its replacement"
        load_may_end.touch()
        np.testing.assert_array_equal(await waiting, expected)
        assert batcher.problem() is None and not encoder.replacing and encoder.pid not in (None, dead_pid)
    finally:
        await batcher.stop()
        encoder.close()


def test_what_the_model_raises_in_the_child_is_raised_here() -> None:
    encoder = ProcessEncoder(EncoderSettings(backend="external", dim=8, model_id="clients-encode"), "old")
    try:
        with pytest.raises(InputError, match="takes precomputed embeddings"):
            encoder.encode(["some text"])
        assert encoder.pid is not None  # the child lives on: a raising model is not a dead process
    finally:
        encoder.close()


def test_auto_puts_the_built_in_model_backends_in_a_process() -> None:
    for backend, expected in (
        ("sentence-transformers", "process"),
        ("clip", "process"),
        ("synthetic-new", "thread"),
        ("external", "thread"),
        ("my-plugin", "thread"),
    ):
        assert isolation_of(EncoderSettings(backend=backend)) == expected, backend
    assert isolation_of(EncoderSettings(backend="clip", isolation="thread")) == "thread"
    assert isolation_of(EncoderSettings(backend="synthetic-new", isolation="process")) == "process"


@pytest.fixture
async def isolated(world: World) -> AsyncIterator[Running]:
    """The synthetic world served over HTTP with both encoders in child processes."""
    async with serving(settings_for(world, "process")) as running:
        yield running


async def test_served_from_child_processes_answers_as_in_process(world: World, isolated: Running) -> None:
    info = (await isolated.client.get("/v1/info")).json()
    assert info["old_model"]["isolation"] == info["new_model"]["isolation"] == "process"
    pipeline = isolated.pipeline
    assert {pipeline.old.replicas[0].pid, pipeline.new.replicas[0].pid} <= encoder_children()
    body = {"queries": [{"text": t} for t in TEXTS], "k": 10, "mode": "slerp"}
    from_children = (await isolated.client.post("/v1/search", json=body)).json()["results"]
    async with serving(settings_for(world, "thread")) as running:
        in_process = (await running.client.post("/v1/search", json=body)).json()["results"]
    assert [r["ids"] for r in from_children] == [r["ids"] for r in in_process]
    np.testing.assert_allclose(
        [r["scores"] for r in from_children], [r["scores"] for r in in_process], rtol=0, atol=1e-6
    )


def restarts(role: str) -> float:
    """nobackfill_encoder_process_restarts_total of one encoder."""
    return metrics.REGISTRY.get_sample_value("nobackfill_encoder_process_restarts_total", {"encoder": role}) or 0.0


async def ready_again(running: Running) -> None:
    """Wait until /readyz is 200 (HANG_GUARD_S at most, then the test fails): no replica stuck in a call."""
    deadline = time.monotonic() + HANG_GUARD_S
    while (await running.client.get("/readyz")).status_code != 200:
        if time.monotonic() > deadline:
            pytest.fail(f"/readyz not 200 after {HANG_GUARD_S:g} s")
        await asyncio.sleep(0.05)


async def test_a_child_dead_or_stuck_mid_call_fails_that_request_only_and_is_replaced(world: World) -> None:
    settings = settings_for(world, "process")
    settings.old.isolation = "thread"  # one child to start, not two
    # 300 ms a text: one is still running 0.1 s in, 40 (12 s) outlive the timeout.
    settings.new = EncoderSettings(
        backend="synthetic-new",
        device="cpu",
        isolation="process",
        timeout_s=6.0,
        simulated_cost_per_item_ms=300,
        max_batch_size=64,
    )
    async with serving(settings) as running:
        new = running.pipeline.new.replicas[0]
        # Killed during its call (an OOM kill, a crash): that request is a 500, the next one is served.
        before, dead_pid = restarts("new"), new.pid
        assert dead_pid is not None
        idle_reads = bytes_read(dead_pid)
        request = asyncio.create_task(running.search(queries=[{"text": TEXTS[0]}], k=5))
        # Killed once the child has read the call, so mid-call: killed before it (a guessed delay on a busy
        # box), it would die between calls and its replacement would serve the request.
        await until(lambda: bytes_read(dead_pid) > idle_reads, "the child to read its call")
        os.kill(dead_pid, signal.SIGKILL)
        failed = await request
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "encoder_failed"
        assert restarts("new") == before + 1
        # The new child loads on a thread of its own, after the call failed; its pid is set once it is ready.
        await until(lambda: new.pid not in (None, dead_pid), "the replacement child to load")
        served = await running.search(queries=[{"text": TEXTS[0]}], k=5)
        assert served.status_code == 200, served.text
        # Stuck past the timeout: a 504, and the child is killed, not left to finish its 12 s.
        stuck_pid = new.pid
        slow = await running.search(queries=[{"text": TEXTS[i % 3]} for i in range(40)], k=5)
        assert slow.status_code == 504 and slow.json()["error"]["code"] == "encoder_timeout"
        assert wait_until_gone({stuck_pid}) == set()
        # /readyz is 200 again as soon as the call is given up (no replica is stuck), while the replacement
        # still loads: a search sent then waits for the load inside its own 6 s, which a busy box can miss.
        await until(lambda: new.pid not in (None, stuck_pid), "the replacement child to load")
        await ready_again(running)
        served = await running.search(queries=[{"text": TEXTS[0]}], k=5)
        assert served.status_code == 200, served.text
        assert new.pid not in (None, stuck_pid) and restarts("new") == before + 2


async def test_no_encoder_process_outlives_the_service_or_a_refused_start(world: World) -> None:
    before = encoder_children()
    async with serving(settings_for(world, "process")) as running:
        pids = {replica.pid for b in (running.pipeline.old, running.pipeline.new) for replica in b.replicas}
        assert len(pids) == 2 and pids <= encoder_children()
    assert wait_until_gone(pids) == set()
    # The old encoder's 768-d rows do not fit the 512-d gallery: the start is refused after both children started.
    mismatched = settings_for(world, "process")
    mismatched.old = EncoderSettings(backend="synthetic-new", device="cpu", isolation="process")
    with pytest.raises(ArtifactError, match="768-d"):
        await Pipeline.build(mismatched)
    assert wait_until_gone(encoder_children() - before) == set()
