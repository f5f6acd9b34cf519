"""Merging the old gallery's hits with the segment's, the calibration (line and query backgrounds), the curve."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.compat.calibration import (
    IDENTITY,
    References,
    ScoreMap,
    best_line,
    fit_score_map,
    in_principal_directions,
)
from service.compat.metrics import relevance
from service.scoring.migration import Spaces, curve, merged_ranks, move_order
from service.segment.merge import merge
from service.vocabulary import Merge

NEG = -np.inf


def test_calibrated_merge_keeps_old_scores_and_maps_the_segments() -> None:
    old = (np.array([[0.9, 0.5, NEG]], np.float32), np.array([[1, 2, -1]]))
    new = (np.array([[0.8, 0.7]], np.float32), np.array([[3, 4]]))
    out = merge(old, new, 4, Merge.calibrated, ScoreMap(0.5, 0.2))  # 0.8 -> 0.6, 0.7 -> 0.55
    assert out.ids.tolist() == [[1, 3, 4, 2]]
    np.testing.assert_allclose(out.scores, [[0.9, 0.6, 0.55, 0.5]], rtol=1e-6)
    assert out.from_segment.tolist() == [[False, True, True, False]]


def test_nothing_moved_is_the_old_list_exactly_and_ties_go_to_the_old_hit() -> None:
    old = (np.array([[0.7, 0.6]], np.float32), np.array([[5, 6]]))
    empty = (np.full((1, 2), NEG, np.float32), np.full((1, 2), -1))
    out = merge(old, empty, 2, Merge.calibrated, ScoreMap(2.0, -1.0))
    assert out.ids.tolist() == [[5, 6]] and out.scores[0].tolist() == pytest.approx([0.7, 0.6])
    tie = merge(old, (np.array([[0.7]], np.float32), np.array([[9]])), 2, Merge.raw)
    assert tie.ids.tolist() == [[5, 9]]


def test_rrf_interleaves_by_rank_and_pads_short_lists() -> None:
    old = (np.array([[0.9, 0.1]], np.float32), np.array([[1, 2]]))
    new = (np.array([[0.2, NEG]], np.float32), np.array([[3, -1]]))
    out = merge(old, new, 4, Merge.rrf)
    assert out.ids.tolist() == [[1, 3, 2, -1]]
    assert out.from_segment.tolist() == [[False, True, False, False]]


def _sorted_list(draw: st.DrawFn, width: int, ids: st.SearchStrategy[int]) -> tuple[np.ndarray, np.ndarray]:
    """A search's answer: scores descending (ties likely: few values), ids, padding (-1 / -inf) at the end."""
    found = draw(st.integers(0, width))
    scores = sorted(draw(st.lists(st.sampled_from([0.1, 0.3, 0.5, 0.7]), min_size=found, max_size=found)), reverse=True)
    hits = draw(st.lists(ids, min_size=found, max_size=found, unique=True))
    pad = width - found
    return np.array([[*scores, *[NEG] * pad]], np.float32), np.array([[*hits, *[-1] * pad]], np.int64)


def _brute_force_merge(old, new, k, method, score_map, offset):  # type: ignore[no-untyped-def]
    """The merge spelled out: every listed hit on one scale, best first (the old hit wins a tie), each id once."""
    hits = []
    for source, (scores, ids) in enumerate((old, new)):
        for rank, (score, hit) in enumerate(zip(scores[0].tolist(), ids[0].tolist(), strict=True)):
            if hit < 0:
                continue
            if method == Merge.rrf:
                score = 1.0 / (60 + rank + 1)
            elif method == Merge.calibrated and source == 1:
                mapped = np.float32(score) * np.float32(score_map.scale) + np.float32(score_map.shift)
                score = float(np.float32(mapped)) + offset
            hits.append((-np.float32(score), source, rank, hit))
    seen: set[int] = set()
    kept = []
    for score, source, _, hit in sorted(hits):
        if hit not in seen:
            seen.add(hit)
            kept.append((hit, -score, source == 1))
    kept = kept[:k] + [(-1, NEG, False)] * max(0, k - len(kept))
    return [h for h, _, _ in kept], [s for _, s, _ in kept], [f for _, _, f in kept]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), method=st.sampled_from(list(Merge)), k=st.integers(1, 8))
