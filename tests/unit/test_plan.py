"""The mode as asked, parsed once into the query map and the search plan (service/query/plan.py)."""

from __future__ import annotations

import pytest

from service.query.plan import Plan, Where, needs_segment, plan_of
from service.vocabulary import HEAD_MODES, Head, Mode


def plan(mode: Mode, head: Head = Head.slerp, *, segment: bool = True, hybrid_reranks: bool = True) -> Plan:
    return plan_of(mode, head, segment=segment, hybrid_reranks=hybrid_reranks)


@pytest.mark.parametrize("head", list(Head))
def test_a_head_mode_maps_itself_over_the_gallery_alone(head: Head) -> None:
    for mode in HEAD_MODES[head]:
        got = plan(mode, head)
        assert (got.mapping, got.where, got.reranks, got.compares, got.staged) == (
            mode,
            Where.gallery,
            False,
            False,
            False,
        )


@pytest.mark.parametrize("head", [Head.slerp, Head.adapter, Head.adapter_slerp, Head.aligned])
def test_a_staged_mode_maps_with_the_head(head: Head) -> None:
    compare, hybrid, cascade = plan(Mode.compare, head), plan(Mode.hybrid, head), plan(Mode.cascade, head)
    assert compare.mapping == hybrid.mapping == cascade.mapping == Mode(head)
    assert compare.where == Where.gallery and compare.compares and not compare.reranks
    assert hybrid.where == Where.beside_segment and not hybrid.compares
    assert cascade.reranks and cascade.where == Where.beside_segment
    assert compare.staged and hybrid.staged and cascade.staged


def test_cascade_without_a_segment_searches_the_gallery_and_still_reranks() -> None:
    got = plan(Mode.cascade, segment=False)
    assert got.where == Where.gallery and got.reranks


def test_hybrid_reranks_only_when_told() -> None:
    assert plan(Mode.hybrid, hybrid_reranks=True).reranks
    assert not plan(Mode.hybrid, hybrid_reranks=False).reranks
    assert not plan(Mode.slerp, hybrid_reranks=True).reranks  # the value is hybrid's, no other mode's


def test_new_has_no_map_and_searches_the_segment_alone() -> None:
    got = plan(Mode.new)
    assert got.mapping is None and got.where == Where.segment and not got.staged


def test_only_the_cascade_survives_a_failed_new_encoder() -> None:
    assert [mode for mode in Mode if plan(mode).survives_new_failure] == [Mode.cascade]


def test_every_mode_has_a_plan_and_only_hybrid_and_new_need_a_segment() -> None:
    plans = {mode: plan(mode) for mode in Mode}
    assert {mode for mode in Mode if needs_segment(mode)} == {Mode.hybrid, Mode.new}
    assert all(plans[mode].where != Where.gallery for mode in Mode if needs_segment(mode))
