"""`QdrantGallery`: the user's Qdrant collection of old-model vectors, searched read-only where it is.

    NOBACKFILL_INDEX__BACKEND=qdrant
    NOBACKFILL_INDEX__QDRANT_URL=http://qdrant:6333     (a server), or
    NOBACKFILL_INDEX__QDRANT_PATH=./qdrant-data          (qdrant-client's embedded local mode: development, tests)
    NOBACKFILL_INDEX__QDRANT_COLLECTION=products
    NOBACKFILL_INDEX__QDRANT_VECTOR=old                  (a named vector; unset: the collection's default vector)
    NOBACKFILL_INDEX__QDRANT_API_KEY=...                 (a secret)

The contract, checked once at open, each failure one line naming the settings: the collection and the
vector exist, its distance is Dot, Cosine or Euclid (Manhattan ranks otherwise than any cosine), the
collection holds points, and their ids are integers (the gallery ids the API returns; UUID points have
none).  A search is one batched query of the collection's own index (its HNSW, at
`NOBACKFILL_INDEX__QDRANT_HNSW_EF` when set); the scores come back as cosines of unit rows (Cosine as
it is, Dot as it is, Euclid d as 1 - d^2 / 2), the scale hybrid's merge reads.  Moved items (hybrid)
are left out by over-fetching (index/base.py), exact as long as the list can grow: a must_not filter
over a million moved ids would cost more than it saves.  Beside a named vector of this collection
(segment/qdrant_vector.py) they are left out in Qdrant itself: a must_not has_vector filter, so the
moved points are never listed.  A call that fails (server down, timeout)
answers 503 gallery_unavailable.  Nothing is written.

Local mode is the client's own engine, not Qdrant's: it searches by brute force (exact; search
parameters have no effect) and one process at a time may open its folder.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from service.errors import ArtifactError, GalleryUnavailable
from service.index.base import (
    Exclusion,
    Hits,
    Queries,
    ServerHealth,
    checked_queries,
    cosine_of_l2,
    described,
    excluding_by_overfetch,
    setting_line,
    store_errors,
)

if TYPE_CHECKING:
    from service.settings import IndexSettings

log = logging.getLogger(__name__)
DISTANCES = {"Dot": "ip", "Cosine": "cosine", "Euclid": "l2"}
TIMEOUT_S = 5


class QdrantGallery(ServerHealth):
    """A Qdrant collection searched read-only (index/base.py's GalleryBackend)."""

    server = "Qdrant"  # in /readyz's problem line
    backend = "qdrant"

    def __init__(self, settings: IndexSettings, client: Any, described: dict[str, Any]) -> None:
        self.settings = settings
        self._client = client
        self.collection: str = described["collection"]
        self.vector: str | None = described["vector"]
        self.dim: int = described["dim"]
        self.ntotal: int = described["ntotal"]
        self.metric: str = described["metric"]
        self.fingerprint: str = described["fingerprint"]
        self.meta: dict[str, Any] = {}  # no recorded model identity: artifact_check compares the dim
        self.max_nprobe: int | None = None  # an HNSW collection takes no nprobe

    @classmethod
    def open(cls, settings: IndexSettings) -> QdrantGallery:
        """Connect (or open the local folder), check the collection against the contract; one line otherwise."""
        where = setting_line(settings)
        client = client_of(settings)
        try:
            with store_errors(f"cannot reach Qdrant ({where})"):  # the server is not there
                described = _describe(client, settings, where)
        except Exception:
            client.close()
            raise
        return cls(settings, client, described)

    def search(
        self,
        queries: npt.ArrayLike,
        k: int,
        nprobe: int,
        exclude: Exclusion | None = None,
        ef_search: int | None = None,
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        """Top-k by the collection's index, as cosines, skipping `exclude`'s ids: (scores, ids; -1 pads).
        ef_search: this call's hnsw_ef (None: index.qdrant_hnsw_ef, else the collection's own)."""
        q = checked_queries(queries, self.dim, k, nprobe, None)
        search = functools.partial(self._search, ef_search=ef_search)
        if exclude is not None and exclude.in_table is not None and exclude.in_table.kind == "vector":
            return search(q, k, nprobe, unmoved=exclude.in_table.name)
        if exclude is not None and len(exclude.ids):
            return excluding_by_overfetch(search, q, k, nprobe, exclude)
        return search(q, k, nprobe)

    def _search(
        self,
        q: npt.NDArray[np.float32],
        k: int,
        nprobe: int,  # noqa: ARG002 (the protocol's; HNSW takes hnsw_ef)
        unmoved: str | None = None,
        ef_search: int | None = None,
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        """One batched query: a request per row; with `unmoved`, only the points without that (new) vector."""
        from qdrant_client import models

        only = models.Filter(must_not=[models.HasVectorCondition(has_vector=unmoved)]) if unmoved is not None else None
        width = self.settings.qdrant_hnsw_ef if ef_search is None else max(ef_search, k)
        try:
            answers = query_batch(self._client, self.collection, q, k, using=self.vector, only=only, hnsw_ef=width)
        except Exception as exc:  # the client's transport and server errors alike: an outage for this request
            self._failed(exc)
            raise GalleryUnavailable(f"the Qdrant gallery did not answer ({setting_line(self.settings)})") from exc
        self._answered()
        return as_hits(answers, len(q), k, self.metric)

    @property
    def client(self) -> Any:
        """The open client: a segment in this collection shares it (local mode lets one client open a folder)."""
        return self._client

    def describe(self) -> dict[str, Any]:
        """What /v1/info reports: the collection, its vector and size."""
        where = {"collection": self.collection, "vector": self.vector or "(the default vector)"}
        return described(self, where, {"metric": self.metric})

    def _ping(self) -> None:
        """Whether the collection is there (for /readyz)."""
        self._client.collection_exists(self.collection)

    def close(self) -> None:
        """Close the client (a local folder is released for the next process)."""
        self._client.close()


def client_of(settings: IndexSettings) -> Any:
    """A server client (url, api key) or the embedded local mode (path)."""
    from qdrant_client import QdrantClient

    if settings.qdrant_path is not None:
        return QdrantClient(path=str(settings.qdrant_path))
    key = settings.qdrant_api_key.get_secret_value() if settings.qdrant_api_key else None
    return QdrantClient(url=settings.qdrant_url, api_key=key, timeout=TIMEOUT_S)


def query_batch(
    client: Any, collection: str, queries: Queries, k: int, *, using: str | None, only: Any, hnsw_ef: int | None
) -> list[Any]:
    """One query_batch_points call, a request per row of `queries`: the top k of the points `only` (a filter, or
    None: all) lets through, by the vector `using` (None: the default one), at `hnsw_ef` (None: the collection's).

    The gallery's search and the segment's (segment/qdrant_rows.py) both ask this way.
    """
    from qdrant_client import models

    params = models.SearchParams(hnsw_ef=hnsw_ef) if hnsw_ef else None
    requests = [
        models.QueryRequest(query=row.tolist(), using=using, filter=only, limit=k, params=params, with_payload=False)
        for row in queries
    ]
    with warnings.catch_warnings():  # local mode says, per call, that it ignores search params
        warnings.simplefilter("ignore", UserWarning)
        answers: list[Any] = client.query_batch_points(collection, requests=requests, timeout=TIMEOUT_S)
    return answers


def as_hits(answers: list[Any], rows: int, k: int, metric: str) -> Hits:
    """query_batch's answers as (scores [rows, k], ids [rows, k]; -inf / -1 pad), the scores as cosines of unit rows
    (Euclid's distance d as 1 - d^2 / 2; Dot and Cosine as they are)."""
    scores = np.full((rows, k), -np.inf, dtype=np.float32)
    ids = np.full((rows, k), -1, dtype=np.int64)
    for row, answer in enumerate(answers):
        points = answer.points
        ids[row, : len(points)] = [int(p.id) for p in points]
        found = np.array([p.score for p in points], dtype=np.float64)
        scores[row, : len(points)] = cosine_of_l2(found**2) if metric == "l2" else found
    return scores, ids


def _describe(client: Any, settings: IndexSettings, where: str) -> dict[str, Any]:
    """The collection as the contract needs it (module docstring); ArtifactError in one line otherwise."""
    name, vector = settings.qdrant_collection or "", settings.qdrant_vector
    if not client.collection_exists(name):
        raise ArtifactError(f"{where}: no collection {name!r} (NOBACKFILL_INDEX__QDRANT_COLLECTION)")
    vectors = client.get_collection(name).config.params.vectors
    if isinstance(vectors, dict):
        if vector is None and "" in vectors:
            vector = ""  # the default vector of a collection created with named vectors
        if vector not in vectors:
            named = ", ".join(sorted(vectors)) or "none"
            raise ArtifactError(
                f"{where}: collection {name!r} has no vector {vector!r} (it has: {named}); "
                "set NOBACKFILL_INDEX__QDRANT_VECTOR"
            )
        params = vectors[vector]
    elif vector:
        raise ArtifactError(
            f"{where}: collection {name!r} has one unnamed vector; unset NOBACKFILL_INDEX__QDRANT_VECTOR"
        )
    else:
        params = vectors
    distance = str(getattr(params.distance, "value", params.distance))
    if distance not in DISTANCES:
        raise ArtifactError(f"{where}: distance {distance}; the head's unit queries rank by Dot, Cosine or Euclid")
    ntotal = int(client.count(name, exact=True).count)
    if ntotal == 0:
        raise ArtifactError(f"{where}: collection {name!r} holds no points")
    first = client.scroll(name, limit=1, with_payload=False, with_vectors=False)[0][0]
    if not isinstance(first.id, int):
        raise ArtifactError(f"{where}: point ids are UUIDs ({first.id}); nobackfill serves integer gallery ids")
    origin = str(settings.qdrant_url or settings.qdrant_path)
    return {
        "collection": name,
        "vector": vector or None,
        "dim": int(params.size),
        "ntotal": ntotal,
        "metric": DISTANCES[distance],
        "fingerprint": hashlib.sha256(f"qdrant:{origin}/{name}/{vector or ''}".encode()).hexdigest(),
    }
