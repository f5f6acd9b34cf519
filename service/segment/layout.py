"""On-disk layout of a new-model segment: segment.json, and immutable shards published by one rename each.

    SEGMENT_DIR/
        segment.json            written once when the segment is created: the new model's identity, the
                                dim, and the frozen gallery it sits beside (fingerprint, item count)
        shards/
            <name>/             one shard, never changed once its name appears
                ids.npy         int64 [n]: gallery ids
                vectors.npy     float32 [n, dim]: the new model's unit rows for those ids
                shard.json      count, model identity, writer, time
                manifest.json   size and sha256 of the three (service/manifest.py)
            .<name>.tmp         a shard being written (hidden: readers never look at it)

A shard's name sorts by creation time and is unique across writers (time, host, pid, random), so the
service and `backfill run` can add shards to one segment at the same time without a lock.  An id may
be in two shards when two writers moved it at once; readers keep its first row (both rows come from
the same model and item).  A writer killed mid-shard leaves a hidden folder, which the next writer
on the same host removes once its process is gone.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

import service
from service.encoders.identity import ModelIdentity
from service.errors import ArtifactError, InputError
from service.json_file import read_json_object
from service.manifest import verify_manifest, write_json_durably, write_manifest
from service.rows import normalize_rows

SEGMENT_JSON = "segment.json"
SHARDS = "shards"
SHARD_JSON = "shard.json"
IDS = "ids.npy"
VECTORS = "vectors.npy"
FORMAT_VERSION = 1
_CHECK_ROWS = 1 << 15  # rows per block of read_shard's norm check
_UNIT_TOLERANCE = 1e-5  # a norm this close to 1 is float32 rounding of a unit row (read_shard allows 1e-3)


@dataclass(frozen=True)
class GalleryRef:
    """The frozen gallery a segment sits beside: its fingerprint and how many items it holds."""

    fingerprint: str
    ntotal: int

    def as_dict(self) -> dict[str, Any]:
        """JSON form, as segment.json records it."""
        return {"fingerprint": self.fingerprint, "ntotal": self.ntotal}


@dataclass(frozen=True)
class SegmentMeta:
    """The content of segment.json."""

    model: ModelIdentity
    gallery: GalleryRef
    created_at: str

    @property
    def dim(self) -> int:
        """Width of every row of the segment."""
        return self.model.dim


@dataclass(frozen=True)
class Shard:
    """One published shard, read and checked: its gallery ids and the new model's rows for them (memory-mapped)."""

    name: str
    ids: npt.NDArray[np.int64]
    vectors: npt.NDArray[np.float32]
    meta: dict[str, Any]


def create_segment(folder: Path, model: ModelIdentity, gallery: GalleryRef) -> SegmentMeta:
    """Create an empty segment (segment.json and shards/) or open an existing one that matches; one-line refusals."""
    if (folder / SEGMENT_JSON).is_file():
        meta = read_segment_meta(folder)
        check_same(meta, model, gallery, folder)
        return meta
    # shards/ and hidden temp files are what a writer killed while creating it leaves: it is created again.
    if folder.exists() and (not folder.is_dir() or any(not _creating(p.name) for p in folder.iterdir())):
        raise InputError(f"{folder}: exists and is not a segment; refusing to write into it")
    meta = SegmentMeta(model, gallery, datetime.now(UTC).isoformat(timespec="seconds"))
    try:
        (folder / SHARDS).mkdir(parents=True, exist_ok=True)
        document = {
            "format_version": FORMAT_VERSION,
            "model": model.as_dict(),
            "gallery": gallery.as_dict(),
            "created_at": meta.created_at,
            "nobackfill_version": service.__version__,
        }
        # Two writers creating one segment at once: the rename of the second replaces an identical file.
        write_json_durably(folder / SEGMENT_JSON, document)
    except OSError as exc:
        raise InputError(f"cannot create segment {folder}: {exc.strerror or exc}") from exc
    return meta


def _creating(name: str) -> bool:
    """Whether a file in a folder without segment.json is what create_segment writes on the way."""
    return name == SHARDS or (name.startswith(f".{SEGMENT_JSON}.") and name.endswith(".tmp"))


