"""A real class-extension upgrade on sklearn's digits (5 -> 10 classes), mirroring the ablation of 001_...

Five independently trained (old, new) model pairs.  Gallery: held-out images of the old classes 0-4
encoded by OLD; queries: other held-out images of 0-4 encoded by NEW (and by OLD for the old->old
baseline).  The old-class protocol is the one PSP's guarantee speaks about: images of classes the old
model never learnt have no prototype in its C_k-dim simplex (docs/benchmarks.md also reports the
all-classes variant, where PSP fails).

Two kinds of evidence, as in the paper:
- retrieval (class-label mAP and Recall@1) with the empirical criterion new->old > old->old;
- mean margins of the inequalities (1a) same-class and (1b) different-class on cosine distance
  (the paper's ablation table); positive = the inequality holds on average.
Note the retrieval ranking cannot see P_tk: it changes a query only by a multiple of the all-ones
vector on the old-class coordinates (orthogonal to every centred gallery row) and by its norm, so
PSP with and without P_tk rank identically.  P_tk shows in the distances, i.e. in the margins.
The table itself is printed by loadtest/digits_table.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.support.digits_models import Summary, run_experiment, summarise

PAIRS = 5

pytestmark = pytest.mark.slow  # about 15-20 s on one free core; more on a busy box


@pytest.fixture(scope="module")
def table() -> Iterator[dict[str, Summary]]:
    before = torch.get_num_threads()
    # Tiny models: a second thread only adds spin-wait overhead (10x slower on a shared box).
    torch.set_num_threads(1)
    try:
        summaries = summarise([run_experiment(seed)[0] for seed in range(PAIRS)])
    finally:
        torch.set_num_threads(before)
    yield {s.method: s for s in summaries}


def test_raw_penultimate_features_are_not_compatible(table: dict[str, Summary]) -> None:
    s = table["penultimate features"]
    assert s.compatible == 0, s
    assert s.map_new_old < 0.6 * s.map_old_old


def test_psp_is_compatible_on_retrieval_and_on_both_inequalities(table: dict[str, Summary]) -> None:
    s = table["PSP"]
    assert s.compatible >= PAIRS - 1, s
    assert s.holds_both >= PAIRS - 1, s
    assert s.margin_1a > 0 and s.margin_1b > 0


def test_removing_p_tk_breaks_the_same_class_inequality(table: dict[str, Summary]) -> None:
    full, ablated = table["PSP"], table["PSP without P_tk"]
    assert ablated.margin_1a < 0, ablated
    assert ablated.holds_both < full.holds_both
    # ...while the retrieval ranking is untouched (see the module docstring).
    assert ablated.map_new_old == pytest.approx(full.map_new_old, abs=1e-4)  # float32 near-ties only


def test_raw_softmax_does_not_meet_both_inequalities(table: dict[str, Summary]) -> None:
    s = table["softmax"]
    assert s.margin_1a < 0, s
    assert s.holds_both < table["PSP"].holds_both


def test_without_p_kk_the_same_class_inequality_still_holds(table: dict[str, Summary]) -> None:
    # The paper: P_tk provides alignment (1a), P_kk the obtuse prototypes behind (1b).  (1a) reproduces
    # here; the (1b) failure it predicts for uncentred outputs does not (see docs/benchmarks.md).
    assert table["PSP without P_kk"].margin_1a > 0


def test_feature_space_maps_are_compatible(table: dict[str, Summary]) -> None:
    assert table["Procrustes + SLERP"].compatible >= PAIRS - 1
    assert table["MKP adapter"].compatible >= PAIRS // 2 + 1
