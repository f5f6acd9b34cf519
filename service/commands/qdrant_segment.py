"""`--segment qdrant:VECTOR` / `qdrant-collection:NAME` for `backfill run|status|index|cutover` (commands/backfill.py).

The same face as pgvector's column for the CLI (where, exists, gallery_ref, target, moved, status), over
the collection the NOBACKFILL_INDEX__QDRANT_* settings name, as the service reads them.  Each call opens
its own client and closes it: qdrant-client's local mode lets one client at a time open a folder, so a
command never holds it longer than its work.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from service.errors import GalleryUnavailable, InputError, NobackfillError

QDRANT_PREFIX = "qdrant:"
QDRANT_COLLECTION_PREFIX = "qdrant-collection:"


class QdrantSegmentCli:
    """The new rows in Qdrant as the backfill commands see them."""

    noun = "vector"

    def __init__(self, name: str, side: bool) -> None:
        from service.segment.qdrant_rows import QdrantNewRows
        from service.settings import Settings

        self.settings = Settings().index  # NOBACKFILL_INDEX__QDRANT_URL / _PATH and _COLLECTION
        if self.settings.backend != "qdrant":
            raise InputError(
                f"--segment {QDRANT_COLLECTION_PREFIX if side else QDRANT_PREFIX}{name} is beside the Qdrant gallery: "
                "set NOBACKFILL_INDEX__BACKEND=qdrant and its NOBACKFILL_INDEX__QDRANT_* settings"
            )
        self.rows = QdrantNewRows(self.settings, name, side=side)
        self.where = self.rows.where

    @contextmanager
    def client(self) -> Iterator[Any]:
        """A client for one piece of work; an unreachable (or locked) store is one GalleryUnavailable line."""
        from service.index.base import first_line, setting_line
        from service.index.qdrant import client_of

        try:
            client = client_of(self.settings)
        except Exception as exc:  # a server's transport error, or a local folder another process holds
            raise GalleryUnavailable(f"cannot open Qdrant ({setting_line(self.settings)}): {first_line(exc)}") from exc
        try:
            yield client
        except NobackfillError:
            raise
        except Exception as exc:  # the client's transport and server errors
            raise GalleryUnavailable(f"Qdrant did not answer for {self.where}: {first_line(exc)}") from exc
        finally:
            client.close()

    def exists(self) -> bool:
        """Whether the vector (collection) is there."""
        with self.client() as client:
            return self.rows.state(client) is not None

    def gallery_ref(self) -> Any:
        """The collection's old vector as the gallery the segment sits beside (opened as the service opens it)."""
        from service.index.qdrant import QdrantGallery
        from service.segment.layout import GalleryRef

        gallery = QdrantGallery.open(self.settings)
        gallery.close()
        return GalleryRef(gallery.fingerprint, gallery.ntotal)

    def target(self, add: bool) -> Any:
        """backfill run's target (it holds its client until the run ends)."""
        from service.backfill.qdrant_target import QdrantVectorTarget
        from service.index.qdrant import client_of

        return QdrantVectorTarget(self.rows, client_of(self.settings), add=add)

    def moved(self) -> int:
        """Points moved now."""
        with self.client() as client:
            return self.rows.count(client) if self.rows.state(client) is not None else 0

    def status(self, hits: Any) -> dict[str, Any]:
        """`backfill status`'s report (the folder's shape, no shards), coverage read from Qdrant."""
        from service.backfill.status import hit_share

        with self.client() as client:
            state = self.rows.state(client)
            flag = "--add-collection" if self.rows.side else "--add-vector"
            if state is None:
                raise InputError(f"{self.where}: not there yet (`backfill run --segment {self.rows.spec} {flag} ...` "
                                 "adds it)")  # fmt: skip
            if state.label is None:
                raise InputError(f"{self.where}: not added by nobackfill (no {self.rows.key!r} in the metadata)")
            total = self.rows.rows(client)
            moved = self.rows.moved(client)
        out: dict[str, Any] = {
            "segment": self.rows.spec,
            "collection": self.rows.rows_collection,
            "model": state.label.model.as_dict(),
            "gallery": {"fingerprint": state.label.gallery, "ntotal": total},
            "moved": int(len(moved)),
            "coverage": len(moved) / total if total else 0.0,
            "index": "exact (local mode)" if self.settings.qdrant_path else "Qdrant's HNSW (built by its optimizer)",
            "moved_by_writer": {},  # a point does not record who set its vector
            "shards": [],
            "damaged_shards": 0,
        }
        if hits is not None:
            out["hits"] = hit_share(moved, *hits)
        return out

    def index_line(self) -> str:
        """`backfill index`: Qdrant indexes a vector by itself; nothing to build."""
        return (
            f"{self.where}: Qdrant's optimizer builds the vector's HNSW index by itself once its segments pass "
            "indexing_threshold; nothing to build (local mode searches exactly)"
        )

    def cutover(self, apply: bool, alias: str | None) -> list[str]:
        """The cut-over's lines (--apply runs the alias operations)."""
        from service.backfill.qdrant_cutover import apply_cutover, plan_cutover

        with self.client() as client:
            planned = plan_cutover(self.rows, client, alias)
            if apply:
                apply_cutover(client, planned)
        ran = planned.actions and apply
        verb = "applied" if ran else ("to run (--apply runs it)" if planned.actions else "in the application")
        return [
            f"# {self.where}: the cut-over, {verb}",
            *planned.lines,
            f"# then {planned.after}",
            f"# the old vectors stay until you delete them: {planned.drop_later}",
        ]


def qdrant_segment(text: str) -> QdrantSegmentCli | None:
    """What `qdrant:VECTOR` / `qdrant-collection:NAME` names (None otherwise); InputError without a name."""
    for prefix, side in ((QDRANT_COLLECTION_PREFIX, True), (QDRANT_PREFIX, False)):
        if text.startswith(prefix):
            name = text.removeprefix(prefix)
            if not name:
                raise InputError(f"--segment {prefix}NAME needs a name, e.g. {prefix}embedding_v2")
            return QdrantSegmentCli(name, side)
    return None
