"""The background sink: offer never blocks, batches by size or interval, fails open, and close is bounded.

Nothing here races a clock: a test waits for an Event its flush sets, or polls a condition.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest

from service.sink import BackgroundSink, Closed, Periodic

WAIT_S = 10.0  # how long a test waits for a condition before failing: never reached when the sink works


def wait_until(condition: Callable[[], bool]) -> bool:
    """True once `condition` holds (polled), False after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class Recorder:
    """A flush that records its batches and sets `flushed`; raises while `failing`, hangs while `hold` is clear."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.flushed = threading.Event()
        self.entered = threading.Event()
        self.hold = threading.Event()
        self.hold.set()
        self.failing = False
        self.dropped = 0
        self.failed = 0

    def __call__(self, batch: list[int]) -> None:
        self.entered.set()
        self.hold.wait()
        if self.failing:
            raise OSError("the store is down")
        self.batches.append(batch)
        self.flushed.set()

    def drop(self, units: int) -> None:
        self.dropped += units

    def fail(self, units: int) -> None:
        self.failed += units


def sink_for(recorder: Recorder, **knobs: object) -> BackgroundSink[int]:
    settings: dict[str, object] = {"capacity": 100, "batch_size": 1_000, "interval_s": 3600.0, **knobs}
    return BackgroundSink(
        recorder,
        thread_name="test-sink",
        label="test sink",
        on_drop=recorder.drop,
        on_failure=recorder.fail,
        **settings,  # type: ignore[arg-type]
    )


def test_a_full_buffer_drops_and_counts_without_blocking() -> None:
    recorder = Recorder()
    sink = sink_for(recorder, capacity=2)
    assert [sink.offer(i) for i in range(5)] == [True, True, False, False, False]
    assert recorder.dropped == 3 and sink.pending == 2
    assert sink.close() == Closed(dropped=0, in_flight=0)
    assert recorder.batches == [[0, 1]]  # close wrote what waited
    assert sink.offer(9) is False and recorder.dropped == 4  # closed: dropped, counted


def test_a_batch_goes_once_batch_size_units_wait() -> None:
    recorder = Recorder()
    sink = sink_for(recorder, batch_size=3)
    for i in range(4):
        sink.offer(i)
    assert recorder.flushed.wait(WAIT_S)
    assert recorder.batches[0] == [0, 1, 2]  # the oldest, up to batch_size; the interval (an hour) is far off
    assert wait_until(lambda: sink.pending == 1)
    sink.close()


def test_units_count_towards_the_batch_size() -> None:
    recorder = Recorder()
    sink = sink_for(recorder, batch_size=10, size_of=lambda item: item)
    sink.offer(4)
    sink.offer(6)
    assert recorder.flushed.wait(WAIT_S) and recorder.batches[0] == [4, 6]
    sink.close()


def test_a_batch_goes_once_the_interval_has_passed() -> None:
    recorder = Recorder()
    sink = sink_for(recorder, interval_s=0.05)
    sink.offer(7)  # one item, far below the batch size: only the interval can send it
    assert recorder.flushed.wait(WAIT_S)
    assert recorder.batches == [[7]] and wait_until(lambda: sink.pending == 0)
    sink.close()


def test_a_failing_flush_is_counted_logged_once_and_the_sink_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    recorder = Recorder()
    recorder.failing = True
    sink = sink_for(recorder)
    with caplog.at_level(logging.WARNING, logger="nobackfill"):
        for i in range(3):
            sink.offer(i)
            assert sink.flush()
    assert recorder.failed == 3 and sink.pending == 0  # dropped, counted as failed
    lines = [r.getMessage() for r in caplog.records if "test sink: writing" in r.getMessage()]
    assert lines == ["test sink: writing 1 items failed (OSError: the store is down); dropped"]  # throttled
    recorder.failing = False
    sink.offer(42)
    assert sink.flush() and recorder.batches == [[42]]  # still alive
    sink.close()


def test_a_kept_batch_is_tried_again_after_retry_s() -> None:
    recorder = Recorder()
    recorder.failing = True
    sink = sink_for(recorder, retry_s=0.05)
    sink.offer(1)
    sink.offer(2)
    assert sink.flush()
    assert recorder.failed == 2 and sink.pending == 2  # kept, first in line
    recorder.failing = False
    sink.offer(3)
    assert sink.flush()
    assert recorder.batches == [[1, 2, 3]]
    recorder.failing = True
    sink.offer(4)
    assert sink.flush() and sink.pending == 1
    recorder.failing = False  # now only the retry clock can send it
    assert wait_until(lambda: sink.pending == 0) and recorder.batches[-1] == [4]
    sink.close()


def test_close_returns_with_a_hung_flush_and_reports_what_it_drops() -> None:
    recorder = Recorder()
    recorder.hold.clear()  # the flush hangs until the test lets it go
    sink = sink_for(recorder, batch_size=1)
    sink.offer(1)
    assert recorder.entered.wait(WAIT_S)  # 1 is in flight, stuck
    sink.offer(2)
    sink.offer(3)
    closer = threading.Thread(target=lambda: setattr(closer, "result", sink.close(timeout_s=0.05)))
    closer.start()
    closer.join(WAIT_S)
    assert not closer.is_alive()  # close returned although the flush never did
    assert closer.result == Closed(dropped=2, in_flight=1)  # type: ignore[attr-defined]
    assert recorder.dropped == 2 and sink.pending == 1
    recorder.hold.set()  # the flush returns late: its item is written, 2 and 3 are not (dropped above)
    assert recorder.flushed.wait(WAIT_S) and wait_until(lambda: sink.pending == 0)
    assert recorder.batches == [[1]]
    assert sink.close() == Closed(dropped=2, in_flight=1)  # a second close repeats the first's answer


def test_close_with_a_full_buffer_and_a_hung_flush_returns() -> None:
    recorder = Recorder()
    recorder.hold.clear()
    sink = sink_for(recorder, capacity=3, batch_size=1)
    sink.offer(0)
    assert recorder.entered.wait(WAIT_S)
    assert [sink.offer(i) for i in range(1, 5)] == [True, True, False, False]  # full: 1 in flight + 2 waiting
    assert sink.close(timeout_s=0.05) == Closed(dropped=2, in_flight=1)
    assert recorder.dropped == 4
    recorder.hold.set()


def test_the_periodic_job_runs_on_its_clock_and_survives_failures() -> None:
    runs: list[int] = []
    ran_twice = threading.Event()

    def job() -> None:
        runs.append(1)
        if len(runs) >= 2:
            ran_twice.set()
        raise OSError("down")  # logged, and the job runs again next period

    sink = BackgroundSink[int](
        lambda _batch: None,
        thread_name="test-sink",
        label="test sink",
        capacity=10,
        batch_size=10,
        interval_s=3600.0,
        periodic=Periodic(0.01, "age", job),
    )
    assert ran_twice.wait(WAIT_S)
    sink.close()
