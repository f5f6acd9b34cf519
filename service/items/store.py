"""The item store: gallery id -> raw item (a text, or an image file's path), in one read-only SQLite file.

    ITEMS_STORE/
        items.sqlite    table items(id INTEGER PRIMARY KEY, value TEXT NOT NULL), ids in the gallery's id space
        items.json      format, count, modality, smallest / largest id, the source it was read from
        manifest.json   size and sha256 of both (service/manifest.py)

Written once, into a hidden sibling folder that is renamed into place when complete (atomic_dir.py),
so an interrupted write never leaves a store.  Opened read-only and `immutable` (SQLite then takes no
locks and never looks for a journal), with one connection per thread.  Its identity -- count and the
sha256 of items.sqlite -- is what `gallery build` records and the service compares.
Why SQLite: one file, random lookups by integer key in a B-tree (docs/benchmarks.md has the timings
at 10^7 items), and every Python has it.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

import service
from service import atomic_dir
from service.atomic_dir import staging
from service.errors import ArtifactError, InputError
from service.json_file import read_json_object
from service.manifest import verify_manifest, write_json_durably, write_manifest
from service.vocabulary import Modality

DB_NAME = "items.sqlite"
META_NAME = "items.json"
WHAT = "an item store"
FORMAT_VERSION = 1
# SQLite binds at most 32,766 parameters per statement; lookups go in chunks well below that.
_LOOKUP_CHUNK = 900
_INSERT_CHUNK = 50_000
_MMAP_BYTES = 1 << 40


@dataclass(frozen=True)
class ItemsIdentity:
    """What other artifacts record of a store: how many items, and the sha256 of items.sqlite."""

    count: int
    sha256: str

    def as_dict(self) -> dict[str, Any]:
        """JSON form, as gallery.json records it."""
        return {"count": self.count, "sha256": self.sha256}


def write_item_store(
    out: Path, rows: Iterable[tuple[int, str]], modality: Modality, source: str, force: bool = False
) -> dict[str, Any]:
    """Write (id, value) rows as a store at `out`, atomically; InputError on a repeated id; returns items.json."""
    with staging(out, force=force, marker=META_NAME, what=WHAT) as tmp:
        db = sqlite3.connect(tmp / DB_NAME)
        try:
            # A private file being built: no journal, no syncs per statement (one fsync at the end).
            db.executescript(
                "PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF; "
                "CREATE TABLE items (id INTEGER PRIMARY KEY, value TEXT NOT NULL);"
            )
            count, low, high = _insert(db, rows)
            db.commit()
        finally:
            db.close()
        if count == 0:
            raise InputError(f"{out}: no items to store")
        meta = {
            "format_version": FORMAT_VERSION,
            "count": count,
            "modality": str(modality),
            "min_id": low,
            "max_id": high,
            "source": source,
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "nobackfill_version": service.__version__,
        }
        write_json_durably(tmp / META_NAME, meta)
        write_manifest(tmp)
    return meta


def _insert(db: sqlite3.Connection, rows: Iterable[tuple[int, str]]) -> tuple[int, int, int]:
    """Insert every row in chunks; returns (count, smallest id, largest id)."""
    count, low, high = 0, 2**63 - 1, -(2**63)
    chunk: list[tuple[int, str]] = []
    for item_id, value in rows:
        chunk.append((int(item_id), value))
        if len(chunk) == _INSERT_CHUNK:
            count, low, high = _flush(db, chunk, count, low, high)
            chunk = []
    if chunk:
        count, low, high = _flush(db, chunk, count, low, high)
    return count, low, high


def _flush(
    db: sqlite3.Connection, chunk: list[tuple[int, str]], count: int, low: int, high: int
) -> tuple[int, int, int]:
    """One executemany; a repeated id is one InputError line naming it."""
    try:
        db.executemany("INSERT INTO items (id, value) VALUES (?, ?)", chunk)
    except sqlite3.IntegrityError:
        raise InputError(
            f"item id {_repeated(db, chunk)} appears twice; an item store holds each gallery id once"
        ) from None
    ids = [i for i, _ in chunk]
    return count + len(chunk), min(low, *ids), max(high, *ids)


def _repeated(db: sqlite3.Connection, chunk: list[tuple[int, str]]) -> int:
    """The first id of `chunk` seen earlier in the chunk or already in the store (the chunk's rows rolled back)."""
    seen: set[int] = set()
    for item_id, _ in chunk:
        if item_id in seen:
            return item_id
        seen.add(item_id)
    return next(i for i, _ in chunk if db.execute("SELECT 1 FROM items WHERE id = ?", (i,)).fetchone())


def check_output(out: Path, force: bool) -> None:
    """Refuse an output that holds something other than an item store, or a store without `force`."""
    atomic_dir.check_output(out, force, marker=META_NAME, what=WHAT)


class ItemStore:
    """A store opened read-only: lookups by id from any thread."""

    def __init__(self, folder: Path, meta: dict[str, Any], sha256: str) -> None:
        self.folder = folder
        self.meta = meta
        self.identity = ItemsIdentity(int(meta["count"]), sha256)
        self.modality = Modality(meta["modality"])
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()

    @classmethod
    def open(cls, folder: Path | str) -> ItemStore:
        """Check the manifest and items.json, then open items.sqlite read-only; ArtifactError in one line."""
        folder = Path(folder)
        if not (folder / META_NAME).is_file():
            raise ArtifactError(f"item store {folder}: no {META_NAME} (not an item store, or an interrupted write)")
        signed = verify_manifest(folder)
        if signed is None:
            raise ArtifactError(f"item store {folder}: manifest.json is missing")
        meta = _read_meta(folder)
        store = cls(folder, meta, signed[DB_NAME])
        found = store._connection().execute("SELECT count(*) FROM items").fetchone()[0]
        if found != store.identity.count:
            raise ArtifactError(
                f"item store {folder}: {found} rows in {DB_NAME}, {META_NAME} says {store.identity.count}"
            )
        return store

    def _connection(self) -> sqlite3.Connection:
        """This thread's read-only connection (opened on first use)."""
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            uri = f"{(self.folder / DB_NAME).resolve().as_uri()}?mode=ro&immutable=1"
            try:
                db = sqlite3.connect(uri, uri=True, check_same_thread=False)
                # Pages through a memory map instead of read() calls: faster random lookups (the session that
                # chose it measured 0.9 -> 0.7 ms per 300 ids at 10^7 items; docs/benchmarks.md has a later
                # run), and the page cache holds one copy for every process.
                db.execute(f"PRAGMA mmap_size={_MMAP_BYTES}")
            except sqlite3.Error as exc:
                raise ArtifactError(f"item store {self.folder}: cannot open {DB_NAME} ({exc})") from exc
            self._local.db = db
            with self._lock:
                self._connections.append(db)
        return db

    @property
    def count(self) -> int:
        """How many items the store holds."""
        return self.identity.count

    def get_many(self, ids: Sequence[int] | npt.NDArray[np.int64]) -> list[str | None]:
        """The value of each id, in order; None for an id the store does not hold."""
        wanted = [int(i) for i in ids]
        found: dict[int, str] = {}
        db = self._connection()
        ordered = sorted(set(wanted))  # B-tree probes in key order touch neighbouring pages: ~20 % faster
        for start in range(0, len(ordered), _LOOKUP_CHUNK):
            chunk = ordered[start : start + _LOOKUP_CHUNK]
            marks = ",".join("?" * len(chunk))
            found.update(db.execute(f"SELECT id, value FROM items WHERE id IN ({marks})", chunk).fetchall())
        return [found.get(i) for i in wanted]

    def ids(self) -> npt.NDArray[np.int64]:
        """Every id, ascending."""
        rows = self._connection().execute("SELECT id FROM items ORDER BY id").fetchall()
        return np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))

    def iter_items(self, ids: Iterable[int], chunk: int = 1024) -> Iterator[list[tuple[int, str | None]]]:
        """(id, value) in the order of `ids`, `chunk` at a time."""
        batch: list[int] = []
        for item_id in ids:
            batch.append(int(item_id))
            if len(batch) == chunk:
                yield list(zip(batch, self.get_many(batch), strict=True))
                batch = []
        if batch:
            yield list(zip(batch, self.get_many(batch), strict=True))

    def describe(self) -> dict[str, Any]:
        """What /v1/info reports of the store."""
        return {"path": str(self.folder), "modality": str(self.modality), **self.identity.as_dict()}

    def close(self) -> None:
        """Close every thread's connection."""
        with self._lock:
            for db in self._connections:
                db.close()
            self._connections.clear()


