"""`MilvusNewRows`: the new model's rows in a second Milvus collection, shared by the service's segment and
`backfill run`.

    NOBACKFILL_INDEX__MILVUS_NEW_COLLECTION=products_v2   a collection of nobackfill's own, same primary keys

An item has moved when its row is in that collection: the one definition of "moved" for the service,
`backfill run`, `backfill status` and the cut-over, read from Milvus itself (a count, the keys listed).

The collection is created by `backfill run --add-collection` with the user's collection's own primary
key and vector field names, its index type, build parameters and metric, at the new model's dim: an
alias switched to it (the cut-over) then serves the user's application with the same `anns_field`,
`output_fields` and search parameters.  Its dynamic field is on, and each row carries the scalar fields
its item had in the user's collection when it was copied (a later edit there is not followed; filters on
them still work, unindexed).  The collection property `nobackfill.segment` labels it with the new
model's identity and the gallery it sits beside, set in the one call that creates it: a collection of
another model, or one nobackfill did not create, is refused in one line.  The user's collection is only
read.

Milvus has no conditional insert: a write first asks which of its keys are there (a strongly consistent
get) and upserts only the others, so a re-run re-sends nothing that landed and a key is never held
twice.  Two writers racing on one key both upsert the same model's row of the same item: the last stays.
Counts and listings are read with Strong consistency (the rows just written are in them); searches use
the collection's own level, as the user's application does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from service.encoders.identity import ModelIdentity
from service.errors import ArtifactError, InputError
from service.index.base import Hits
from service.index.milvus import RANKING_METRICS, index_of, search_params, state_name, vector_field
from service.rows import F32, I64
from service.segment.in_store import StoreLabel, placed_rows, refuse_unless_ours

if TYPE_CHECKING:
    from service.settings import IndexSettings

log = logging.getLogger("nobackfill.segment")

LABEL_KEY = "nobackfill.segment"  # the collection property holding the StoreLabel (JSON)
PREFIX = "milvus-collection:"  # how --segment names it
LIST_PAGE = 10_000
# Creating a collection, its index and loading it: a server may take longer than one search's deadline.
CREATE_TIMEOUT_S = 120.0
# The build parameters an index description carries that a new index of the same type takes.
BUILD_PARAMS = ("nlist", "m", "nbits", "M", "efConstruction")
STRONG = "Strong"


@dataclass(frozen=True)
class Layout:
    """A collection's vector field, its dim, primary key, and its index (type, metric, build parameters)."""

    field: str
    dim: int
    primary: str
    index_type: str
    metric: str
    params: dict[str, Any]

    @property
    def nlist(self) -> int | None:
        """The IVF lists (None for a flat or graph index)."""
        nlist = self.params.get("nlist")
        return int(nlist) if nlist is not None else None


@dataclass(frozen=True)
class CollectionState:
    """The new collection as Milvus describes it: its layout and label."""

    layout: Layout
    label: StoreLabel | None

    @property
    def dim(self) -> int:
        """The new rows' width."""
        return self.layout.dim


