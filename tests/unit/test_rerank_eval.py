"""The re-rank cascade's offline evaluation (scoring/rerank_eval.py): its ends, a brute force, a hand case, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from service.compat.fit_options import FitOptions
from service.compat.fitting import fit_profile
from service.compat.profile import save_profile
from service.scoring.migration import Spaces
from service.scoring.rerank_eval import Plan, cascade_ranks, cascade_rows, plans_of
from tests.support.cli import cli


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _spaces(n: int, seed: int) -> Spaces:
    """A toy split: the compatible queries much noisier than the new ones, query i relevant to target i."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((n, 8)).astype(np.float32)
    served = _unit(base + 0.9 * rng.standard_normal((n, 8)))
    new_q = _unit(base + 0.4 * rng.standard_normal((n, 8)))
    new_t = _unit(base + 0.1 * rng.standard_normal((n, 8)))
    return Spaces(served, _unit(base), new_q, new_t, np.arange(n, dtype=np.int64))


def _brute_rank(spaces: Spaces, q: int, plan: Plan) -> int:
    """The cascade's list built literally for one query: sort, cut at N, re-rank the first B, find the target."""
    m, rel = len(spaces.old_targets), int(spaces.rel_target[q])
    old = spaces.served[q] @ spaces.old_targets.T
    new = spaces.new_queries[q] @ spaces.new_targets.T
    # Ties go to the relevant target: it sorts before every other target of its score.
    listed = sorted(range(m), key=lambda t: (-old[t], t != rel))[: plan.candidates]
    head = sorted(listed[: plan.budget], key=lambda t: (-new[t], t != rel))
    final = head + listed[plan.budget :]
    return final.index(rel) if rel in final else m


def test_every_target_re_ranked_is_the_reindexed_search_and_no_budget_is_stage_one() -> None:
    spaces = _spaces(300, 1)
    full, none = Plan(300, 300), Plan(300, 0)
    ranks = cascade_ranks(spaces, [full, none, Plan(10, 0)], chunk=64)
    np.testing.assert_array_equal(ranks.cascade[full], ranks.reindexed)
    np.testing.assert_array_equal(ranks.cascade[none], ranks.compatible)
    rows = cascade_rows(ranks, [full, none, Plan(10, 0)])
    assert rows["rows"][0]["recall@1"] == rows["reindexed"]["recall@1"]
    for row in rows["rows"][1:]:
        assert (row["recall@1"], row["recall@10"]) == (rows["compatible"]["recall@1"], rows["compatible"]["recall@10"])
    # The toy's new model is much better, so the two ends differ and the checks above can fail.
    assert rows["reindexed"]["recall@1"] > rows["compatible"]["recall@1"] + 0.1


def test_stage_one_recall_rises_with_n_and_bounds_the_cascade() -> None:
    spaces = _spaces(400, 2)
    plans = plans_of([1, 5, 20, 100, 400], None)
    rows = cascade_rows(cascade_ranks(spaces, plans), plans)["rows"]
    stage1 = [r["stage1_recall"] for r in rows]
    assert stage1 == sorted(stage1) and stage1[0] < stage1[2] < stage1[-1] == 1.0
    for row in rows:
        assert row["recall@10"] <= row["stage1_recall"]
        low, high = row["ci@1"]
        assert low <= row["recall@1"] <= high


def test_cascade_matches_the_list_built_by_hand_with_a_budget_below_n() -> None:
    spaces = _spaces(120, 3)
    spaces = Spaces(spaces.served, spaces.old_targets, spaces.new_queries, spaces.new_targets,
                    np.where(np.arange(120) % 17 == 5, -1, np.arange(120)).astype(np.int64))  # fmt: skip
    plans = [Plan(7, 4), Plan(30, 1), Plan(30, 12), Plan(120, 50)]
    ranks = cascade_ranks(spaces, plans, chunk=25)
    for plan in plans:
        assert ranks.cascade[plan].tolist() == [_brute_rank(spaces, q, plan) for q in range(120)]
    assert (ranks.compatible[spaces.rel_target < 0] == 120).all()


def test_the_re_rank_lifts_the_relevant_target_from_third_to_first() -> None:
    # Stage 1 scores 1.0, 0.9, 0.8 (the relevant target 2), 0.0; the new model scores target 2 highest.
    old_t = np.array([[1, 0], [0.9, np.sqrt(1 - 0.81)], [0.8, 0.6], [0, 1]], np.float32)
    new_t = np.array([[1, 0], [0.6, 0.8], [0, 1], [0.8, 0.6]], np.float32)
    spaces = Spaces(np.array([[1, 0]], np.float32), old_t, np.array([[0, 1]], np.float32), new_t, np.array([2]))
    plans = [Plan(3, 3), Plan(3, 2), Plan(2, 2), Plan(4, 0)]
    ranks = cascade_ranks(spaces, plans)
    assert (ranks.compatible[0], ranks.reindexed[0]) == (2, 0)
    assert [int(ranks.cascade[p][0]) for p in plans] == [0, 2, 4, 2]  # re-ranked, outside the budget, cut, stage 1
    rows = cascade_rows(ranks, plans)["rows"]
    assert [r["recall@1"] for r in rows] == [1.0, 0.0, 0.0, 0.0]
    assert [r["stage1_recall"] for r in rows] == [1.0, 1.0, 0.0, 1.0]


def test_the_cli_scores_a_fitted_profile_and_refuses_n_above_the_targets(
    tmp_path: Path, standin_fit_supports: dict[str, Path], standin_test_split: Path
) -> None:
    profile = tmp_path / "profile"
    save_profile(fit_profile({"text": standin_fit_supports["text"]}, FitOptions(folds=3)).profile, profile)
    done = cli("backfill", "cascade", profile, standin_test_split, "--candidates", "10,600", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["queries"], result["targets"]) == (600, 600)
    every = result["rows"][-1]
    assert (every["candidates"], every["budget"]) == (600, 600)
    assert every["recall@1"] == result["reindexed"]["recall@1"] and every["stage1_recall"] == 1.0
    zero = json.loads(cli("backfill", "cascade", profile, standin_test_split, "--budget", "0", "--json").stdout)
    assert [r["recall@1"] for r in zero["rows"]] == [zero["compatible"]["recall@1"]] * 4
    table = cli("backfill", "cascade", profile, standin_test_split, "--candidates", "20", "--budget", "5")
    assert table.returncode == 0 and "re-indexed" in table.stdout and "cascade" in table.stdout
    refused = cli("backfill", "cascade", profile, standin_test_split, "--candidates", "10,601")
    assert refused.returncode == 2 and refused.stderr.strip() == "error: --candidates 601 is more than the 600 targets"
    # `backfill curve` loads the same way: its ends are the cascade's two references.
    curve = json.loads(cli("backfill", "curve", profile, standin_test_split, "--merge", "raw", "--json").stdout)
    ends = [curve["rows"][0]["recall@1"], curve["rows"][-1]["recall@1"]]
    assert ends == [result["compatible"]["recall@1"], result["reindexed"]["recall@1"]]


@pytest.mark.parametrize("candidates", ["10,x", "20,10", "0"])
def test_the_cli_refuses_bad_candidates_in_one_line(candidates: str, standin_test_split: Path) -> None:
    done = cli("backfill", "cascade", standin_test_split, standin_test_split, "--candidates", candidates)
    assert done.returncode == 2 and done.stderr.startswith("error: --candidates") and done.stderr.count("\n") == 1
