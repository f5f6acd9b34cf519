"""The item store: written atomically, read-only lookups, identity, and one-line refusals."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from service.errors import ArtifactError, InputError
from service.items.store import DB_NAME, META_NAME, ItemStore, write_item_store
from service.vocabulary import Modality


def _store(tmp_path: Path, n: int = 1000) -> Path:
    out = tmp_path / "items"
    write_item_store(out, ((i * 3, f"text {i}") for i in range(n)), Modality.text, "test")
    return out


def test_lookups_return_values_in_order_and_none_for_unknown_ids(tmp_path: Path) -> None:
    store = ItemStore.open(_store(tmp_path))
    assert store.count == 1000 and store.modality is Modality.text
    assert store.get_many([6, 0, 7, 2997]) == ["text 2", "text 0", None, "text 999"]
    assert store.get_many(np.arange(0, 3000, 3)) == [f"text {i}" for i in range(1000)]  # past one SQL chunk
    assert store.ids().tolist() == list(range(0, 3000, 3))
    assert len(store.identity.sha256) == 64


def test_threads_each_get_their_own_connection(tmp_path: Path) -> None:
    store = ItemStore.open(_store(tmp_path))
    seen: list[list[str | None]] = []

    def look() -> None:
        seen.append(store.get_many([3, 9]))

    threads = [threading.Thread(target=look) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [["text 1", "text 3"]] * 4
    store.close()


def test_a_repeated_id_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    out = tmp_path / "items"
    with pytest.raises(InputError, match="item id 5 appears twice"):
        write_item_store(out, [(1, "a"), (5, "b"), (5, "c")], Modality.text, "test")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_an_existing_store_is_replaced_only_with_force(tmp_path: Path) -> None:
    out = _store(tmp_path, 10)
    with pytest.raises(InputError, match="already holds an item store"):
        write_item_store(out, [(1, "a")], Modality.text, "test")
    write_item_store(out, [(1, "a")], Modality.text, "test", force=True)
    assert ItemStore.open(out).count == 1


def test_an_edited_store_is_refused_in_one_line(tmp_path: Path) -> None:
    out = _store(tmp_path)
    db = out / DB_NAME
    data = bytearray(db.read_bytes())
    data[-100] ^= 0xFF
    db.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="sha256") as caught:
        ItemStore.open(out)
    assert "\n" not in caught.value.message


def test_a_folder_without_items_json_is_no_store(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match=f"no {META_NAME}"):
        ItemStore.open(tmp_path)