def test_the_merge_is_the_brute_force_merge(data: st.DataObject, method: Merge, k: int) -> None:
    """Any two answers, an id in both included (a live store moved it between the searches), any merge."""
    ids = st.integers(0, 12)  # a small id range: the same id in both lists is common
    old = data.draw(st.composite(lambda d: _sorted_list(d, 5, ids))())
    new = data.draw(st.composite(lambda d: _sorted_list(d, 4, ids))())
    score_map = ScoreMap(data.draw(st.sampled_from([0.5, 1.0, 2.0])), data.draw(st.sampled_from([-0.1, 0.0, 0.2])))
    offset = data.draw(st.sampled_from([0.0, 0.1]))
    out = merge(old, new, k, method, score_map, np.array([offset], np.float32))
    want_ids, want_scores, want_segment = _brute_force_merge(old, new, k, method, score_map, offset)
    assert out.ids[0].tolist() == want_ids
    assert out.from_segment[0].tolist() == want_segment
    np.testing.assert_allclose(out.scores[0], np.array(want_scores, np.float32), rtol=1e-6)


def test_best_line_makes_every_cross_space_decision_it_can() -> None:
    rng = np.random.default_rng(0)
    # Old scores near 0.7 (hit) / 0.6 (miss); new ones are the same on a scale twice as wide around 0.5.
    r_old, n_old = 0.7 + 0.01 * rng.standard_normal(500), 0.6 + 0.01 * rng.standard_normal(500)
    r_new, n_new = 0.5 + 2 * (r_old - 0.65), 0.5 + 2 * (n_old - 0.65)
    line, right = best_line(r_old, n_old, r_new + 0.001, n_new)
    assert right == pytest.approx(1.0)
    assert line.apply(np.array([0.5]))[0] == pytest.approx(0.65, abs=0.03)
    assert ScoreMap.from_dict(line.as_dict()) == line
    with pytest.raises(ValueError):
        ScoreMap.from_dict({"scale": -1.0, "shift": 0.0})