class MilvusNewRows:
    """The new rows in a collection of nobackfill's own beside the user's, in the client's calls."""

    create_flag = "--add-collection"  # the `backfill run` flag that creates the collection

    def __init__(self, settings: IndexSettings, name: str) -> None:
        if not settings.milvus_uri or not settings.milvus_collection:
            raise InputError(
                "a Milvus segment needs NOBACKFILL_INDEX__MILVUS_URI and NOBACKFILL_INDEX__MILVUS_COLLECTION"
            )
        self.settings = settings
        self.collection = settings.milvus_collection  # the user's (old rows), or the alias the application reads
        self.name = name
        self.timeout_s = settings.milvus_timeout_s
        self.spec = f"{PREFIX}{name}"
        self.where = f"Milvus collection {name} (beside {self.collection})"
        self._old: Layout | None = None

    def old_layout(self, client: Any) -> Layout:
        """The user's collection's layout (read once: the gallery is frozen)."""
        if self._old is None:
            if not client.has_collection(self.collection, timeout=self.timeout_s):
                raise ArtifactError(f"{self.where}: no collection {self.collection!r}")
            self._old = self._layout(client, self.collection)
        return self._old

    def _layout(self, client: Any, name: str) -> Layout:
        """A collection's layout; ArtifactError in one line for one that is no gallery."""
        field, dim, primary = vector_field(client.describe_collection(name, timeout=self.timeout_s))
        index = index_of(client, name, field, self.timeout_s)
        if index is None:
            raise ArtifactError(f"{self.where}: collection {name!r} has no index on {field!r}")
        metric = str(index.get("metric_type", "")).upper()
        if metric not in RANKING_METRICS:
            raise ArtifactError(f"{self.where}: collection {name!r} ranks by {metric or 'an unknown metric'}, not IP "
                                "or COSINE")  # fmt: skip
        params = {key: index[key] for key in BUILD_PARAMS if key in index}
        return Layout(field, dim, primary, str(index.get("index_type", "AUTOINDEX")).upper(), metric, params)

    def state(self, client: Any) -> CollectionState | None:
        """The new collection's layout and label; None when it is not there yet."""
        if not client.has_collection(self.name, timeout=self.timeout_s):
            return None
        described = client.describe_collection(self.name, timeout=self.timeout_s)
        label = StoreLabel.parse((described.get("properties") or {}).get(LABEL_KEY), self.where)
        if label is None:  # not ours: say so before what its schema lacks
            return CollectionState(Layout("", 0, "", "", "", {}), None)
        return CollectionState(self._layout(client, self.name), label)

    def checked(self, client: Any, model: ModelIdentity, gallery: str) -> CollectionState | None:
        """state(), refused in one line unless the collection is nobackfill's, of `model`, beside `gallery`.

        Loaded when it is not (after a server's restart): it is nobackfill's own, whose load state nobody else
        relies on.
        """
        state = self.state(client)
        if state is None:
            return None
        unlabelled = (
            f"{self.where}: the collection exists but was not created by nobackfill (no {LABEL_KEY!r} "
            "property); name a new collection in NOBACKFILL_INDEX__MILVUS_NEW_COLLECTION"
        )
        refuse_unless_ours(self.where, state.label, state.dim, model, gallery, unlabelled=unlabelled, noun="collection")
        if state_name(client.get_load_state(self.name, timeout=self.timeout_s).get("state")) != "Loaded":
            client.load_collection(self.name, timeout=max(self.timeout_s, CREATE_TIMEOUT_S))
        return state

    def add(self, client: Any, model: ModelIdentity, gallery: str) -> None:
        """Create the collection, indexed and loaded, with its label; a no-op once it is there."""
        from pymilvus import DataType, MilvusClient

        if self.checked(client, model, gallery) is not None:
            return
        old = self.old_layout(client)
        schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=True)
        schema.add_field(old.primary, DataType.INT64, is_primary=True)
        schema.add_field(old.field, DataType.FLOAT_VECTOR, dim=model.dim)
        index = client.prepare_index_params()
        index.add_index(field_name=old.field, index_type=old.index_type, metric_type=old.metric, params=old.params)
        # The label rides on the call that creates the collection: there is never an unlabelled one of ours.
        client.create_collection(
            self.name,
            schema=schema,
            index_params=index,
            properties={LABEL_KEY: json.dumps(StoreLabel(model, gallery).value())},
            timeout=CREATE_TIMEOUT_S,
        )
        client.load_collection(self.name, timeout=CREATE_TIMEOUT_S)
        log.info("%s: created for %s (%s, %s)", self.where, model.model_id, old.index_type, old.metric)

    def _count(self, client: Any, name: str) -> int:
        """Rows of a collection (count(*), strongly consistent)."""
        found = client.query(name, filter="", output_fields=["count(*)"], consistency_level=STRONG,
                             timeout=self.timeout_s)  # fmt: skip
        return int(found[0]["count(*)"])

    def rows(self, client: Any) -> int:
        """Rows of the user's collection (its items)."""
        return self._count(client, self.collection)

    def count(self, client: Any) -> int:
        """Rows of the new collection (moved items)."""
        return self._count(client, self.name)

    def moved(self, client: Any) -> I64:
        """Every moved id, ascending (iterated by key, ids only)."""
        primary = self.old_layout(client).primary
        pages = client.query_iterator(
            self.name, batch_size=LIST_PAGE, filter="", output_fields=[primary], consistency_level=STRONG,
            timeout=self.timeout_s,
        )  # fmt: skip
        found: list[int] = []
        try:
            while page := pages.next():
                found.extend(int(row[primary]) for row in page)
        finally:
            pages.close()
        return np.unique(np.array(found, dtype=np.int64))

    def moved_among(self, client: Any, ids: I64) -> npt.NDArray[np.bool_]:
        """Which of `ids` have moved (one get by key)."""
        return self.rows_of(client, ids, 0)[0]

    def rows_of(self, client: Any, ids: I64, dim: int) -> tuple[npt.NDArray[np.bool_], F32]:
        """Which of `ids` have moved, and their new rows (zero elsewhere; dim 0: only the keys are read)."""

        def fetch() -> Iterator[tuple[Any, Any]]:
            old = self.old_layout(client)
            got = client.get(
                self.name, ids=ids.tolist(), output_fields=[old.field] if dim else [old.primary],
                consistency_level=STRONG, timeout=self.timeout_s,
            )  # fmt: skip
            return ((row[old.primary], row[old.field] if dim else True) for row in got)

        return placed_rows(ids, dim, fetch)

    def write(self, client: Any, ids: I64, rows: F32) -> int:
        """Upsert the new row of each of `ids` not there yet, with its item's scalar fields; the rows sent."""
        if not len(ids):
            return 0
        fresh = ~self.moved_among(client, ids)
        ids, rows = ids[fresh], rows[fresh]
        if not len(ids):
            return 0
        old = self.old_layout(client)
        # The item's other fields as the user's collection holds them now, so the alias of the cut-over
        # serves whole entities (the old vector is not carried: the new row replaces it).
        others = {
            int(entity[old.primary]): {key: value for key, value in entity.items() if key != old.field}
            for entity in client.get(self.collection, ids=ids.tolist(), output_fields=["*"], timeout=self.timeout_s)
        }
        data = [
            {**others.get(int(i), {}), old.primary: int(i), old.field: row.tolist()}
            for i, row in zip(ids.tolist(), rows, strict=True)
        ]
        client.upsert(self.name, data=data, timeout=max(self.timeout_s, CREATE_TIMEOUT_S))
        return len(ids)

    def search(self, client: Any, state: CollectionState, queries: F32, k: int, nprobe: int | None) -> Hits:
        """Top-k of the moved items by the collection's index, as cosines: (scores, ids; -inf / -1 pad)."""
        layout = state.layout
        probes = min(nprobe or 1, layout.nlist or nprobe or 1)
        found = client.search(
            self.name,
            data=queries,
            limit=k,
            anns_field=layout.field,
            output_fields=[layout.primary],
            search_params=search_params(layout.index_type, layout.metric, k, probes),
            timeout=self.timeout_s,
        )
        scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
        ids = np.full((len(queries), k), -1, dtype=np.int64)
        for row, hits in enumerate(found):
            n = min(len(hits), k)
            ids[row, :n] = [hit[layout.primary] for hit in hits[:n]]
            scores[row, :n] = [hit["distance"] for hit in hits[:n]]  # IP or COSINE of unit rows: a cosine
        return scores, ids


def new_rows_of(settings: IndexSettings) -> MilvusNewRows | None:
    """The new rows the settings name (milvus_new_collection), or None."""
    if settings.milvus_new_collection is None:
        return None
    return MilvusNewRows(settings, settings.milvus_new_collection)
