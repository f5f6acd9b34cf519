"""The segment's recall on served queries: sampled searches measured against an exact one over the same snapshot."""

from __future__ import annotations

import numpy as np
import pytest

from service import metrics
from service.encoders.identity import ModelIdentity
from service.segment.layout import GalleryRef, create_segment, write_shard
from service.segment.reader import Indexing, Segment
from service.segment.recall_sample import RecallSampler
from service.segment.sealed import seal

DIM = 16
MODEL = ModelIdentity("synthetic-new", "synthetic-new", None, DIM)
World = tuple[Segment, np.ndarray, np.ndarray]  # the segment, its rows, queries


def served(sampler: RecallSampler, snapshot: object, queries: np.ndarray, scores: np.ndarray) -> None:
    """What the hybrid and new searches do after each search: offer it when the sampler says it is due."""
    if sampler.due(snapshot):
        sampler.offer(snapshot, queries, 10, scores)


def _clustered(rng: np.random.Generator, n: int) -> np.ndarray:
    centres = rng.standard_normal((40, DIM)).astype(np.float32)
    rows = centres[rng.integers(0, 40, n)] + 0.3 * rng.standard_normal((n, DIM)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    """A segment of 6,000 rows, 5,000 of them in a sealed index, the rest exact; its rows and 64 queries."""
    folder = tmp_path_factory.mktemp("recall") / "seg"
    create_segment(folder, MODEL, GalleryRef("ab" * 32, 10_000))
    rng = np.random.default_rng(3)
    rows = _clustered(rng, 6000)
    write_shard(folder, np.arange(5000), rows[:5000], MODEL, "t")
    seal(folder)
    write_shard(folder, np.arange(5000, 6000), rows[5000:], MODEL, "t")
    return Segment.open(folder), rows, _clustered(rng, 64)


def _brute_force_recall(rows: np.ndarray, queries: np.ndarray, ids: np.ndarray) -> float:
    want = np.argsort(-(queries @ rows.T), axis=1)[:, :10]
    return float(np.mean([len(set(w) & set(g)) / 10 for w, g in zip(want.tolist(), ids.tolist(), strict=True)]))


def test_an_exact_search_of_the_snapshot_is_the_brute_force_ranking(
    world: World,
) -> None:
    segment, rows, queries = world
    assert segment.snapshot.sealed_blocks == 1
    scores, ids = segment.snapshot.search(queries, 10, exact=True)
    np.testing.assert_allclose(scores, np.sort(queries @ rows.T, axis=1)[:, ::-1][:, :10], atol=1e-5)
    assert _brute_force_recall(rows, queries, ids) == 1.0


def test_a_sample_records_the_share_of_the_exact_top_k_the_served_answer_held(
    world: World,
) -> None:
    segment, rows, queries = world
    recorded = metrics.SEGMENT_RECALL.collect()[0]
    before = next(s.value for s in recorded.samples if s.name.endswith("_count"))
    narrow_scores, narrow_ids = segment.snapshot.search(queries, 10, 1)  # the graph at its narrowest
    sampler = RecallSampler(every=1)
    served(sampler, segment.snapshot, queries, narrow_scores)
    sampler.wait()
    narrow = sampler.describe()
    assert narrow["queries"] == 64
    assert narrow["mean"] < 1.0
    assert narrow["mean"] == pytest.approx(_brute_force_recall(rows, queries, narrow_ids), abs=0.005)
    exact_scores, _ = segment.snapshot.search(queries, 10, exact=True)
    served(sampler, segment.snapshot, queries, exact_scores)
    sampler.wait()
    both = sampler.describe()
    assert both["queries"] == 128 and both["mean"] == pytest.approx((narrow["mean"] + 1.0) / 2, abs=1e-4)
    recorded = metrics.SEGMENT_RECALL.collect()[0]
    assert next(s.value for s in recorded.samples if s.name.endswith("_count")) == before + 128
    sampler.close()


def test_one_search_in_every_n_is_measured_and_none_without_a_sealed_index(
    world: World,
) -> None:
    segment, _, queries = world
    scores, _ = segment.snapshot.search(queries[:4], 10)
    sampler = RecallSampler(every=3)
    for _ in range(7):
        served(sampler, segment.snapshot, queries[:4], scores)
        sampler.wait()  # (one at a time: a search offered while one is measured is not sampled)
    assert sampler.describe()["queries"] == 2 * 4  # the 3rd and 6th
    exact = Segment.open(segment.folder, Indexing(exact=True))  # no sealed index read: nothing to measure
    never, off = RecallSampler(every=1), RecallSampler(every=0)
    for sampled in (never, off):
        served(sampled, exact.snapshot, queries[:4], scores)
        served(sampled, segment.snapshot if sampled is off else exact.snapshot, queries[:4], scores)
        sampled.wait()
        assert sampled.describe()["queries"] == 0 and sampled.describe()["mean"] is None
    for each in (sampler, never, off):
        each.close()
