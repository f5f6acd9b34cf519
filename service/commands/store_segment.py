"""`--segment STORE:NAME` for `backfill run|status|index|cutover`: a segment in the user's own store.

    pgvector:COLUMN, pgvector-table:TABLE   commands/pgvector_segment.py
    qdrant:VECTOR, qdrant-collection:NAME   commands/qdrant_segment.py
    milvus-collection:NAME                  commands/milvus_segment.py

Each is one face for the commands (commands/backfill.py): where, noun, exists, gallery_ref, target,
moved, status, index, cutover.  A segment folder has none: the commands read it directly.  The Qdrant
and Milvus faces share ClientSegmentCli: each call opens its own client and closes it (qdrant-client's
local mode lets one client at a time open a folder, so a command never holds it longer than its work).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

from service.errors import InputError


def store_segment(text: str) -> Any:
    """The store face `text` names (None for a folder); InputError without a name or beside another gallery."""
    from service.commands.milvus_segment import milvus_segment
    from service.commands.pgvector_segment import pgvector_segment
    from service.commands.qdrant_segment import qdrant_segment

    return qdrant_segment(text) or milvus_segment(text) or pgvector_segment(text)


def named(text: str, prefixes: tuple[tuple[str, bool], ...], example: str) -> tuple[str, bool] | None:
    """(name, side) for the first of `prefixes` that `text` starts with; None for none; InputError without a name."""
    for prefix, side in prefixes:
        if text.startswith(prefix):
            name = text.removeprefix(prefix)
            if not name:
                raise InputError(f"--segment {prefix}NAME needs a name, e.g. {prefix}{example}")
            return name, side
    return None


class ClientSegmentCli:
    """The new rows in a store answered through a client (Qdrant, Milvus) as the backfill commands see them.

    A subclass sets `store`, `noun`, `rows` (its new-rows object) and `settings`, and says how to connect,
    which gallery and target classes and cut-over module are its, and its store's words for status, index and
    the cut-over.
    """

    store: ClassVar[str]
    noun: ClassVar[str]
    leftover: ClassVar[str]  # after the cut-over: what stays until the user deletes it
    nothing_to_run: ClassVar[str] = "done"  # the cut-over's verb when there is no call to run
    settings: Any
    rows: Any
    where: str

    def connect(self) -> Any:
        """A client (raises the client's own error when nobody answers)."""
        raise NotImplementedError

    def gallery_class(self) -> Any:
        """The gallery class the service opens on these settings."""
        raise NotImplementedError

    def new_target(self, client: Any, add: bool) -> Any:
        """backfill run's target over `client`."""
        raise NotImplementedError

    def missing(self) -> str:
        """`status` before the part exists: which run creates it."""
        raise NotImplementedError

    def unlabelled(self) -> str:
        """`status` on a part nobackfill did not create."""
        raise NotImplementedError

    def status_fields(self, state: Any) -> dict[str, Any]:
        """The store's own fields of `status`'s report: collection and index."""
        raise NotImplementedError

    def index(self, m: int, ef_construction: int) -> str:  # noqa: ARG002 (pgvector's)
        """`backfill index`: the store indexes by itself; the line that says so."""
        raise NotImplementedError

    def cutover_module(self) -> Any:
        """The store's cut-over module (backfill/qdrant_cutover.py, milvus_cutover.py): its plan_cutover(rows,
        client, alias) plans the cut-over, its apply_cutover(client, planned) runs the plan's call."""
        raise NotImplementedError

    def has_call(self, planned: Any) -> bool:
        """Whether the plan has a call to run (--apply runs it)."""
        raise NotImplementedError

    def plan(self, client: Any, alias: str | None) -> tuple[Any, bool]:
        """The cut-over's plan and whether it has a call to run (--apply runs it)."""
        planned = self.cutover_module().plan_cutover(self.rows, client, alias)
        return planned, self.has_call(planned)

    def apply(self, client: Any, planned: Any) -> None:
        """Run the plan's call."""
        self.cutover_module().apply_cutover(client, planned)

    @contextmanager
    def client(self) -> Iterator[Any]:
        """A client for one piece of work; an unreachable (or locked) store is one GalleryUnavailable line."""
        from service.index.base import setting_line, store_errors

        # A server's transport error, or a local folder another process holds.
        with store_errors(f"cannot open {self.store} ({setting_line(self.settings)})"):
            client = self.connect()
        try:
            with store_errors(f"{self.store} did not answer for {self.where}"):
                yield client
        finally:
            client.close()

    def exists(self) -> bool:
        """Whether the part is there."""
        with self.client() as client:
            return self.rows.state(client) is not None

    def gallery_ref(self) -> Any:
        """The user's old rows as the gallery the segment sits beside (opened as the service opens it)."""
        from service.segment.layout import GalleryRef

        gallery = self.gallery_class().open(self.settings)
        gallery.close()
        return GalleryRef(gallery.fingerprint, gallery.ntotal)

    def target(self, add: bool) -> Any:
        """backfill run's target (it holds its client until the run ends)."""
        return self.new_target(self.connect(), add)

    def moved(self) -> int:
        """Items moved now."""
        with self.client() as client:
            count: int = self.rows.count(client) if self.rows.state(client) is not None else 0
            return count

    def status(self, hits: Any) -> dict[str, Any]:
        """`backfill status`'s report (the folder's shape, no shards), coverage read from the store."""
        from service.backfill.status import hit_share

        with self.client() as client:
            state = self.rows.state(client)
            if state is None:
                raise InputError(self.missing())
            if state.label is None:
                raise InputError(self.unlabelled())
            total = self.rows.rows(client)
            moved = self.rows.moved(client)
        out: dict[str, Any] = {
            "segment": self.rows.spec,
            "model": state.label.model.as_dict(),
            "gallery": {"fingerprint": state.label.gallery, "ntotal": total},
            "moved": int(len(moved)),
            "coverage": len(moved) / total if total else 0.0,
            "moved_by_writer": {},  # a row does not record who wrote it
            "shards": [],
            "damaged_shards": 0,
            **self.status_fields(state),
        }
        if hits is not None:
            out["hits"] = hit_share(moved, *hits)
        return out

    def cutover(self, apply: bool, how: str, view: str | None, alias: str | None) -> list[str]:  # noqa: ARG002
        """The cut-over's lines (--apply makes the alias call); `how` and `view` are pgvector's."""
        with self.client() as client:
            planned, has_call = self.plan(client, alias)
            if apply and has_call:
                self.apply(client, planned)
        verb = "applied" if has_call and apply else ("to run (--apply runs it)" if has_call else self.nothing_to_run)
        return [
            f"# {self.where}: the cut-over, {verb}",
            *planned.lines,
            f"# then {planned.after}",
            f"# {self.leftover}: {planned.drop_later}",
        ]