def _spaces(n: int, seed: int) -> Spaces:
    """A toy split: the old space noisier than the new, one relevant target per query (row i)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((n, 8)).astype(np.float32)

    def unit(x: np.ndarray) -> np.ndarray:
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)

    served = unit(base + 0.9 * rng.standard_normal((n, 8)))
    new_q = unit(base + 0.4 * rng.standard_normal((n, 8)))
    return Spaces(served, unit(base), new_q, unit(base), np.arange(n, dtype=np.int64))


def test_curve_ends_at_the_compatible_and_the_reindexed_search() -> None:
    spaces = _spaces(400, 1)
    order = move_order(400, 0)
    rows = curve(spaces, [0.0, 1.0], order, Merge.calibrated, IDENTITY)
    old_only = (spaces.served @ spaces.old_targets.T).argmax(axis=1) == np.arange(400)
    new_only = (spaces.new_queries @ spaces.new_targets.T).argmax(axis=1) == np.arange(400)
    assert rows[0]["recall@1"] == pytest.approx(old_only.mean())
    assert rows[1]["recall@1"] == pytest.approx(new_only.mean())
    low, high = rows[0]["ci@1"]
    assert low <= rows[0]["recall@1"] <= high


def test_merged_ranks_match_a_brute_force_merge() -> None:
    spaces = _spaces(60, 2)
    moved = np.zeros(60, bool)
    moved[move_order(60, 3)[:25]] = True
    line = ScoreMap(0.8, 0.1)
    got = merged_ranks(spaces, moved, Merge.calibrated, line)
    old = spaces.served @ spaces.old_targets.T
    new = line.apply(spaces.new_queries @ spaces.new_targets.T)
    for q in range(60):
        scores = np.where(moved, new[q], old[q])
        beats = (scores > scores[q]) | ((scores == scores[q]) & ~moved & moved[q])
        beats[q] = False
        assert got[q] == beats.sum()


def test_offsets_read_each_query_against_its_background_in_both_spaces() -> None:
    rng = np.random.default_rng(4)
    old_refs, new_refs = _unit(rng.standard_normal((30, 6))), _unit(rng.standard_normal((30, 4)))
    served, new_q = _unit(rng.standard_normal((5, 6))), _unit(rng.standard_normal((5, 4)))
    plain = ScoreMap(1.5, 0.1)
    assert plain.offsets(served, new_q).tolist() == [0.0] * 5
    score_map = ScoreMap(1.5, 0.1, References(old_refs, new_refs, k=3))
    b_old = np.sort(served @ old_refs.T, axis=1)[:, -3:].mean(axis=1)
    b_new = np.sort(new_q @ new_refs.T, axis=1)[:, -3:].mean(axis=1)
    offsets = score_map.offsets(served, new_q)
    np.testing.assert_allclose(offsets, b_old - 1.5 * b_new, rtol=1e-5, atol=1e-6)
    # Each query's row moves by its own offset; the old list is untouched.
    old = (np.array([[0.9], [0.2]], np.float32), np.array([[1], [2]]))
    new = (np.array([[0.5], [0.5]], np.float32), np.array([[3], [4]]))
    out = merge(old, new, 2, Merge.calibrated, plain, np.array([0.0, 0.3], np.float32))  # 0.85 and 1.15
    assert out.ids.tolist() == [[1, 3], [4, 2]]
    np.testing.assert_allclose(out.scores, [[0.9, 0.85], [1.15, 0.2]], rtol=1e-6)
    assert ScoreMap.from_dict(score_map.as_dict(), (old_refs, new_refs)).references is not None
    with pytest.raises(ValueError, match="reference rows"):
        ScoreMap.from_dict(score_map.as_dict())  # named, not stored
    with pytest.raises(ValueError, match="background k"):
        References(old_refs, new_refs, k=31)


def test_references_in_their_principal_directions_read_the_same_backgrounds_and_round_trip() -> None:
    """Rows spanning 5 of 12 dimensions keep every cosine in 5 coordinates; a query is read in the same ones."""
    rng = np.random.default_rng(7)
    old_refs = _unit(rng.standard_normal((40, 5)) @ rng.standard_normal((5, 12)))
    new_refs = _unit(rng.standard_normal((40, 8)))
    served, new_q = _unit(rng.standard_normal((6, 12))), _unit(rng.standard_normal((6, 8)))
    old_rows, old_basis = in_principal_directions(old_refs, 5)
    new_rows, new_basis = in_principal_directions(new_refs, 8)  # a space of at most the rank stays whole
    assert old_rows.shape == (40, 5) and old_basis is not None and old_basis.shape == (12, 5)
    np.testing.assert_allclose(old_basis.T @ old_basis, np.eye(5), atol=1e-5)
    assert new_basis is None and new_rows is new_refs
    whole = References(old_refs, new_refs, k=4)
    reduced = References(old_rows, new_rows, 4, old_basis, None)
    assert reduced.dims == whole.dims == (12, 8)
    np.testing.assert_allclose(reduced.background(served, "old"), whole.background(served, "old"), atol=1e-5)
    np.testing.assert_allclose(reduced.background(new_q, "new"), whole.background(new_q, "new"), atol=1e-6)
    # Fewer directions than the rows span: the background of each query's projection, not the same numbers.
    few_rows, few_basis = in_principal_directions(old_refs, 2)
    few = References(few_rows, new_rows, 4, few_basis, None)
    assert not np.allclose(few.background(served, "old"), whole.background(served, "old"), atol=1e-3)
    # profile.json names the bases; the tensors file must hold exactly those.
    line = ScoreMap(1.2, 0.0, reduced).as_dict()
    assert line["background"]["directions"] == [5, None]
    loaded = ScoreMap.from_dict(line, (old_rows, new_rows), (old_basis, None))
    assert loaded.references is not None and loaded.references.dims == (12, 8)
    with pytest.raises(ValueError, match="bases named"):
        ScoreMap.from_dict(line, (old_rows, new_rows))
    with pytest.raises(ValueError, match="columns differ"):
        References(old_rows, new_rows, 4, few_basis, None)


def test_a_fitted_profile_stores_its_references_in_128_directions() -> None:
    """fit_score_map keeps REFERENCE_RANK directions of a wider space, and the backgrounds it fits on are those."""
    rng = np.random.default_rng(8)
    n = 300
    old_t, new_t = _unit(rng.standard_normal((n, 160))), _unit(rng.standard_normal((n, 96)))
    served = _unit(old_t + 0.3 * rng.standard_normal((n, 160)))
    new_q = _unit(new_t + 0.3 * rng.standard_normal((n, 96)))
    fitted, report = fit_score_map(served, old_t, new_q, new_t, relevance(np.arange(n), np.arange(n)))
    refs = fitted.references
    assert refs is not None and refs.old.shape == (n, 128) and refs.old_basis is not None
    assert refs.new_basis is None and refs.new.shape == (n, 96)  # 96-d: kept whole
    assert report["background"] == {"k": 20, "references": n, "directions": [128, None]}


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _crowded_spaces(n: int, seed: int) -> Spaces:
    """A toy split where some queries sit in a crowded part of the new space: they score high against everything.

    Every new row shares one direction c; a query's weight on c (drawn per query) lifts all its new
    scores by about the same amount, which one line per modality cannot undo and a background can.
    """
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((n, 16))
    c = np.zeros(16)
    c[0] = 1.0
    served = _unit(base + 1.0 * rng.standard_normal((n, 16)))
    lift = rng.uniform(0.0, 5.0, (n, 1))
    new_q = _unit(base + 0.7 * rng.standard_normal((n, 16)) + lift * c)
    new_t = _unit(base + 3.0 * c)
    return Spaces(served, _unit(base), new_q, new_t, np.arange(n, dtype=np.int64))


def test_query_backgrounds_beat_one_line_where_queries_are_crowded() -> None:
    support, test = _crowded_spaces(1500, 5), _crowded_spaces(1500, 6)
    rel = relevance(np.arange(1500), np.arange(1500))
    fitted, report = fit_score_map(support.served, support.old_targets, support.new_queries, support.new_targets, rel)
    assert fitted.references is not None and report["background"]["references"] == 1500
    r_old, n_old, r_new, n_new = _best(support)
    line, line_right = best_line(r_old, n_old, r_new, n_new)
    assert report["right_decisions"] > line_right + 0.04  # 0.862 against 0.799 when written
    moved = np.zeros(1500, bool)
    moved[move_order(1500, 0)[:750]] = True
    with_background = (merged_ranks(test, moved, Merge.calibrated, fitted) == 0).mean()
    with_line = (merged_ranks(test, moved, Merge.calibrated, line) == 0).mean()
    assert with_background > with_line + 0.03  # R@1 0.579 against 0.525 at half moved, when written


def _best(spaces: Spaces) -> tuple[np.ndarray, ...]:
    """best_scores' four arrays for a split whose query i's relevant target is row i."""
    out = []
    for q, t in ((spaces.served, spaces.old_targets), (spaces.new_queries, spaces.new_targets)):
        s = (q @ t.T).astype(np.float64)
        hit = np.diag(s).copy()
        np.fill_diagonal(s, -np.inf)
        out += [hit, s.max(axis=1)]
    return tuple(out)


def test_negative_flips_count_the_queries_the_old_system_had_right_and_a_state_gets_wrong() -> None:
    spaces = _crowded_spaces(400, 7)
    old_right = np.random.default_rng(8).random(400) < 0.6
    order = move_order(400, 1)
    rows = curve(spaces, [0.0, 0.5, 1.0], order, Merge.calibrated, IDENTITY, old_right=old_right)
    for row in rows:
        moved = np.zeros(400, bool)
        moved[order[: row["moved"]]] = True
        wrong_now = merged_ranks(spaces, moved, Merge.calibrated, IDENTITY) >= 1
        assert row["negative_flips@1"] == pytest.approx((old_right & wrong_now).mean())
        low, high = row["flips_ci"]
        assert low <= row["negative_flips@1"] <= high
    assert "negative_flips@1" not in curve(spaces, [0.5], order, Merge.raw)[0]  # only with the old system's answers
