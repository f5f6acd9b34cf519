"""What every segment kept in the user's own store says of itself: a pgvector column or side table, a Qdrant
named vector or collection, a Milvus collection.

Such a segment is one part (the column, the vector), refused whole at open when it is another model's,
and counts its moved rows in the store at each refresh; the model, the gallery it sits beside and the
gallery's size are fixed when it opens.  Each store's module keeps only what differs: how it checks,
counts, searches and writes (segment/pgvector_column.py, segment/qdrant_vector.py,
segment/milvus_collection.py).  A Qdrant or Milvus segment records whose rows it holds in a StoreLabel
(the collection's metadata or properties), so another model's rows are refused in one line, and
answers through one client object: ClientSegment holds it, and turns the client's errors into 503s.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Self, TypeVar

import numpy as np
import numpy.typing as npt

from service.encoders.identity import ModelIdentity
from service.errors import ArtifactError, InputError, NobackfillError
from service.index.base import Exclusion, Hits, store_errors
from service.rows import F32, I64
from service.segment.base import SegmentView


@dataclass(frozen=True)
class StoreLabel:
    """What a store's metadata records of the new rows: the new model, and the gallery (old rows) they sit beside."""

    model: ModelIdentity
    gallery: str  # the gallery's fingerprint

    def value(self) -> dict[str, Any]:
        """The metadata value (JSON)."""
        return {"model": self.model.as_dict(), "gallery": self.gallery}

    @classmethod
    def parse(cls, value: Any, where: str) -> StoreLabel | None:
        """The label in a metadata value; None when it is not nobackfill's."""
        if isinstance(value, str):  # a label written as text (Milvus's properties are strings; or by hand)
            try:
                value = json.loads(value)
            except ValueError:
                return None
        if not isinstance(value, dict) or not isinstance(value.get("model"), dict):
            return None
        return cls(ModelIdentity.from_dict(value["model"], where), str(value.get("gallery", "")))


log = logging.getLogger("nobackfill.segment")


def refuse_unless_ours(
    where: str, label: Any, dim: int, model: ModelIdentity, gallery: str, *, unlabelled: str, noun: str, shape: str = ""
) -> None:
    """One ArtifactError line unless the part holds `model`'s rows beside `gallery`: its label (a StoreLabel, or
    pgvector's ColumnLabel: both have `model` and `gallery`; None: `unlabelled`, not nobackfill's) and its width.
    `noun` names the part ("column", "vector", "collection"), `shape` how the store words its width."""
    if label is None:
        raise ArtifactError(unlabelled)
    if not label.model.same_model(model):
        raise ArtifactError(
            f"{where} holds rows of {label.model.model_id} (dim {label.model.dim}), "
            f"not of the new model {model.model_id} (dim {model.dim}); name another {noun} for this model"
        )
    if label.gallery != gallery:
        raise ArtifactError(f"{where} was filled beside another gallery ({label.gallery[:12]}...)")
    if dim != model.dim:
        raise ArtifactError(f"{where} {shape or f'has dim {dim}'}, but the new model's dim is {model.dim}")


def refuse_unless_all_moved(rows: Any, handle: Any, noun: str, unit: str = "rows") -> None:
    """The cut-over's InputError unless `rows` (a store's new-rows object, read through `handle`: a connection or
    a client) is nobackfill's `noun` and every item of the user's table or collection has its new row."""
    cut_over_label(rows.state(handle), rows.where, noun, InputError)
    total, moved = rows.rows(handle), rows.count(handle)
    then = f"the cut-over needs every {unit.removesuffix('s')} (`backfill run` moves the rest)"
    refuse_unless_every_row(rows.where, moved, total, unit, then, InputError)


# What a segment opened after the cut-over (the gallery retired) says when some items have not moved yet.
SERVE_ONCE_DONE = "cut over (NOBACKFILL_OLD__BACKEND=none) once `nobackfill backfill status` says 100 %"


def cut_over_label(state: Any, where: str, noun: str, error: type[NobackfillError]) -> Any:
    """The label of the part a cut-over goes to (`state`: a new-rows object's; None before the part exists), or one
    `error` line when there is no part or nobackfill did not label it.

    The cut-over's command (InputError) and the segment opened after it (ArtifactError) check alike; the
    count is checked apart (refuse_unless_every_row): the segment reads it only once opened.
    """
    if state is None or state.label is None:
        raise error(f"{where}: no nobackfill {noun} to cut over to")
    return state.label


def refuse_unless_every_row(
    where: str, moved: int, total: int, unit: str, then: str, error: type[NobackfillError], *, whose: str = ""
) -> None:
    """One `error` line unless all `total` items have moved: how many have, and `then` (what to do about it).
    `whose` names the total's owner ("the table's ") where the line says so."""
    if moved < total:
        raise error(f"{where} holds {moved:,} of {whose}{total:,} {unit} ({moved / total:.1%}); {then}")


