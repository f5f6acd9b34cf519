"""A request's ef_search reaches a store's segment search where the store's width is an HNSW ef (pgvector's
hnsw.ef_search, Qdrant's hnsw_ef), and not Milvus's, whose width is an IVF nprobe.

The segment here stands in for a store's (its `run` hands the store's rows object the call); the real stores'
searches at a given width are their own integration tests' (a real pgvector's: test_pgvector_migration.py's
recall at ef_search 1 and 1000 over the new column's HNSW index).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from service.segment.in_store import InStoreView
from service.segment.milvus_collection import MilvusCollectionSegment
from service.segment.pgvector_column import PgvectorColumnSegment
from service.segment.qdrant_vector import QdrantVectorSegment


class WidthRecorder:
    """The part of an in-store segment InStoreView reads, recording the width each search asks its store for."""

    def __init__(self, takes_ef_search: bool) -> None:
        self.takes_ef_search = takes_ef_search
        self.search_ef = 40  # the settings' width
        self.asked: list[int | None] = []

    def run(self, work: Any, empty: Any) -> Any:
        recorder = self

        class Rows:
            def search(self, *args: Any) -> Any:  # (conn, state, queries, k, the width)
                recorder.asked.append(args[-1])
                return empty

        return work(Rows(), None, None)


def test_the_requests_width_replaces_the_settings_where_the_store_takes_an_ef() -> None:
    queries = np.zeros((2, 4), dtype=np.float32)
    graph, lists = WidthRecorder(True), WidthRecorder(False)
    for segment in (graph, lists):
        view = InStoreView(segment, 0, None)
        view.search(queries, 10, 300)
        view.search(queries, 10)
    assert graph.asked == [300, 40] and lists.asked == [40, 40]


def test_which_stores_take_a_requests_ef_search() -> None:
    assert PgvectorColumnSegment.takes_ef_search and QdrantVectorSegment.takes_ef_search
    assert not MilvusCollectionSegment.takes_ef_search
