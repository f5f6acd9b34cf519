"""Sealed indexes: one index per segment whatever the loading order, the rest searched exactly, damage kept out."""

from __future__ import annotations

import json
from pathlib import Path

import faiss
import numpy as np
import pytest

from service.encoders.identity import ModelIdentity
from service.errors import InputError
from service.manifest import write_manifest
from service.segment.layout import GalleryRef, create_segment, write_shard
from service.segment.reader import Indexing, Segment
from service.segment.sealed import (
    INDEX_FILE,
    INDEX_JSON,
    INDEXES,
    LEGACY_EF_SEARCH,
    PROBES,
    QUERY_RECALL_TARGET,
    RECALL_TARGET,
    WIDTHS,
    SealedMeta,
    choose_cover,
    measured_width,
    seal,
    sealed_names,
)

DIM = 16
MODEL = ModelIdentity("synthetic-new", "synthetic-new", None, DIM)
GALLERY = GalleryRef("ab" * 32, 100_000)


def _clustered(rng: np.random.Generator, n: int) -> np.ndarray:
    """Unit rows around 40 centres: neighbours are close, as real embeddings' are."""
    centres = rng.standard_normal((40, DIM)).astype(np.float32)
    rows = centres[rng.integers(0, 40, n)] + 0.3 * rng.standard_normal((n, DIM)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


@pytest.fixture
def segment(tmp_path: Path) -> Path:
    create_segment(tmp_path / "seg", MODEL, GALLERY)
    return tmp_path / "seg"


def _answers(segment: Segment, queries: np.ndarray, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
    return segment.snapshot.search(queries, k)


def test_loaded_shard_by_shard_or_at_once_the_answers_are_identical(segment: Path) -> None:
    rng = np.random.default_rng(0)
    rows = _clustered(rng, 6000)
    queries = _clustered(rng, 200)
    live = Segment.open(segment)  # the service, refreshing while shards and a seal land
    for part in range(3):
        write_shard(
            segment, np.arange(part * 1000, (part + 1) * 1000), rows[part * 1000 : (part + 1) * 1000], MODEL, "t"
        )
        live.refresh()
    before_seal = _answers(live, queries)
    done = seal(segment)
    assert done.name is not None and done.rows == 3000 and done.shards == 3
    live.refresh()  # the three shards' exact blocks give way to the sealed index
    assert live.snapshot.sealed_blocks == 1 and live.describe()["sealed_rows"] == 3000
    for part in range(3, 6):  # shards after the seal: searched exactly beside it
        write_shard(
            segment, np.arange(part * 1000, (part + 1) * 1000), rows[part * 1000 : (part + 1) * 1000], MODEL, "t"
        )
        live.refresh()
    at_once = Segment.open(segment)  # a restart or a cut-over reads the finished folder
    ids_live, scores_live = _answers(live, queries)[1], _answers(live, queries)[0]
    ids_once, scores_once = _answers(at_once, queries)[1], _answers(at_once, queries)[0]
    np.testing.assert_array_equal(ids_live, ids_once)
    np.testing.assert_array_equal(scores_live, scores_once)
    # Before the seal every row was exact: that answer is the brute-force one.
    exact = queries @ rows[:3000].T
    np.testing.assert_array_equal(before_seal[1], np.argsort(-exact, axis=1, kind="stable")[:, :10])


def test_each_moved_id_is_held_by_one_block_after_every_refresh(segment: Path) -> None:
    """The served ids the reader keeps between refreshes: ids moved again stay out, a change of cover resets them."""
    rng = np.random.default_rng(5)
    live = Segment.open(segment)

    def held_once() -> None:
        live.refresh()
        snap = live.snapshot
        held = np.concatenate([block.ids for block in snap.blocks])
        assert len(held) == len(np.unique(held)) == snap.count  # every moved id in exactly one block

    write_shard(segment, np.arange(0, 100), _clustered(rng, 100), MODEL, "t")
    held_once()
    write_shard(segment, np.arange(50, 150), _clustered(rng, 100), MODEL, "t")  # 50 ids moved again
    held_once()
    assert seal(segment, min_rows=100).rows == 150  # the cover changes: the exact part is rebuilt
    held_once()
    assert live.snapshot.sealed_blocks == 1 and len(live.snapshot.blocks) == 1
    write_shard(segment, np.arange(120, 220), _clustered(rng, 100), MODEL, "t")  # 30 of them sealed already
    held_once()
    assert live.snapshot.sealed_blocks == 1 and live.snapshot.count == 220
    write_shard(segment, np.arange(200, 260), _clustered(rng, 60), MODEL, "t")
    held_once()
    assert live.snapshot.count == 260


@pytest.mark.parametrize("whole_rows", [False, True], ids=["projected", "format 1"])
def test_a_calls_ef_search_sets_the_graphs_width_for_that_call_alone(segment: Path, whole_rows: bool) -> None:
    rng = np.random.default_rng(4)
    write_shard(segment, np.arange(5000), _clustered(rng, 5000), MODEL, "t")
    seal(segment, whole_rows=whole_rows)
    queries = _clustered(rng, 200)
    want = _answers(Segment.open(segment, Indexing(exact=True)), queries)[1]
    live = Segment.open(segment, Indexing(ef_search=64))

    def recall(ef_search: int | None) -> float:
        got = live.snapshot.search(queries, 10, ef_search)[1]
        assert (got >= 0).all()  # never a short list, however narrow
        return float(np.mean([len(set(w) & set(g)) / 10 for w, g in zip(want.tolist(), got.tolist(), strict=True)]))

    default = recall(None)
    assert recall(1) < default < recall(512)
    assert recall(512) > 0.99
    assert recall(64) == default == recall(None)  # None is the loaded width, and a call's width did not stick
    _, wide = live.snapshot.search(queries[:3], 300, 1)  # k past the width: faiss's list is still k long
    assert (wide >= 0).all()


def _leave_one_out_recall(graph: faiss.Index, rows: np.ndarray, width: int, probes: np.ndarray) -> float:
    """Recall@10 of `graph` at `width` for rows asked as queries, each leaving itself out, against brute force."""
    params = faiss.SearchParametersHNSW()  # type: ignore[attr-defined]
    params.efSearch = width
    _, found = graph.search(rows[probes], 11, params=params)
    want = np.argsort(-(rows[probes] @ rows.T), axis=1)[:, :11]
    return float(np.mean([len((set(w) & set(g)) - {p}) / 10 for w, g, p in zip(want, found, probes, strict=True)]))


def _poor_graph(rows: np.ndarray) -> faiss.Index:
    """An HNSW graph built poorly (20 links, efConstruction 24) on one thread: the same graph every run."""
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        graph = faiss.IndexHNSWFlat(DIM, 20, faiss.METRIC_INNER_PRODUCT)
        graph.hnsw.efConstruction = 24
        graph.add(rows)
    finally:
        faiss.omp_set_num_threads(threads)
    return graph


def test_a_seal_measures_the_narrowest_width_that_finds_the_recall_target() -> None:
    """A graph built poorly (20 links, efConstruction 24) needs a wider search than one built well; each width
    chosen finds the target on its own rows, and the one below it does not."""
    rows = _clustered(np.random.default_rng(6), 20_000)
    poor = _poor_graph(rows)  # here: 512 wide
    good = faiss.IndexHNSWFlat(DIM, 32, faiss.METRIC_INNER_PRODUCT)
    good.add(rows)
    probes = np.random.default_rng(0).choice(len(rows), PROBES, replace=False)  # measured_width's own probes
    (narrow, at_narrow), (wide, at_wide) = measured_width(good, rows), measured_width(poor, rows)
    assert narrow == WIDTHS[0] < wide and min(at_narrow, at_wide) >= RECALL_TARGET
    assert _leave_one_out_recall(poor, rows, wide, probes) >= RECALL_TARGET
    below = WIDTHS[WIDTHS.index(wide) - 1]
    assert _leave_one_out_recall(poor, rows, below, probes) < RECALL_TARGET


def test_each_sealed_index_searches_at_its_measured_width_unless_the_setting_names_one(segment: Path) -> None:
    rng = np.random.default_rng(7)
    write_shard(segment, np.arange(3000), _clustered(rng, 3000), MODEL, "t")
    done = seal(segment)
    path = segment / INDEXES / str(done.name) / INDEX_JSON
    recorded = json.loads(path.read_text())
    assert recorded["ef_search"] == done.ef_search in WIDTHS and recorded["recall_at_ef_search"] >= RECALL_TARGET
    info = Segment.open(segment).describe()
    assert info["ef_search"] is None and info["sealed_ef_search"] == {done.name: done.ef_search}
    assert Segment.open(segment, Indexing(ef_search=64)).describe()["sealed_ef_search"] == {done.name: 64}

    def rewritten(edit: dict[str, object]) -> None:
        """index.json as a seal would have written it (its manifest too), with `edit` in it."""
        document = {key: value for key, value in recorded.items() if key != "ef_search"} | edit
        path.write_text(json.dumps(document))
        write_manifest(path.parent)

    rewritten({"ef_search": 600})  # as if measured at 600: the reader's graph walks that wide
    assert Segment.open(segment).describe()["sealed_ef_search"] == {done.name: 600}
    rewritten({})  # sealed before seals measured a width
    assert Segment.open(segment).describe()["sealed_ef_search"] == {done.name: LEGACY_EF_SEARCH}
    rewritten({"ef_search": "wide"})
    refused = Segment.open(segment).describe()  # a width that is no number: refused, its rows searched exactly
    assert refused["sealed_ef_search"] == {} and "ef_search" in refused["refused_indexes"][done.name]


def test_the_exact_setting_reads_no_sealed_index_and_answers_the_brute_force_ranking(segment: Path) -> None:
    rng = np.random.default_rng(1)
    rows = _clustered(rng, 4000)
    write_shard(segment, np.arange(4000), rows, MODEL, "t")
    seal(segment)
    queries = _clustered(rng, 100)
    exact = Segment.open(segment, Indexing(exact=True))
    assert exact.snapshot.sealed_blocks == 0 and exact.describe()["exact"] is True
    scores, ids = exact.snapshot.search(queries, 10)
    want = np.argsort(-(queries @ rows.T), axis=1)[:, :10]
    assert (ids == want).mean() > 0.999  # equal up to float ties
    graph = Segment.open(segment, Indexing(ef_search=64))
    _, got = graph.snapshot.search(queries, 10)
    recall = np.mean([len(set(w) & set(g)) / 10 for w, g in zip(want.tolist(), got.tolist(), strict=True)])
    assert recall > 0.9  # the sealed graph's approximation (docs/backfill.md measures it at 10^5)
    assert (graph.snapshot.search(rows[:50], 1)[1][:, 0] == np.arange(50)).all()  # each row finds itself


def test_a_seal_covers_only_uncovered_rows_and_not_below_its_minimum(segment: Path) -> None:
    rng = np.random.default_rng(2)
    write_shard(segment, np.arange(100), _clustered(rng, 100), MODEL, "t")
    assert seal(segment, min_rows=101).name is None and sealed_names(segment) == []
    first = seal(segment, min_rows=100)
    assert first.rows == 100
    write_shard(segment, np.arange(50, 150), _clustered(rng, 100), MODEL, "t")  # 50 ids moved twice
    second = seal(segment)
    assert second.rows == 50 and second.shards == 1  # ids 100..149: the others are covered already
    assert seal(segment).name is None  # nothing left uncovered
    snap = Segment.open(segment).snapshot
    _, ids = snap.search(_clustered(rng, 20), 150)
    found = [[i for i in row if i >= 0] for row in ids.tolist()]
    assert all(len(set(row)) == len(row) for row in found)  # no id twice in one answer
    assert all(len(row) > 100 for row in found)


def test_a_damaged_sealed_index_is_refused_and_its_rows_are_searched_exactly(segment: Path) -> None:
    rng = np.random.default_rng(3)
    rows = _clustered(rng, 2000)
    write_shard(segment, np.arange(2000), rows, MODEL, "t")
    name = seal(segment).name
    assert name is not None
    path = segment / INDEXES / name / INDEX_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    served = Segment.open(segment)
    assert list(served.refused_indexes) == [name] and "sha256" in served.refused_indexes[name]
    assert served.snapshot.sealed_blocks == 0 and served.snapshot.count == 2000
    queries = _clustered(rng, 30)
    want = np.argsort(-(queries @ rows.T), axis=1)[:, :5]
    assert (served.snapshot.search(queries, 5)[1] == want).mean() > 0.999


def test_rows_a_new_sealed_index_leaves_out_stay_searched_after_the_cover_changes(segment: Path) -> None:
    rng = np.random.default_rng(5)
    rows = _clustered(rng, 600)
    first = write_shard(segment, np.arange(300), rows[:300], MODEL, "t")
    second = write_shard(segment, np.arange(300, 600), rows[300:], MODEL, "t")
    live = Segment.open(segment)  # both shards in its exact part
    # A seal that saw only the first shard (the second was published while it scanned).
    hidden = segment / "shards" / f".{second}.tmp"
    (segment / "shards" / second).rename(hidden)
    assert seal(segment).shards == 1
    hidden.rename(segment / "shards" / second)
    live.refresh()
    assert live.snapshot.sealed_blocks == 1 and live.snapshot.count == 600
    _, ids = live.snapshot.search(rows[300:310], 1)
    assert ids[:, 0].tolist() == list(range(300, 310))  # the second shard's rows are still found
    at_once = Segment.open(segment)
    np.testing.assert_array_equal(live.snapshot.search(rows[::7], 10)[1], at_once.snapshot.search(rows[::7], 10)[1])
    assert first in live.snapshot.shards


def _in_few_directions(rng: np.random.Generator, n: int, dim: int = 64, spanned: int = 12) -> np.ndarray:
    """Clustered unit rows of `dim` floats that nearly lie in `spanned` directions, as embeddings do."""
    mixing = np.linalg.qr(rng.standard_normal((dim, spanned)))[0].T.astype(np.float32)
    centres = rng.standard_normal((30, spanned)).astype(np.float32)
    rows = (centres[rng.integers(0, 30, n)] + 0.3 * rng.standard_normal((n, spanned)).astype(np.float32)) @ mixing
    rows += 0.02 * rng.standard_normal((n, dim)).astype(np.float32)  # a little length outside them
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def test_the_graph_walks_the_rows_principal_directions_and_the_whole_rows_rank_its_answer(tmp_path: Path) -> None:
    model = ModelIdentity("synthetic-new", "synthetic-new", None, 64)
    create_segment(tmp_path / "seg", model, GALLERY)
    rng = np.random.default_rng(11)
    rows = _in_few_directions(rng, 3000)
    write_shard(tmp_path / "seg", np.arange(3000) * 3, rows, model, "t")
    name = seal(tmp_path / "seg").name
    assert name is not None
    document = json.loads((tmp_path / "seg" / INDEXES / name / "index.json").read_text())
    assert document["format_version"] == 3 and document["directions"] == 16  # 12 spanned, rounded up to 16
    assert document["storage"] == "float16"
    graph = faiss.read_index(str(tmp_path / "seg" / INDEXES / name / "index.faiss"))
    assert isinstance(graph, faiss.IndexHNSWSQ)
    assert faiss.downcast_index(graph.storage).code_size == 2 * 16  # two bytes a coordinate
    served = Segment.open(tmp_path / "seg", Indexing(ef_search=64))
    queries = _in_few_directions(np.random.default_rng(11), 40)  # the same directions and centres
    scores, ids = served.snapshot.search(queries, 10)
    exact = queries @ rows.T
    want = np.argsort(-exact, axis=1)[:, :10] * 3
    assert np.mean([len(set(w) & set(g)) for w, g in zip(want.tolist(), ids.tolist(), strict=True)]) / 10 > 0.99
    np.testing.assert_allclose(scores, np.take_along_axis(exact, ids // 3, axis=1), rtol=1e-5)  # whole-row scores
    assert np.all(np.diff(scores, axis=1) <= 0)
    found, back = served.snapshot.rows_of(np.array([3, 4, 8997]))
    assert found.tolist() == [True, False, True]
    np.testing.assert_array_equal(back[found], rows[[1, 2999]])  # the cascade reads the rows back whole


def test_a_format_2_index_with_float32_coordinates_is_served_as_it_was(tmp_path: Path) -> None:
    model = ModelIdentity("synthetic-new", "synthetic-new", None, 64)
    rows = _in_few_directions(np.random.default_rng(14), 2000)
    queries = _in_few_directions(np.random.default_rng(14), 30)
    answers = {}
    for storage in ("float32", "float16"):
        folder = tmp_path / storage
        create_segment(folder, model, GALLERY)
        write_shard(folder, np.arange(2000), rows, model, "t")
        name = seal(folder, storage=storage).name  # float32: what seals wrote before, IndexHNSWFlat
        assert name is not None
        document = json.loads((folder / INDEXES / name / "index.json").read_text())
        assert (document["format_version"], document["storage"]) == ((2 if storage == "float32" else 3), storage)
        graph = faiss.read_index(str(folder / INDEXES / name / "index.faiss"))
        assert isinstance(graph, faiss.IndexHNSWSQ if storage == "float16" else faiss.IndexHNSWFlat)
        served = Segment.open(folder, Indexing(ef_search=64))
        assert served.snapshot.sealed_blocks == 1 and not served.refused_indexes
        answers[storage] = served.snapshot.search(queries, 5)
    want = np.argsort(-(queries @ rows.T), axis=1)[:, :5]
    for scores, ids in answers.values():
        assert (ids == want).mean() > 0.95
        np.testing.assert_allclose(scores, np.take_along_axis(queries @ rows.T, ids, axis=1), rtol=1e-5)


def test_an_index_sealed_before_directions_is_served_as_it_was(tmp_path: Path) -> None:
    model = ModelIdentity("synthetic-new", "synthetic-new", None, 64)
    create_segment(tmp_path / "seg", model, GALLERY)
    rows = _in_few_directions(np.random.default_rng(12), 2000)
    write_shard(tmp_path / "seg", np.arange(2000), rows, model, "t")
    name = seal(tmp_path / "seg", whole_rows=True).name
    assert name is not None
    assert not (tmp_path / "seg" / INDEXES / name / "basis.npy").exists()
    served = Segment.open(tmp_path / "seg")
    assert served.snapshot.sealed_blocks == 1 and not served.refused_indexes
    queries = _in_few_directions(np.random.default_rng(12), 30)
    want = np.argsort(-(queries @ rows.T), axis=1)[:, :5]
    assert (served.snapshot.search(queries, 5)[1] == want).mean() > 0.95


def test_a_seal_takes_in_the_smaller_indexes_and_a_serving_reader_moves_to_the_merged_one(segment: Path) -> None:
    rng = np.random.default_rng(13)
    rows = _clustered(rng, 2500)
    write_shard(segment, np.arange(1000), rows[:1000], MODEL, "t")
    first = seal(segment)
    live = Segment.open(segment)  # the service, serving the first index
    write_shard(segment, np.arange(1000, 1500), rows[1000:1500], MODEL, "t")
    second = seal(segment)  # 500 new rows: the index of 1,000 is larger, so it is kept apart
    assert second.absorbed == 0 and sealed_names(segment) == sorted([first.name, second.name])
    # 950 new ids, and ids 0..49 moved again (the first shard's rows stay theirs, as a once-read segment keeps them)
    again = np.concatenate([np.arange(50), np.arange(1500, 2450)])
    write_shard(segment, again, rows[1500:2500], MODEL, "t")
    third = seal(segment)
    assert third.absorbed == 2 and third.rows == 2450 and third.shards == 3  # 500 <= 950, then 1,000 <= 1,450
    assert [p.name for p in (segment / INDEXES).iterdir()] == [third.name]  # the two retired, nothing hidden left
    queries = _clustered(rng, 40)
    answers_before = live.snapshot.search(queries, 10)  # its loaded index outlives the files
    assert (answers_before[1] >= 0).all()
    live.refresh()
    assert live.snapshot.sealed_blocks == 1 and not live.refused_indexes and live.snapshot.count == 2450
    at_once = Segment.open(segment)
    np.testing.assert_array_equal(live.snapshot.search(queries, 10)[1], at_once.snapshot.search(queries, 10)[1])
    found, back = at_once.snapshot.rows_of(np.array([0, 49, 2449]))
    assert found.all()
    np.testing.assert_array_equal(back, rows[[0, 49, 2499]])


def test_the_cover_serves_a_merged_index_before_those_it_took_in_and_falls_back_when_it_cannot() -> None:
    merged = SealedMeta("b", frozenset({"s1", "s2"}), 20)
    older = SealedMeta("a", frozenset({"s1"}), 10)
    assert choose_cover([older, merged], {"s1", "s2"}) == [merged]
    assert choose_cover([older, merged], {"s1"}) == [older]  # s2 quarantined: the merged index covers nothing


def _query_recall(graph: faiss.Index, rows: np.ndarray, queries: np.ndarray, width: int) -> float:
    """Recall@10 of `graph` at `width` for these queries against brute force over the rows."""
    params = faiss.SearchParametersHNSW()  # type: ignore[attr-defined]
    params.efSearch = width
    _, found = graph.search(queries, 10, params=params)
    want = np.argsort(-(queries @ rows.T), axis=1)[:, :10]
    return float(np.mean([len(set(w) & set(g)) / 10 for w, g in zip(want, found, strict=True)]))


def test_given_served_queries_a_seal_measures_the_width_they_need() -> None:
    """Measured on served queries, the width is the one they need, narrower or wider than the own rows' (which
    aim at 0.997 to leave a margin): queries drawn like the data need less, queries off it more.  Each width
    reaches QUERY_RECALL_TARGET for its queries under brute force, and the width below it does not."""
    rows = _clustered(np.random.default_rng(6), 20_000)
    centres = np.random.default_rng(6).standard_normal((40, DIM)).astype(np.float32)  # _clustered's first draw
    graph = _poor_graph(rows)
    own, _ = measured_width(graph, rows)
    rng = np.random.default_rng(9)
    widths = {}
    for spread in (0.3, 0.7):  # the data's own spread around its centres, and more than twice it
        queries = centres[rng.integers(0, 40, 3000)] + spread * rng.standard_normal((3000, DIM)).astype(np.float32)
        queries /= np.linalg.norm(queries, axis=1, keepdims=True)
        width, recall = measured_width(graph, rows, queries=queries)
        asked = queries[np.random.default_rng(0).choice(len(queries), PROBES, replace=False)]
        assert recall >= QUERY_RECALL_TARGET and _query_recall(graph, rows, asked, width) >= QUERY_RECALL_TARGET
        if width > WIDTHS[0]:
            assert _query_recall(graph, rows, asked, WIDTHS[WIDTHS.index(width) - 1]) < QUERY_RECALL_TARGET
        widths[spread] = width
    assert widths[0.3] < own < widths[0.7]


def test_a_seal_given_queries_records_them_and_refuses_another_width(segment: Path) -> None:
    rng = np.random.default_rng(8)
    write_shard(segment, np.arange(3000), _clustered(rng, 3000), MODEL, "t")
    with pytest.raises(InputError, match="12-d queries, but the segment's rows are 16-d"):
        seal(segment, queries=np.ones((10, 12), dtype=np.float32))
    assert sealed_names(segment) == []  # nothing published
    done = seal(segment, queries=_clustered(rng, 50))
    recorded = json.loads((segment / INDEXES / str(done.name) / INDEX_JSON).read_text())
    assert recorded["width_probes"] == done.probes == "50 served queries"
    assert recorded["recall_at_ef_search"] >= QUERY_RECALL_TARGET
