"""After the cut-over (NOBACKFILL_OLD__BACKEND=none): the finished segment served alone, by the new model alone.

Once every gallery item has moved, hybrid answers what `new` answers, and the old encoder, the old
gallery and the compat profile serve no request.  The service then opens the segment as its only
gallery (`SegmentGallery`) and refuses a segment that is not complete or not the new model's.  The
pipeline is then composed without an old model and without a profile (pipeline/parts.py): `new` is the
one mode it serves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service.encoders.identity import ModelIdentity
from service.errors import ArtifactError
from service.index.base import Exclusion, Hits
from service.segment.base import SegmentStore
from service.segment.reader import Indexing, Segment, check_served


def open_finished(folder: Path, model: ModelIdentity, indexing: Indexing) -> Segment:
    """The segment at `folder`, refused in one line unless it is `model`'s and holds every gallery item."""
    segment = Segment.open(folder, indexing)
    check_served(segment.meta, model, segment.meta.gallery, folder)  # the gallery it replaced is gone: model only
    moved, total = segment.snapshot.count, segment.meta.gallery.ntotal
    if moved < total:
        raise ArtifactError(
            f"segment {folder} holds {moved:,} of the gallery's {total:,} items ({moved / total:.1%}); "
            "cut over (NOBACKFILL_OLD__BACKEND=none) once `nobackfill backfill status` says 100 %"
        )
    return segment


class SegmentGallery:
    """A finished segment, of any store, as the service's gallery (index/base.py's GalleryBackend)."""

    backend = "segment"

    def __init__(self, segment: SegmentStore, replaced: str) -> None:
        self.segment = segment
        self.dim = segment.dim
        self.ntotal = segment.gallery_items
        # The frozen gallery it replaced, by the fingerprint it was created beside.
        self.fingerprint = f"segment:{replaced}"
        self.meta: dict[str, Any] = {"old_model": segment.model.as_dict()}

    @property
    def max_nprobe(self) -> int | None:
        """No request nprobe: mode new searches the segment through SegmentSearch, at the request's ef_search."""
        return None

    def search(
        self,
        queries: npt.ArrayLike,
        k: int,
        nprobe: int,  # noqa: ARG002 (the protocol's; the blocks search at index.segment_ef_search)
        exclude: Exclusion | None = None,  # noqa: ARG002 (nothing is excluded after the cut-over)
        ef_search: int | None = None,
    ) -> Hits:
        """Top-k over every block of the segment, its graphs at ef_search (None: each one's own width)."""
        return self.segment.snapshot.search(np.asarray(queries, dtype=np.float32), k, ef_search)

    def describe(self) -> dict[str, Any]:
        """What /v1/info reports: the segment in place of the retired gallery."""
        return {"backend": self.backend, "ntotal": self.ntotal, "dim": self.dim, **self.segment.describe()}

    def problem(self) -> str | None:
        """In memory: nothing can go away."""
        return None

    def probe(self) -> str | None:
        """In memory: always answers."""
        return None

    def close(self) -> None:
        """Release the segment's connections, if it has any."""
        self.segment.close()