def placed_rows(
    ids: I64, dim: int, fetch: Callable[[], Iterable[tuple[Any, Any]]]
) -> tuple[npt.NDArray[np.bool_], F32]:
    """Which of `ids` a store holds, and their rows in `ids`' order (zero elsewhere; dim 0: none are read).

    fetch() asks the store once (not at all for no ids) and yields (id, row) for what it found, in any order;
    a row None is an item without one."""
    found = np.zeros(len(ids), dtype=bool)
    rows = np.zeros((len(ids), dim), dtype=np.float32)
    if not len(ids):
        return found, rows
    where = {int(i): n for n, i in enumerate(ids.tolist())}
    for item_id, row in fetch():
        if row is None:
            continue
        n = where[int(item_id)]
        found[n] = True
        if dim:
            rows[n] = row
    return found, rows


S = TypeVar("S")  # the store's description of the part (its dim, label, index), None until it exists
T = TypeVar("T")


class InStoreSegment(Generic[S]):
    """The SegmentStore properties (segment/base.py) a segment in the user's store shares with every other."""

    backend: str  # what /v1/info calls it: "pgvector-column", "qdrant-vector", "milvus-collection"
    snapshot: SegmentView
    takes_ef_search: ClassVar[bool] = True  # search_ef is an HNSW ef, so a request's ef_search replaces it

    def __init__(self, model: ModelIdentity, gallery: str, ntotal: int) -> None:
        self._model = model
        self._gallery = gallery  # the fingerprint of the gallery (the old rows) it was filled beside
        self._ntotal = ntotal
        self._state: S | None = None  # None until the part exists in the store

    @property
    def replaced(self) -> str:
        """The fingerprint of the gallery this segment was filled beside (what the cut-over retires)."""
        return self._gallery

    @property
    def model(self) -> ModelIdentity:
        """The new model."""
        return self._model

    @property
    def dim(self) -> int:
        """The new model's width."""
        return self._model.dim

    @property
    def gallery_items(self) -> int:
        """Rows (points) of the gallery."""
        return self._ntotal

    @property
    def coverage(self) -> float:
        """Share of the gallery's rows that have moved (at the last refresh)."""
        return self.snapshot.count / self._ntotal

    @property
    def parts(self) -> int:
        """One part (a column, a vector, a collection), once it exists."""
        return int(self._state is not None)

    @property
    def refused(self) -> dict[str, str]:
        """One part has no parts to refuse one by one: a wrong one is refused whole, at open."""
        return {}

    def described(self, where: dict[str, Any], index: str | None) -> dict[str, Any]:
        """describe() (what /v1/info reports), one layout for every store: the backend, where the part is, whether it
        exists, the model, how much has moved, and how it is indexed."""
        return {
            "backend": self.backend,
            **where,
            "created": self._state is not None,
            "model": self._model.as_dict(),
            "moved": self.snapshot.count,
            "gallery_items": self._ntotal,
            "coverage": round(self.coverage, 6),
            "index": index,
        }


@dataclass(frozen=True)
class InStoreView:
    """A segment in the user's store as one request reads it (segment/base.py's SegmentView): live calls to the
    store, and the count of the last refresh.

    `segment` runs work(rows, connection, state) on its connection (`run`, empty before the part exists) and
    says the new model's `dim` and the index's `search_ef`; every store's rows answer `search`,
    `moved_among` and `rows_of` with the same signatures.
    """

    segment: Any
    moved_count: int
    exclusion: Exclusion | None

    @property
    def count(self) -> int:
        """Moved items at the last refresh."""
        return self.moved_count

    def search(self, queries: F32, k: int, ef_search: int | None = None) -> Hits:
        """Top-k over the moved rows (none before the part exists), at the request's ef_search where the store's
        index takes one."""
        nothing = (np.full((len(queries), k), -np.inf, np.float32), np.full((len(queries), k), -1, np.int64))
        takes = ef_search is not None and self.segment.takes_ef_search
        ef = ef_search if takes else self.segment.search_ef
        hits: Hits = self.segment.run(lambda rows, conn, state: rows.search(conn, state, queries, k, ef), empty=nothing)
        return hits

    def contains(self, ids: I64) -> npt.NDArray[np.bool_]:
        """Which of `ids` have moved."""
        found: npt.NDArray[np.bool_] = self.segment.run(
            lambda rows, conn, _: rows.moved_among(conn, ids), empty=np.zeros(len(ids), bool)
        )
        return found

    def rows_of(self, ids: I64) -> tuple[npt.NDArray[np.bool_], F32]:
        """Which of `ids` have moved, and their new rows."""
        dim = self.segment.dim
        nothing = (np.zeros(len(ids), dtype=bool), np.zeros((len(ids), dim), dtype=np.float32))
        rows: tuple[npt.NDArray[np.bool_], F32] = self.segment.run(
            lambda store, conn, _: store.rows_of(conn, ids, dim), empty=nothing
        )
        return rows


