"""`--segment milvus-collection:NAME` for `backfill run|status|index|cutover` (commands/backfill.py).

The same face as Qdrant's (commands/qdrant_segment.py: where, exists, gallery_ref, target, moved, status,
index_line, cutover), over a second collection beside the one the NOBACKFILL_INDEX__MILVUS_* settings name,
as the service reads them.  Each call opens its own client and closes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from service.errors import GalleryUnavailable, InputError, NobackfillError

MILVUS_COLLECTION_PREFIX = "milvus-collection:"


class MilvusSegmentCli:
    """The new collection in Milvus as the backfill commands see it."""

    noun = "collection"

    def __init__(self, name: str) -> None:
        from service.segment.milvus_rows import MilvusNewRows
        from service.settings import Settings

        self.settings = Settings().index  # NOBACKFILL_INDEX__MILVUS_URI, _COLLECTION and _TOKEN
        if self.settings.backend != "milvus":
            raise InputError(
                f"--segment {MILVUS_COLLECTION_PREFIX}{name} is beside the Milvus gallery: "
                "set NOBACKFILL_INDEX__BACKEND=milvus and its NOBACKFILL_INDEX__MILVUS_* settings"
            )
        self.rows = MilvusNewRows(self.settings, name)
        self.where = self.rows.where

    def _connect(self) -> Any:
        """A client (GalleryUnavailable in one line when nobody answers)."""
        from service.index.milvus import connect

        token = self.settings.milvus_token.get_secret_value() if self.settings.milvus_token else None
        return connect(str(self.settings.milvus_uri), token, self.settings.milvus_timeout_s)

    @contextmanager
    def client(self) -> Iterator[Any]:
        """A client for one piece of work; a failing call is one GalleryUnavailable line."""
        from service.index.base import first_line

        client = self._connect()
        try:
            yield client
        except NobackfillError:
            raise
        except Exception as exc:  # pymilvus's and grpc's errors
            raise GalleryUnavailable(f"Milvus did not answer for {self.where}: {first_line(exc)}") from exc
        finally:
            client.close()

    def exists(self) -> bool:
        """Whether the collection is there."""
        with self.client() as client:
            return self.rows.state(client) is not None

    def gallery_ref(self) -> Any:
        """The user's collection as the gallery the segment sits beside (opened as the service opens it)."""
        from service.index.milvus import MilvusGallery
        from service.segment.layout import GalleryRef

        gallery = MilvusGallery.open(self.settings)
        gallery.close()
        return GalleryRef(gallery.fingerprint, gallery.ntotal)

    def target(self, add: bool) -> Any:
        """backfill run's target (it holds its client until the run ends)."""
        from service.backfill.milvus_target import MilvusCollectionTarget

        return MilvusCollectionTarget(self.rows, self._connect(), add=add)

    def moved(self) -> int:
        """Items moved now."""
        with self.client() as client:
            return self.rows.count(client) if self.rows.state(client) is not None else 0

    def status(self, hits: Any) -> dict[str, Any]:
        """`backfill status`'s report (the folder's shape, no shards), coverage read from Milvus."""
        from service.backfill.status import hit_share

        with self.client() as client:
            state = self.rows.state(client)
            if state is None:
                raise InputError(f"{self.where}: not there yet (`backfill run --segment {self.rows.spec} "
                                 "--add-collection ...` creates it)")  # fmt: skip
            if state.label is None:
                raise InputError(f"{self.where}: not created by nobackfill (no 'nobackfill.segment' property)")
            total = self.rows.rows(client)
            moved = self.rows.moved(client)
        out: dict[str, Any] = {
            "segment": self.rows.spec,
            "collection": self.rows.name,
            "model": state.label.model.as_dict(),
            "gallery": {"fingerprint": state.label.gallery, "ntotal": total},
            "moved": int(len(moved)),
            "coverage": len(moved) / total if total else 0.0,
            "index": f"Milvus's {state.layout.index_type} ({state.layout.metric}, built by Milvus)",
            "moved_by_writer": {},  # a row does not record who wrote it
            "shards": [],
            "damaged_shards": 0,
        }
        if hits is not None:
            out["hits"] = hit_share(moved, *hits)
        return out

    def index_line(self) -> str:
        """`backfill index`: Milvus indexes the collection by itself; nothing to build."""
        return (
            f"{self.where}: Milvus builds the collection's index (the type of {self.rows.collection}'s) on each "
            "sealed segment by itself; nothing to build"
        )

    def cutover(self, apply: bool, alias: str | None) -> list[str]:
        """The cut-over's lines (--apply makes the alias call)."""
        from service.backfill.milvus_cutover import apply_cutover, plan_cutover

        with self.client() as client:
            planned = plan_cutover(self.rows, client, alias)
            if apply:
                apply_cutover(client, planned)
        verb = "applied" if planned.call and apply else ("to run (--apply runs it)" if planned.call else "done")
        return [
            f"# {self.where}: the cut-over, {verb}",
            *planned.lines,
            f"# then {planned.after}",
            f"# the old collection stays until you drop it: {planned.drop_later}",
        ]


def milvus_segment(text: str) -> MilvusSegmentCli | None:
    """What `milvus-collection:NAME` names (None otherwise); InputError without a name."""
    if not text.startswith(MILVUS_COLLECTION_PREFIX):
        return None
    name = text.removeprefix(MILVUS_COLLECTION_PREFIX)
    if not name:
        raise InputError(
            f"--segment {MILVUS_COLLECTION_PREFIX}NAME needs a name, e.g. {MILVUS_COLLECTION_PREFIX}items_v2"
        )
    return MilvusSegmentCli(name)
