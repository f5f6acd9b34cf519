"""The cross-fit plan both fits walk: folds per id, training rows without the held-out fold, seeded held-out samples."""

from __future__ import annotations

import numpy as np
import pytest

from service.compat.crossfit import MAX_EVAL_GALLERY, CrossFitPlan, assign_joint, gallery_rows, sample_rows
from service.compat.io import Split
from service.vocabulary import EvalGallery


@pytest.fixture
def split(crossfit_split: Split) -> Split:
    """200 queries of 100 items (two per item) and 200 targets: the 100 items' and 100 distractors (conftest)."""
    return crossfit_split


def _draw(
    splits: dict[str, Split],
    *,
    folds: int = 4,
    same_set: bool = False,
    seed: int = 0,
    max_eval_queries: int = 5000,
    eval_gallery: EvalGallery = EvalGallery.support,
) -> CrossFitPlan:
    """A plan with the fit's defaults unless overridden."""
    return CrossFitPlan.draw(
        splits, folds=folds, same_set=same_set, seed=seed, max_eval_queries=max_eval_queries, eval_gallery=eval_gallery
    )


def test_every_id_keeps_its_queries_and_targets_in_one_fold(split: Split) -> None:
    plan = _draw({"s": split})
    assert [f.index for f in plan.folds] == [0, 1, 2, 3] and not plan.same_set
    for fold in plan.folds:
        rows = fold.rows["s"]
        held_ids = set(split.query_ids[rows.in_fold_query])
        assert held_ids, "every fold gets queries"
        # The held-out queries' relevant targets are in the fold, and none of them is trained on.
        assert held_ids <= set(split.target_ids[rows.in_fold_target])
        assert not held_ids & set(split.query_ids[rows.train("query")])
        assert not held_ids & set(split.target_ids[rows.train("target")])


def test_training_rows_are_every_row_outside_the_held_out_fold(split: Split) -> None:
    plan = _draw({"s": split})
    query_folds = np.stack([f.rows["s"].in_fold_query for f in plan.folds])
    target_folds = np.stack([f.rows["s"].in_fold_target for f in plan.folds])
    # Each row is held out by exactly one fold.
    assert (query_folds.sum(axis=0) == 1).all() and (target_folds.sum(axis=0) == 1).all()
    for fold in plan.folds:
        rows = fold.rows["s"]
        assert np.array_equal(rows.train("query"), ~rows.in_fold_query)
        assert np.array_equal(rows.train("target"), ~rows.in_fold_target)
        assert np.array_equal(rows.in_fold("target"), rows.in_fold_target)
        assert not rows.train("query")[rows.queries].any()
        assert np.array_equal(rows.queries, np.flatnonzero(rows.in_fold_query))


def test_scored_queries_are_a_seeded_sorted_sample_of_the_held_out_queries(split: Split) -> None:
    plan = _draw({"s": split}, max_eval_queries=20)
    for fold in plan.folds:
        rows = fold.rows["s"]
        assert len(rows.scored) == 20 and np.all(np.diff(rows.scored) > 0)
        assert set(rows.scored) <= set(rows.queries)

    def samples(p: CrossFitPlan) -> list[list[int]]:
        return [f.rows["s"].scored.tolist() for f in p.folds]

    assert samples(_draw({"s": split}, max_eval_queries=20)) == samples(plan)
    assert samples(_draw({"s": split}, max_eval_queries=20, seed=1)) != samples(plan)


def test_held_out_gallery_is_the_fold_or_every_fold(split: Split) -> None:
    for fold in _draw({"s": split}, eval_gallery=EvalGallery.fold).folds:
        rows = fold.rows["s"]
        assert np.array_equal(rows.gallery, np.flatnonzero(rows.in_fold_target))
    for fold in _draw({"s": split}).folds:
        assert np.array_equal(fold.rows["s"].gallery, np.arange(len(split.old_target)))


def test_support_gallery_keeps_the_own_fold_and_caps_the_distractors() -> None:
    t_fold = np.arange(MAX_EVAL_GALLERY + 10_000) % 4
    rows = gallery_rows(t_fold, 1, EvalGallery.support, np.random.default_rng(0))
    assert len(rows) == MAX_EVAL_GALLERY and np.all(np.diff(rows) > 0)
    assert set(np.flatnonzero(t_fold == 1)) <= set(rows)
    assert np.array_equal(sample_rows(np.arange(5), 10, np.random.default_rng(0)), np.arange(5))


def test_same_set_is_one_fold_that_trains_on_everything(split: Split) -> None:
    plan = _draw({"s": split}, same_set=True, folds=1, max_eval_queries=50)
    (only,) = plan.folds
    rows = only.rows["s"]
    assert plan.same_set and rows.train("query").all() and rows.train("target").all()
    assert len(rows.scored) == 50 and np.array_equal(rows.gallery, np.arange(len(split.old_target)))


def test_an_id_shared_by_two_splits_lands_in_one_fold(two_modality_splits: dict[str, Split]) -> None:
    text, image = two_modality_splits["text"], two_modality_splits["image"]  # ids 0..199: shared with text
    plan = _draw({"text": text, "image": image})
    for fold in plan.folds:
        t, i = fold.rows["text"], fold.rows["image"]
        assert np.array_equal(t.in_fold_query[:200], i.in_fold_query)
        assert np.array_equal(i.in_fold_query, i.in_fold_target)


def test_the_plan_draws_in_the_fits_order(split: Split) -> None:
    # Assignment first, then per fold (and split) the query sample and the gallery sample: the order the
    # fits always drew them in, so a refactored fit reproduces every earlier profile from its seed.
    plan = _draw({"s": split}, max_eval_queries=30, seed=7)
    rng = np.random.default_rng(7)
    ((q_fold, t_fold),) = assign_joint([split], 4, rng)
    for f, fold in enumerate(plan.folds):
        assert np.array_equal(fold.rows["s"].in_fold_query, q_fold == f)
        assert np.array_equal(fold.rows["s"].scored, sample_rows(np.flatnonzero(q_fold == f), 30, rng))
        assert np.array_equal(fold.rows["s"].gallery, gallery_rows(t_fold, f, EvalGallery.support, rng))