def open_beside(folder: Path, ntotal: int, recorded: Any) -> ItemStore:
    """The item store behind a gallery of `ntotal` rows that recorded `recorded` (its identity, or None).

    ArtifactError in one line when it is another store (sha256) or holds another number of items.
    """
    store = ItemStore.open(folder)
    mine = store.identity
    if isinstance(recorded, dict) and recorded.get("sha256") not in (None, mine.sha256):
        store.close()
        raise ArtifactError(
            f"item store {folder} is {mine.sha256[:12]}... ({mine.count:,} items), but the gallery was built "
            f"from {str(recorded['sha256'])[:12]}... ({recorded.get('count')} items)"
        )
    if mine.count != ntotal:
        store.close()
        raise ArtifactError(f"item store {folder} holds {mine.count:,} items, but the gallery holds {ntotal:,}")
    return store


def _read_meta(folder: Path) -> dict[str, Any]:
    """items.json, checked for its fields; ArtifactError in one line naming it."""
    path = folder / META_NAME
    meta = read_json_object(path, str(path))
    if meta.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{path}: not a version-{FORMAT_VERSION} item store description")
    count = meta.get("count")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ArtifactError(f"{path}: count must be a positive integer, got {count!r}")
    if not Modality.has(meta.get("modality")):
        raise ArtifactError(f"{path}: modality must be one of {', '.join(Modality)}, got {meta.get('modality')!r}")
    return meta
