"""PoisonMemory and ServiceRate: what the batcher remembers of hung inputs, and what it learns of its cost."""

from __future__ import annotations

import time

import pytest

from service.encoders.poison import PoisonMemory
from service.encoders.service_rate import ServiceRate


def test_a_remembered_input_is_held_alone_or_inside_a_chunk_for_its_modality_only() -> None:
    memory = PoisonMemory(ttl_s=60, capacity=10)
    memory.remember("text", ["bad"])
    assert memory.holds("text", ["bad"]) and memory.holds("text", ["ok", "bad"])
    assert not memory.holds("image", ["bad"]) and not memory.holds("text", ["ok"])


def test_a_chunk_that_hung_is_held_as_a_whole_not_input_by_input() -> None:
    memory = PoisonMemory(ttl_s=60, capacity=10)
    memory.remember("text", ["a", "b"])
    assert memory.holds("text", ["a", "b"]) and not memory.holds("text", ["a"])


def test_the_memory_is_bounded_and_forgets_the_oldest_first() -> None:
    memory = PoisonMemory(ttl_s=60, capacity=3)
    for i in range(5):
        memory.remember("text", [f"x{i}"])
    assert len(memory) == 3
    assert [memory.holds("text", [f"x{i}"]) for i in range(5)] == [False, False, True, True, True]


def test_an_input_is_forgotten_after_the_ttl_and_never_held_with_ttl_zero() -> None:
    memory = PoisonMemory(ttl_s=0.05, capacity=10)
    memory.remember("text", ["bad"])
    time.sleep(0.1)
    assert not memory.holds("text", ["bad"]) and len(memory) == 0
    off = PoisonMemory(ttl_s=0, capacity=10)
    off.remember("text", ["bad"])
    assert not off.holds("text", ["bad"])


def test_the_service_rate_fits_base_plus_per_item_and_follows_a_change() -> None:
    rate = ServiceRate()
    assert rate.batch_s(4) == 0.0  # nothing measured: admit
    for _ in range(100):
        rate.observe(1, 0.025)
        rate.observe(4, 0.040)
    assert rate.batch_s(4) == pytest.approx(0.040) and rate.batch_s(2) == pytest.approx(0.030)
    for _ in range(1000):  # the model got twice as slow
        rate.observe(1, 0.050)
        rate.observe(4, 0.080)
    assert rate.batch_s(4) == pytest.approx(0.080, rel=1e-3)


def test_one_batch_size_only_is_taken_as_a_cost_per_item() -> None:
    rate = ServiceRate()
    for _ in range(10):
        rate.observe(1, 0.025)
    assert rate.batch_s(4) == pytest.approx(0.100)
