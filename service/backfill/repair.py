"""`backfill repair`: move refused shards out of the segment into its quarantine folder, never deleting one.

A refused shard (segment/catalog.py: a manifest that does not match, rows of another dim, rows that
are not unit) already counts as not moved everywhere, but it stays under shards/, so every start of
the service logs it again and `backfill status` keeps showing it.  Repair renames each one into
SEGMENT/quarantine/<name> (one rename on the same filesystem: nothing is copied or lost, and an
operator can inspect or delete it there), and says how many items must be moved again; the next
`backfill run` moves them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from service.errors import ArtifactError, InputError
from service.segment.catalog import ShardCatalog
from service.segment.layout import SHARD_JSON, SHARDS
from service.segment.sealed import INDEXES, read_meta, sealed_names

QUARANTINE = "quarantine"


@dataclass
class Repair:
    """What a repair moved aside."""

    quarantined: dict[str, str] = field(default_factory=dict)  # shard name -> why it was refused
    rows: int = 0  # rows the quarantined shards said they held (as far as their shard.json can be read)
    unknown_rows: int = 0  # quarantined shards whose shard.json could not say
    indexes: list[str] = field(default_factory=list)  # sealed indexes over a quarantined shard, moved aside too


def repair_segment(folder: Path) -> Repair:
    """Quarantine every refused shard of the segment at `folder`; returns what was moved aside."""
    catalog = ShardCatalog.of(folder)
    catalog.scan()
    report = Repair()
    refused = catalog.refused
    if not refused:
        return report
    target = folder / QUARANTINE
    try:
        target.mkdir(exist_ok=True)
        for name, reason in refused.items():
            count = _recorded_count(folder / SHARDS / name)
            os.rename(folder / SHARDS / name, target / name)
            report.quarantined[name] = reason
            if count is None:
                report.unknown_rows += 1
            else:
                report.rows += count
        # A sealed index over a quarantined shard is served by no reader any more (its shards are not all
        # intact): it goes aside too, and the next seal covers its other shards again.
        for name in sealed_names(folder):
            try:
                shards = read_meta(folder, name).shards
            except ArtifactError:
                continue
            if shards & set(refused):
                os.rename(folder / INDEXES / name, target / f"index-{name}")
                report.indexes.append(name)
    except OSError as exc:
        raise InputError(f"cannot move a refused shard into {target}: {exc.strerror or exc}") from exc
    return report


def _recorded_count(shard: Path) -> int | None:
    """The row count the shard's own shard.json records, or None when it cannot be read."""
    try:
        count = json.loads((shard / SHARD_JSON).read_text(encoding="utf-8")).get("count")
    except (OSError, ValueError, AttributeError):
        return None
    return count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else None
