"""`backfill status`: how far the migration is: items moved, the share of recent hits they take, the shards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from service.errors import InputError
from service.rows import F64, I64
from service.segment.catalog import ShardCatalog
from service.segment.layout import read_segment_meta
from service.segment.pgvector_column import PgvectorColumn
from service.segment.sealed import choose_cover, readable_metas


def segment_status(folder: Path, hits: tuple[I64, F64] | None = None) -> dict[str, Any]:
    """The segment's model, coverage, hit share (when counts are given) and every shard, JSON-ready.

    Shards are checked as the service checks them (segment/catalog.py): a refused one shows here as
    damaged, with its reason, and its items do not count as moved.
    """
    meta = read_segment_meta(folder)
    catalog = ShardCatalog(folder, meta.dim)
    shards: list[dict[str, Any]] = []
    by_writer: dict[str, list[I64]] = {}
    for entry in catalog.scan():
        if entry.refused is not None:
            shards.append({"name": entry.name, "damaged": entry.refused})
            continue
        info = entry.meta
        by_writer.setdefault(str(info.get("writer")), []).append(entry.ids)
        shards.append(
            {
                "name": entry.name,
                "count": int(len(entry.ids)),
                "model": info.get("model", {}),  # as the shard recorded it: backend, model_id, dim
                "writer": info.get("writer"),
                "created_at": info.get("created_at"),
            }
        )
    moved = catalog.moved()
    total = meta.gallery.ntotal
    out: dict[str, Any] = {
        "segment": str(folder),
        "model": meta.model.as_dict(),
        "gallery": meta.gallery.as_dict(),
        "moved": int(len(moved)),
        "coverage": len(moved) / total,
        # Items each writer moved (backfill: the bulk job; service-cascade: traffic); one moved by two counts for both.
        "moved_by_writer": {writer: int(len(np.unique(np.concatenate(p)))) for writer, p in sorted(by_writer.items())},
        "shards": shards,
        "damaged_shards": sum("damaged" in s for s in shards),
        "sealed_indexes": _served_indexes(folder, {s["name"] for s in shards if "damaged" not in s}),
    }
    if hits is not None:
        out["hits"] = hit_share(moved, *hits)
    return out


def column_status(column: PgvectorColumn, hits: tuple[I64, F64] | None = None) -> dict[str, Any]:
    """A pgvector column segment's model, coverage, index and hit share, JSON-ready (the folder's shape, no shards)."""
    with column.connect() as conn:
        state = column.state(conn)
        if state is None:
            raise InputError(f"{column.where}: not there yet (`backfill run --segment {column.spec} "
                             "--add-column ...` adds it)")  # fmt: skip
        if state.label is None:
            raise InputError(f"{column.where}: the column was not added by nobackfill (no label in its comment)")
        total = column.rows(conn)
        moved = column.moved(conn)
    out: dict[str, Any] = {
        "segment": column.spec,
        "table": column.table,
        "model": state.label.model.as_dict(),
        "gallery": {"fingerprint": state.label.gallery, "ntotal": total},
        "moved": int(len(moved)),
        "coverage": len(moved) / total if total else 0.0,
        "index": state.index_method,
        "moved_by_writer": {},  # a column does not record who set a row
        "shards": [],
        "damaged_shards": 0,
    }
    if hits is not None:
        out["hits"] = hit_share(moved, *hits)
    return out


def hit_share(moved: I64, ids: I64, counts: F64) -> dict[str, Any]:
    """Of the counted (decayed) hits, the share on moved items; None while nothing is counted."""
    total = float(counts.sum())
    on_moved = float(counts[np.isin(ids, moved)].sum()) if len(ids) else 0.0
    return {"counted_ids": int(len(ids)), "share_on_moved": on_moved / total if total > 0 else None}


def _served_indexes(folder: Path, intact: set[str]) -> list[dict[str, Any]]:
    """The sealed indexes a reader serves over these intact shards (sealed.choose_cover): name, rows and the width
    it searches at when neither a request nor index.segment_ef_search names one (its seal measured it)."""
    served = choose_cover(readable_metas(folder), intact)  # (an unreadable one: a reader refuses it too)
    return [{"name": m.name, "rows": m.rows, "ef_search": m.ef_search, "width_probes": m.width_probes} for m in served]