class ClientSegment(InStoreSegment[S]):
    """A segment in a store answered through one client object (Qdrant, Milvus): opening it, the cut-over's check
    that every row has moved, a call on the client with its errors as 503s, the cascade's write, closing.

    A subclass names its store and the unit of its rows, says how to connect (`connect`), how wide its index
    searches (`search_ef_of`) and how to refresh (`refresh`: check the part, count or list what moved, set
    `snapshot`).  `rows` is the store's new-rows object (segment/qdrant_rows.py, segment/milvus_rows.py):
    `where`, `name`, `settings`, `create_flag`, `state`, `rows`, `checked`, `write`.
    """

    store: ClassVar[str]  # in messages: "Qdrant", "Milvus"
    unit: ClassVar[str] = "rows"  # what the store calls a row, in messages

    def __init__(self, new_rows: Any, model: ModelIdentity, gallery: str, ntotal: int, client: Any, *, owned: bool):
        self.rows = new_rows
        self.search_ef: int | None = self.search_ef_of(new_rows.settings)
        self._client = client
        self._owned = owned  # closed here only when not the gallery's
        super().__init__(model, gallery, ntotal)
        self.snapshot = InStoreView(self, 0, None)

    @staticmethod
    def connect(settings: Any) -> Any:
        """A client of its own, for the cut-over (before it, the segment shares the gallery's)."""
        raise NotImplementedError

    @staticmethod
    def search_ef_of(settings: Any) -> int | None:
        """How wide a search of the new rows looks (InStoreView passes it to the rows' `search`; None: the
        index's own setting)."""
        raise NotImplementedError

    def refresh(self) -> list[str]:
        """Check the part (it may have been created since) and read what moved; [name] when rows arrived."""
        raise NotImplementedError

    @classmethod
    def open(cls, new_rows: Any, model: ModelIdentity, gallery: str, ntotal: int, client: Any, *, owned: bool) -> Self:
        """The new rows beside the gallery, refreshed once; one ArtifactError line for another model's."""
        segment = cls(new_rows, model, gallery, ntotal, client, owned=owned)
        try:
            segment.refresh()
        except BaseException:
            segment.close()
            raise
        return segment

    @classmethod
    def finished(cls, new_rows: Any, model: ModelIdentity) -> Self:
        """After the cut-over: `model`'s rows for every item of the user's collection, else one ArtifactError line.

        The gallery it sat beside is not checked (it is retired): the model and the count are.
        """
        client = cls.connect(new_rows.settings)
        try:
            with store_errors(f"cannot reach {cls.store} for {new_rows.where}"):
                label = cut_over_label(new_rows.state(client), new_rows.where, "segment", ArtifactError)
                ntotal = new_rows.rows(client)
        except Exception:
            client.close()
            raise
        segment = cls.open(new_rows, model, label.gallery, ntotal, client, owned=True)
        try:
            refuse_unless_every_row(
                new_rows.where, segment.snapshot.count, ntotal, cls.unit, SERVE_ONCE_DONE, ArtifactError,
                whose="the collection's ",
            )  # fmt: skip
        except ArtifactError:
            segment.close()
            raise
        return segment

    @property
    def where(self) -> str:
        """The collection (and vector); never a token."""
        where: str = self.rows.where
        return where

    @property
    def create_flag(self) -> str:
        """The `backfill run` flag that creates the part."""
        flag: str = self.rows.create_flag
        return flag

    def answering(self) -> AbstractContextManager[None]:
        """The block's client errors as one 503 (GalleryUnavailable) line naming this segment."""
        return store_errors(f"the {self.store} segment did not answer ({self.where})")

    def run(self, work: Callable[[Any, Any, S], T], empty: T) -> T:
        """work(rows, client, state); 503 (GalleryUnavailable) when the store does not answer."""
        state = self._state
        if state is None:  # not created yet: nothing has moved
            return empty
        with self.answering():
            return work(self.rows, self._client, state)

    def write(self, ids: I64, rows: F32, writer: str) -> None:
        """The cascade's rows; the service never creates the part (no change without the operator's consent)."""
        if self._state is None:
            raise ArtifactError(f"{self.where}: not there yet; `nobackfill backfill run {self.create_flag}` adds it")
        self.rows.write(self._client, ids, rows)
        log.debug("%s: %d rows written by %s", self.where, len(ids), writer)

    def close(self) -> None:
        """Close the client when it is this segment's own (after the cut-over); the gallery closes a shared one."""
        if self._owned:
            self._client.close()
