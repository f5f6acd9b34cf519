"""`backfill status`: how far the migration is: items moved, the share of recent hits they take, the shards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service.errors import ArtifactError
from service.manifest import verify_manifest
from service.segment.layout import IDS, SHARD_JSON, SHARDS, read_segment_meta, shard_names

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]


def segment_status(folder: Path, hits: tuple[I64, F64] | None = None) -> dict[str, Any]:
    """The segment's model, coverage, hit share (when counts are given) and every shard, JSON-ready."""
    import json

    meta = read_segment_meta(folder)
    shards: list[dict[str, Any]] = []
    parts: list[I64] = []
    by_writer: dict[str, list[I64]] = {}
    for name in shard_names(folder):
        entry: dict[str, Any] = {"name": name}
        try:
            verify_manifest(folder / SHARDS / name)  # every file hashed: a shard the service would refuse shows here
            info = json.loads((folder / SHARDS / name / SHARD_JSON).read_text(encoding="utf-8"))
            ids = np.load(folder / SHARDS / name / IDS, allow_pickle=False)
        except (ArtifactError, OSError, ValueError) as exc:
            entry["damaged"] = exc.message if isinstance(exc, ArtifactError) else str(exc)
            shards.append(entry)
            continue
        parts.append(ids)
        by_writer.setdefault(str(info.get("writer")), []).append(ids)
        model = info.get("model", {})
        entry.update(
            count=int(len(ids)),
            model=f"{model.get('backend')} {model.get('model_id')}",
            writer=info.get("writer"),
            created_at=info.get("created_at"),
        )
        shards.append(entry)
    moved = np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
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
    }
    if hits is not None:
        out["hits"] = hit_share(moved, *hits)
    return out


def hit_share(moved: I64, ids: I64, counts: F64) -> dict[str, Any]:
    """Of the counted (decayed) hits, the share on moved items; None while nothing is counted."""
    total = float(counts.sum())
    on_moved = float(counts[np.isin(ids, moved)].sum()) if len(ids) else 0.0
    return {"counted_ids": int(len(ids)), "share_on_moved": on_moved / total if total > 0 else None}
