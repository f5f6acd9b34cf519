"""The expected queue wait and the batch cap (encoders/wait_estimate.py), from a given queue state."""

from __future__ import annotations

import math

import pytest

from service.encoders.wait_estimate import QueueState, WaitEstimator


def measured(max_batch_size: int = 4, **options: object) -> WaitEstimator:
    """An estimator whose cost line is 10 ms + 5 ms per item (two batch sizes seen)."""
    wait = WaitEstimator(max_batch_size, **options)  # type: ignore[arg-type]
    for _ in range(20):
        wait.rate.observe(1, 0.015)
        wait.rate.observe(4, 0.030)
    return wait


def test_no_wait_while_an_idle_replica_takes_every_batch_ahead() -> None:
    wait = measured()
    assert wait.expected_wait_s(1, QueueState(depth=0, idle=1, answering=1, back_s=None)) == 0.0


def test_the_batches_ahead_at_the_measured_cost_shared_by_the_answering_replicas() -> None:
    wait = measured()
    one = wait.expected_wait_s(1, QueueState(depth=8, idle=0, answering=1, back_s=None))
    two = wait.expected_wait_s(1, QueueState(depth=8, idle=0, answering=2, back_s=None))
    cost = wait.rate.batch_s(4)
    assert one == pytest.approx(2.5 * cost)  # two full batches ahead, the running one half done
    assert two == pytest.approx(one / 2)


def test_reserved_items_count_as_queued_ones_until_they_are_released() -> None:
    wait, state = measured(), QueueState(depth=0, idle=0, answering=1, back_s=None)
    before = wait.expected_wait_s(1, state)
    wait.reserve(8)
    assert wait.expected_wait_s(1, state) > before
    wait.unreserve(100)  # never below zero
    assert wait.reserved == 0 and wait.expected_wait_s(1, state) == before


def test_every_replica_stuck_waits_for_the_first_back_or_forever() -> None:
    wait = measured()
    assert math.isinf(wait.expected_wait_s(1, QueueState(depth=0, idle=0, answering=0, back_s=None)))
    back = wait.expected_wait_s(1, QueueState(depth=0, idle=0, answering=0, back_s=0.5))
    assert back == pytest.approx(0.5 + wait.rate.batch_s(1))


def test_a_call_larger_than_a_batch_waits_for_its_own_earlier_chunks() -> None:
    wait = measured(max_batch_size=4)
    assert wait.batches_ahead(9, size=4, depth=0) == 2  # chunks of 4, 4, 1: two start before the last
    assert wait.batches_ahead(1, size=4, depth=3) == 0  # fits beside the three queued items


def test_the_batch_cap_follows_the_measured_cost_or_is_one_without_batching() -> None:
    assert measured(max_batch_size=32).batch_limit() == 32  # no max_batch_s: the configured size
    capped = measured(max_batch_size=32, max_batch_s=0.05).batch_limit()
    assert 1 <= capped < 32 and measured().rate.batch_s(capped) <= 0.05 + 1e-9
    assert measured(batching=False).batch_limit() == 1
