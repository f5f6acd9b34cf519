"""Recall@K, compatibility, flip rates on hand-made cases; the path summary against brute force."""

from __future__ import annotations

import numpy as np
import pytest

from service.compat.arcsearch import summarise_path
from service.compat.curves import slerp_lambda
from service.compat.interpolation import nlerp, slerp
from service.compat.metrics import (
    default_ids,
    flip_rates,
    is_compatible,
    ranks,
    recall_at_k,
    relevance,
    search_recall,
)
from service.compat.procrustes import normalize_rows

E = np.eye(4, dtype=np.float32)


def test_ranks_on_hand_made_gallery() -> None:
    targets = E
    queries = np.array(
        [
            [1.0, 0.1, 0, 0],  # own target (row 0) first
            [0.9, 0.5, 0, 0],  # own target (row 1) second
            [0.2, 0.3, 0.1, 0.9],  # own target (row 2) fourth
        ],
        dtype=np.float32,
    )
    rel = relevance(default_ids(3), default_ids(4))
    np.testing.assert_array_equal(ranks(queries, targets, rel), [0, 1, 3])
    assert recall_at_k(ranks(queries, targets, rel), (1, 2, 4)) == {1: 1 / 3, 2: 2 / 3, 4: 1.0}


def test_id_relevance_multiple_and_missing_targets() -> None:
    targets = E
    target_ids = np.array([7, 7, 8, 9])
    queries = np.array([[0.1, 0.9, 0, 0.5], [0, 0, 0.2, 1.0], [1, 0, 0, 0]], dtype=np.float32)
    query_ids = np.array([7, 8, 5])  # 5 has no target at all
    rel = relevance(query_ids, target_ids)
    np.testing.assert_array_equal(rel.query_index, [0, 0, 1])
    r = ranks(queries, targets, rel)
    # Query 0: best relevant (target 1, id 7) is first; the other id-7 target does not count against it.
    assert r[0] == 0
    assert r[1] == 1  # target 3 (id 9) outranks its target 2
    assert r[2] == 4  # no relevant target: fails at every K
    assert search_recall(queries, targets, rel, (1, 2)) == {1: 1 / 3, 2: 2 / 3}


def test_ties_count_for_the_query() -> None:
    targets = np.array([[1, 0], [1, 0], [0, 1]], dtype=np.float32)
    r = ranks(np.array([[1, 0]], dtype=np.float32), targets, relevance(np.array([1]), np.array([0, 1, 2])))
    assert r[0] == 0


def test_compatibility_and_flips() -> None:
    assert is_compatible(0.51, 0.5)
    assert not is_compatible(0.5, 0.5)
    old = np.array([True, True, False, False, True])
    new = np.array([True, False, True, True, True])
    pfr, nfr = flip_rates(old, new)
    assert (pfr, nfr) == (0.4, 0.2)
    assert pfr - nfr == pytest.approx(new.mean() - old.mean())


@pytest.mark.parametrize("multi", [False, True])
def test_path_summary_equals_brute_force(multi: bool) -> None:
    rng = np.random.default_rng(7 + multi)
    n, m, d = 150, 220, 12
    base = normalize_rows(rng.standard_normal((m, d)))
    if multi:
        query_ids, target_ids = rng.integers(0, 60, n), rng.integers(0, 70, m)
    else:
        query_ids, target_ids = default_ids(n), default_ids(m)
    own = base[np.minimum(query_ids, m - 1)]
    u = normalize_rows(own + 0.9 * rng.standard_normal((n, d)))
    v = normalize_rows(own + 0.9 * rng.standard_normal((n, d)))
    rel = relevance(query_ids, target_ids)
    summary = summarise_path(u, v, base, rel, k=10)
    theta = np.arccos(np.clip(np.sum(u * v, axis=1), -1, 1))

    for a in (0.0, 0.2, 0.5, 0.8, 1.0):
        exact = ranks(nlerp(u, v, a), base, rel)
        fast = summary.ranks(np.full(n, a))
        for k in (1, 5, 10):
            # Float32 scores vs float64 blends can flip exact near-ties; allow one such query.
            assert abs(np.sum(exact < k) - np.sum(fast < k)) <= 1
        exact_s = ranks(slerp(u, v, a), base, rel)
        fast_s = summary.ranks(slerp_lambda(a, theta))
        assert abs(np.sum(exact_s < 1) - np.sum(fast_s < 1)) <= 1