def check_same(meta: SegmentMeta, model: ModelIdentity, gallery: GalleryRef, folder: Path) -> None:
    """Refuse a model or gallery other than the ones the segment was created for, in one line."""
    if not meta.model.same_model(model):
        raise InputError(
            f"segment {folder} holds rows of {meta.model.backend} {meta.model.model_id} (dim {meta.model.dim}), "
            f"not of {model.backend} {model.model_id} (dim {model.dim}); one segment holds one model's rows"
        )
    if meta.gallery != gallery:
        raise InputError(
            f"segment {folder} sits beside gallery {meta.gallery.fingerprint[:12]}... ({meta.gallery.ntotal:,} items), "
            f"not {gallery.fingerprint[:12]}... ({gallery.ntotal:,} items)"
        )


def read_segment_meta(folder: Path) -> SegmentMeta:
    """segment.json, checked; ArtifactError in one line naming it."""
    path = folder / SEGMENT_JSON
    if not path.is_file():
        raise ArtifactError(f"segment {folder}: no {SEGMENT_JSON} (not a segment)")
    data = read_json_object(path, str(path))
    if data.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{path}: format version {data.get('format_version')!r}, this build reads {FORMAT_VERSION}")
    model = ModelIdentity.from_dict(data.get("model"), f"{path} (model)")
    gallery = data.get("gallery")
    if not isinstance(gallery, dict) or not isinstance(gallery.get("fingerprint"), str):
        raise ArtifactError(f"{path}: gallery must be an object with a fingerprint")
    ntotal = gallery.get("ntotal")
    if isinstance(ntotal, bool) or not isinstance(ntotal, int) or ntotal < 1:
        raise ArtifactError(f"{path}: gallery ntotal must be a positive integer, got {ntotal!r}")
    return SegmentMeta(model, GalleryRef(gallery["fingerprint"], ntotal), str(data.get("created_at", "")))


def shard_names(folder: Path) -> list[str]:
    """Names of the published shards, oldest first (hidden folders are shards being written)."""
    shards = folder / SHARDS
    try:
        return sorted(p.name for p in shards.iterdir() if p.is_dir() and not p.name.startswith("."))
    except FileNotFoundError:
        return []


def new_shard_name() -> str:
    """A name that sorts by creation time and no other writer can pick: ns clock, host, pid, random."""
    host = "".join(c for c in socket.gethostname() if c.isalnum())[:16] or "host"
    return f"{time.time_ns():020d}-{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def write_shard(
    folder: Path, ids: npt.NDArray[np.int64], vectors: npt.NDArray[np.float32], model: ModelIdentity, writer: str
) -> str:
    """Publish one shard: written hidden, fsynced, manifest last, then one rename; returns its name.

    The rows are normalised here, whoever encoded them (a plug-in encoder may return rows of any
    norm), and a row with no direction (all zero, or not finite) is refused: nothing is published
    that read_shard would refuse, so nothing counts as moved that the service does not serve.
    """
    if len(ids) == 0 or vectors.ndim != 2 or vectors.shape != (len(ids), model.dim):
        raise InputError(f"a shard needs rows of [n >= 1, {model.dim}], got ids {len(ids)} and rows {vectors.shape}")
    vectors = unit_rows(vectors)
    no_direction = ~vectors.any(axis=1)
    if no_direction.any():
        raise InputError(
            f"a shard's rows must have a direction: {int(no_direction.sum())} of {len(ids)} are all zero or not "
            f"finite (first: gallery id {int(ids[np.argmax(no_direction)])}); such items stay on the old gallery"
        )

    def fill(tmp: Path) -> None:
        save(tmp / IDS, np.ascontiguousarray(ids, dtype=np.int64))
        save(tmp / VECTORS, np.ascontiguousarray(vectors, dtype=np.float32))
        meta = {
            "format_version": FORMAT_VERSION,
            "count": int(len(ids)),
            "model": model.as_dict(),
            "writer": writer,
            "pid": os.getpid(),
            "created_at": datetime.now(UTC).isoformat(timespec="milliseconds"),
        }
        write_json_durably(tmp / SHARD_JSON, meta)

    return publish_folder(folder / SHARDS, fill, "a shard")


