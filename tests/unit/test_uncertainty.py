"""Paired bootstrap intervals, retention and the three-valued verdict (service/compat/uncertainty.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from service.compat.uncertainty import (
    METRICS,
    describe,
    few_queries_line,
    paired_differences,
    per_query,
    retention,
    verdict,
)


def test_per_query_values_follow_the_rank() -> None:
    values = per_query(np.array([0, 4, 9, 10, 600]))
    assert values["recall@1"].tolist() == [1, 0, 0, 0, 0]
    assert values["recall@5"].tolist() == [1, 1, 0, 0, 0]
    assert values["recall@10"].tolist() == [1, 1, 1, 0, 0]
    assert values["mrr@10"].tolist() == pytest.approx([1, 1 / 5, 1 / 10, 0, 0])
    assert values["ndcg@10"].tolist() == pytest.approx([1, 1 / math.log2(6), 1 / math.log2(11), 0, 0])


def test_the_same_ranking_differs_by_nothing_and_is_not_distinguishable() -> None:
    rank = np.random.default_rng(0).integers(0, 30, 500)
    differences = paired_differences(rank, rank)
    assert set(differences) == set(METRICS)
    for d in differences.values():
        assert d == {"diff": 0.0, "low": 0.0, "high": 0.0}
        assert verdict(d) == "not distinguishable"


def test_a_clear_gain_is_compatible_a_clear_loss_not_and_noise_neither() -> None:
    rng = np.random.default_rng(1)
    reference = rng.integers(0, 20, 1000)
    better = np.maximum(reference - 5, 0)  # every query's relevant item moves up five places
    assert verdict(paired_differences(better, reference)["recall@1"]) == "compatible"
    assert verdict(paired_differences(reference, better)["recall@10"]) == "not compatible"
    # Swap half the queries' ranks with a fresh draw of the same distribution: no real difference.
    noisy = reference.copy()
    swap = rng.random(1000) < 0.5
    noisy[swap] = rng.integers(0, 20, int(swap.sum()))
    d = paired_differences(noisy, reference)["recall@1"]
    assert d["low"] < 0 < d["high"] and verdict(d) == "not distinguishable"


def test_the_interval_is_repeatable_and_moves_with_the_seed() -> None:
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, 15, 300), rng.integers(0, 15, 300)
    assert paired_differences(a, b) == paired_differences(a, b)
    assert paired_differences(a, b, seed=1)["recall@1"] != paired_differences(a, b, seed=2)["recall@1"]


def test_retention_of_the_ceiling_itself_is_one_and_of_a_half_is_about_half() -> None:
    ceiling = np.zeros(400, dtype=np.int64)  # the re-indexed search finds every item first
    same = retention(ceiling, ceiling)
    assert same["arr@10"] == {"value": 1.0, "low": 1.0, "high": 1.0}
    half = np.where(np.arange(400) % 2 == 0, 0, 50)  # the bridge finds every other item
    kept = retention(half, ceiling)["arr@10"]
    assert kept is not None and kept["value"] == 0.5 and kept["low"] < 0.5 < kept["high"]
    assert retention(half, np.full(400, 50))["arr@10"] is None  # a ceiling that finds nothing: no ratio


def test_small_sets_are_said_out_loud() -> None:
    line = few_queries_line(150, "test")
    assert line is not None and "150 queries" in line and "0.7 points" in line
    assert few_queries_line(2000, "test") is None
    assert describe({"diff": 0.012, "low": -0.018, "high": 0.042}) == "+1.2 [-1.8, +4.2]"
