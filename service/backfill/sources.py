"""Where `backfill run` reads the gallery's raw items: an item store, or a file in the formats `encode` reads.

Both give every gallery id in their own order ("given") and the values of any ids on request.  A
file is read once into memory (its values, or for images their paths): fine for 10^6 items; past
that, write an item store once (`nobackfill encode --items-out`) and backfill from it.  In a file,
input i (counted from 0 over the usable inputs) is gallery id i unless --ids IDS.npy gives one id
per input (or a JSONL --id-field does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from service.bulk.inputs import Bad, Blank, InputSpec, Item, input_spec, read_items
from service.errors import InputError
from service.items.store import META_NAME, ItemsIdentity, ItemStore
from service.rows import I64
from service.vocabulary import Modality


class ItemSource(Protocol):
    """The gallery's raw items: every id, and the value behind any of them."""

    @property
    def modality(self) -> Modality:
        """What the items are."""
        ...

    @property
    def where(self) -> str:
        """The store or file, for messages."""
        ...

    def ids(self) -> I64:
        """Every id, in the source's own order."""
        ...

    def values(self, ids: Sequence[int] | I64) -> list[str | None]:
        """The value of each id (None for one the source lacks)."""
        ...

    @property
    def identity(self) -> ItemsIdentity | None:
        """The item store's identity, None for a plain file."""
        ...


@dataclass
class StoreItems:
    """An item store (service/items/store.py)."""

    store: ItemStore

    @property
    def modality(self) -> Modality:
        """What the store's items are."""
        return self.store.modality

    @property
    def where(self) -> str:
        """The store's folder, for messages."""
        return str(self.store.folder)

    def ids(self) -> I64:
        """Every id, ascending."""
        return self.store.ids()

    def values(self, ids: Sequence[int] | I64) -> list[str | None]:
        """Looked up in the store."""
        return self.store.get_many(ids)

    @property
    def identity(self) -> ItemsIdentity | None:
        """Count and sha256 of the store."""
        return self.store.identity


class FileItems:
    """A text / JSONL file or an image folder / list, read once into memory."""

    identity: ItemsIdentity | None = None

    def __init__(self, spec: InputSpec, ids: I64 | None) -> None:
        self.modality = spec.modality
        self.where = str(spec.path)
        values: list[str] = []
        own_ids: list[int] = []
        for item in read_items(spec, check_images=True):
            if isinstance(item, Blank):
                continue
            if isinstance(item, Bad):
                raise InputError(f"{item.message()} (backfill needs every gallery item)")
            assert isinstance(item, Item)
            values.append(item.value)
            own_ids.append(item.id if item.id is not None else len(own_ids))
        if ids is not None:
            if len(ids) != len(values):
                raise InputError(f"--ids holds {len(ids):,} ids, but {spec.path} holds {len(values):,} usable inputs")
            own = np.asarray(ids, dtype=np.int64)
        else:
            own = np.asarray(own_ids, dtype=np.int64)
        if len(np.unique(own)) != len(own):
            raise InputError(f"{spec.path}: an id appears twice; each gallery item is listed once")
        self._ids = own
        self._value_of = dict(zip(own.tolist(), values, strict=True))

    def ids(self) -> I64:
        """Every id, in file order."""
        return self._ids

    def values(self, ids: Sequence[int] | I64) -> list[str | None]:
        """From the values read at the start."""
        return [self._value_of.get(int(i)) for i in ids]


def open_items(path: Path, modality: Modality, field: str | None, id_field: str | None, ids: Path | None) -> ItemSource:
    """An item store when `path` is one (items.json inside), else the file read as `encode` reads it."""
    if (path / META_NAME).is_file():
        if field is not None or id_field is not None or ids is not None:
            raise InputError(f"{path} is an item store: --field, --id-field and --ids apply to files")
        return StoreItems(ItemStore.open(path))
    given = None
    if ids is not None:
        try:
            given = np.load(ids, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise InputError(f"{ids}: cannot read ids ({exc})") from exc
        if given.ndim != 1 or not np.issubdtype(given.dtype, np.integer):
            raise InputError(f"{ids}: expected a 1-d array of integer ids, got {given.dtype} {given.shape}")
    return FileItems(input_spec(path, modality, field, id_field), given)