def publish_folder(parent: Path, fill: Callable[[Path], None], what: str) -> str:
    """A new folder in `parent`, published by one rename; returns its name (new_shard_name: unique, time-sorted).

    `fill` writes the files into the hidden `.<name>.tmp` (which remove_abandoned knows), the manifest
    is written last, then the rename and an fsync of `parent`: a reader sees the whole folder or none.
    Shards and sealed indexes (segment/sealed.py) are published so.
    """
    name = new_shard_name()
    tmp = parent / f".{name}.tmp"
    try:
        tmp.mkdir(parents=True)
        fill(tmp)
        write_manifest(tmp)
        os.rename(tmp, parent / name)
        fsync_path(parent)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise InputError(f"cannot write {what} into {parent}: {exc.strerror or exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return name


def unit_rows(vectors: npt.NDArray[np.floating[Any]]) -> npt.NDArray[np.float32]:
    """float32 unit rows: a row already unit to float32 rounding is kept bit for bit (the encoder's own
    row, so a re-run writes the bytes the first run wrote); any other is normalised, and one without a
    direction (all zero, not finite) comes back all zero."""
    rows = np.asarray(vectors, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        norms = np.linalg.norm(rows, axis=1)
    off = ~(np.abs(norms - 1.0) <= _UNIT_TOLERANCE)  # NaN norms count as off
    if not off.any():
        return rows
    out = rows.copy()
    out[off] = normalize_rows(rows[off])
    return out


def save(path: Path, array: npt.NDArray[Any]) -> None:
    """np.save and fsync: a shard is renamed into place only once its bytes are on disk."""
    with path.open("wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def fsync_path(path: Path) -> None:
    """fsync a file, or a folder (a rename in it is then durable), by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_shard(folder: Path, name: str, dim: int) -> Shard:
    """Load and check one shard (manifest, shapes, finite unit rows); ArtifactError in one line naming it."""
    path = folder / SHARDS / name
    if verify_manifest(path) is None:
        raise ArtifactError(f"shard {path}: manifest.json is missing")
    meta = read_json_object(path / SHARD_JSON, str(path / SHARD_JSON))
    try:
        ids = np.load(path / IDS, allow_pickle=False)
        vectors = np.load(path / VECTORS, mmap_mode="r", allow_pickle=False)  # checked in blocks, kept mapped
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"shard {path}: unreadable ({exc})") from exc
    count = meta.get("count")
    if ids.dtype != np.int64 or ids.ndim != 1 or len(ids) != count:
        raise ArtifactError(f"shard {path}: {IDS} is not {count!r} int64 ids")
    if vectors.dtype != np.float32 or vectors.shape != (len(ids), dim):
        raise ArtifactError(
            f"shard {path}: {VECTORS} is {vectors.dtype} {vectors.shape}, expected float32 ({len(ids)}, {dim})"
        )
    if not _unit_rows(vectors):
        raise ArtifactError(f"shard {path}: {VECTORS} holds rows that are not finite unit vectors")
    return Shard(name, ids, vectors, meta)


def _unit_rows(vectors: npt.NDArray[np.float32]) -> bool:
    """Whether every row is finite with norm 1 (within 1e-3), read in blocks so a mapped shard is not copied whole."""
    for start in range(0, len(vectors), _CHECK_ROWS):
        norms = np.linalg.norm(vectors[start : start + _CHECK_ROWS], axis=1)
        if not (np.isfinite(norms).all() and np.allclose(norms, 1.0, atol=1e-3)):
            return False
    return True


def remove_abandoned(folder: Path) -> list[str]:
    """Delete hidden shard folders of writers on this host whose process is gone; returns their names."""
    host = "".join(c for c in socket.gethostname() if c.isalnum())[:16] or "host"
    removed: list[str] = []
    hidden = [p for sub in (SHARDS, "indexes") if (folder / sub).is_dir() for p in (folder / sub).iterdir()]
    for path in hidden:  # shards being written, and sealed indexes (segment/sealed.py)
        parts = path.name.lstrip(".").removesuffix(".tmp").split("-")
        if not (path.name.startswith(".") and path.name.endswith(".tmp") and len(parts) == 4 and parts[1] == host):
            continue
        if parts[2].isdigit() and not _alive(int(parts[2])):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def _alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
