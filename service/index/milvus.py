"""`MilvusGallery`: an existing Milvus collection of unit old-model vectors, searched read-only.

The contract with the collection (checked once at open, each failure one line naming the settings):
- one FLOAT_VECTOR field (the gallery) and an INT64 primary key (the ids the API returns);
- an index on the vector field whose metric is IP, or COSINE (the same ranking on unit rows), never L2;
- loaded (searchable): the service never loads, releases, indexes or writes the collection (except
  an embedded milvus-lite `./x.db`, which is this process's own server and is loaded at open);
- the vector field's dim is the old model's: artifact_check compares it with the encoder and profile,
  and the model identity `nobackfill gallery build --backend milvus` stored in the collection's
  properties (IDENTITY_KEY, the same block gallery.json holds) with theirs.

Hybrid (segment/milvus_collection.py) leaves the moved ids out by over-fetching, up to Milvus's topk
bound (MILVUS_MAX_TOPK): an `id not in [...]` filter of up to millions of ids is no query to send.
With every row moved the old search is skipped: nothing in it could be answered.

Searching: `nprobe` becomes the index's `nprobe` search parameter where it has one (IVF_*); flat and
graph indexes take none (max_nprobe None).  Every call carries `timeout=index.milvus_timeout_s`, so an
unreachable or stalled Milvus costs a request at most that long and is answered 503
gallery_unavailable (errors.py); the failure is remembered for /readyz until a search or probe succeeds,
and for FAIL_FAST_S searches are answered 503 at once instead of each waiting out the timeout.

    pymilvus.MilvusException (refused connection, server error) ─┐
    grpc.RpcError (DEADLINE_EXCEEDED from a stalled server) ─────┴─► GalleryUnavailable (503)
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from service import metrics
from service.errors import ArtifactError, GalleryUnavailable
from service.index.base import (
    PAD_SCORE,
    Exclusion,
    checked_queries,
    described,
    excluding_by_overfetch,
    setting_line,
)

if TYPE_CHECKING:
    from service.settings import IndexSettings

IDENTITY_KEY = "nobackfill.gallery"  # collection property: JSON of d, metric, old model identity, build params
RANKING_METRICS = ("IP", "COSINE")
# Milvus's own bound on nprobe, for an IVF index whose description carries no nlist (nor the identity).
MILVUS_MAX_NPROBE = 65536
# A graph index needs ef >= k; below this floor its recall drops for small k.
HNSW_MIN_EF = 64
# Milvus's bound on one search's list (its topk): hybrid's over-fetch past the moved ids stops there.
MILVUS_MAX_TOPK = 16384
# Loading an embedded milvus-lite file reads all its segments: more than a search's deadline.
EMBEDDED_LOAD_TIMEOUT_S = 120.0
# After a failed search, searches fail at once for this long (then one tries Milvus again); a /readyz
# probe that gets an answer ends it sooner.
FAIL_FAST_S = 1.0
# /readyz may be polled often and by anyone: one probe per this many seconds reaches Milvus.
PROBE_INTERVAL_S = 1.0

log = logging.getLogger(__name__)


def milvus_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a pymilvus call raises when Milvus is down, stalled or refuses (caught as an outage)."""
    import grpc
    from pymilvus import MilvusException

    return (MilvusException, grpc.RpcError)


def connect(uri: str, token: str | None, timeout_s: float) -> Any:
    """A MilvusClient for uri; GalleryUnavailable (one line) when nobody answers there."""
    try:
        from pymilvus import MilvusClient
    except ImportError as exc:
        raise ArtifactError(
            "the milvus backend needs pymilvus: pip install 'nobackfill[milvus]' (NOBACKFILL_INDEX__BACKEND=milvus)"
        ) from exc
    if uri.endswith(".db") and importlib.util.find_spec("milvus_lite") is None:
        raise ArtifactError(f"{uri} is an embedded milvus-lite file: pip install 'nobackfill[milvus-lite]'")
    # pymilvus logs every failed call with a full traceback; during an outage that is one per request.
    # The failure is logged here once per call, in one line (_unavailable), and counted as a 503.
    logging.getLogger("pymilvus.decorators").setLevel(logging.CRITICAL)
    # milvus-lite answers a key listing (query_iterator) without a server timestamp, and pymilvus says so in a
    # WARNING per listing, that is per segment refresh; it then uses its own clock, which is what we want.
    logging.getLogger("pymilvus.client.iterator.query_iterator").setLevel(logging.ERROR)
    try:
        return MilvusClient(uri=uri, token=token or "", timeout=timeout_s)
    except milvus_errors() as exc:
        raise GalleryUnavailable(f"Milvus at {uri} is unreachable ({_short(exc)})") from exc


def _short(exc: BaseException) -> str:
    """One line of a pymilvus / grpc error for logs and refusals (never for a 5xx body)."""
    message = getattr(exc, "message", None) or getattr(exc, "details", lambda: None)() or str(exc)
    return str(message).splitlines()[0][:200]


def vector_field(description: dict[str, Any]) -> tuple[str, int, str]:
    """(vector field, its dim, primary key) of a described collection; ArtifactError if it is no gallery."""
    from pymilvus import DataType

    fields = description.get("fields", [])
    vectors = [f for f in fields if f.get("type") == DataType.FLOAT_VECTOR]
    primary = [f for f in fields if f.get("is_primary")]
    name = description.get("collection_name")
    if len(vectors) != 1:
        raise ArtifactError(f"collection {name} has {len(vectors)} FLOAT_VECTOR fields; a gallery has exactly one")
    if len(primary) != 1 or primary[0].get("type") != DataType.INT64:
        raise ArtifactError(f"collection {name}: its primary key must be one INT64 field (the ids searches return)")
    return str(vectors[0]["name"]), int(vectors[0]["params"]["dim"]), str(primary[0]["name"])


def index_of(client: Any, collection: str, field: str, timeout_s: float) -> dict[str, Any] | None:
    """The vector field's index: index_type, metric_type and its params (nlist, ...) flattened; None if unindexed."""
    names = client.list_indexes(collection, field_name=field, timeout=timeout_s)
    if not names:
        return None
    found = dict(client.describe_index(collection, names[0], timeout=timeout_s))
    params = found.pop("params", None)  # some servers nest the build params, some flatten them
    if isinstance(params, str):
        params = json.loads(params)
    if isinstance(params, dict):
        found = {**params, **found}
    return found


def state_name(state: Any) -> str:
    """A load state's name ("Loaded", "NotLoad", ...), whether pymilvus gives an enum or a string."""
    return str(getattr(state, "name", state))


def search_params(index_type: str, metric: str, k: int, nprobe: int, ef_search: int | None = None) -> dict[str, Any]:
    """One search's parameters for an index: nprobe for IVF, ef >= k for HNSW (ef_search when given), none else."""
    params: dict[str, Any] = {}
    if index_type.startswith("IVF"):
        params["nprobe"] = nprobe
    elif index_type.startswith("HNSW"):
        params["ef"] = max(k, ef_search or HNSW_MIN_EF)
    return {"metric_type": metric, "params": params}


def read_identity(properties: dict[str, Any]) -> dict[str, Any]:
    """The gallery.json-like block `gallery build` stored in the collection's properties ({} when absent)."""
    raw = properties.get(IDENTITY_KEY)
    if not raw:
        return {}
    try:
        block = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"collection property {IDENTITY_KEY} is not JSON ({exc})") from exc
    if not isinstance(block, dict):
        raise ArtifactError(f"collection property {IDENTITY_KEY} is not a JSON object")
    return block


class MilvusGallery:
    """A loaded Milvus collection, searched read-only from many threads (one gRPC channel)."""

    backend = "milvus"

    def __init__(
        self,
        client: Any,
        settings: IndexSettings,
        field: str,
        primary: str,
        dim: int,
        index: dict[str, Any],
        rows: int,
        meta: dict[str, Any],
    ) -> None:
        self._client = client
        self.uri = str(settings.milvus_uri)
        self.collection = str(settings.milvus_collection)
        self.timeout_s = settings.milvus_timeout_s
        self._settings_line = setting_line(settings)
        self.field = field
        self.primary = primary
        self.dim = dim
        self.ntotal = rows
        self.meta = meta
        self.index_type = str(index.get("index_type", "unknown")).upper()
        self.metric = str(index.get("metric_type", "")).upper()
        nlist = index.get("nlist", (meta.get("index") or {}).get("params", {}).get("nlist"))
        self.nlist: int | None = int(nlist) if nlist is not None else None
        self.fingerprint = f"milvus:{self.collection}@{meta.get('built_at', 'unknown')}"
        self._problem: str | None = None
        self._failed_at = -float("inf")
        self._probed_at = -float("inf")
        self._lock = threading.Lock()

    @classmethod
    def open(cls, settings: IndexSettings) -> MilvusGallery:
        """Connect, check the collection is a searchable gallery; one-line ArtifactError / GalleryUnavailable if not."""
        line = setting_line(settings)
        if not settings.milvus_uri or not settings.milvus_collection:
            raise ArtifactError(f"the milvus backend needs a URI and a collection ({line})")
        token = settings.milvus_token.get_secret_value() if settings.milvus_token else None
        client = connect(settings.milvus_uri, token, settings.milvus_timeout_s)
        name, timeout = settings.milvus_collection, settings.milvus_timeout_s
        try:
            if not client.has_collection(name, timeout=timeout):
                raise ArtifactError(f"no collection {name!r} at {settings.milvus_uri} ({line})")
            description = client.describe_collection(name, timeout=timeout)
            field, dim, primary = vector_field(description)
            index = index_of(client, name, field, timeout)
            if index is None:
                raise ArtifactError(f"collection {name!r} has no index on {field!r} ({line})")
            metric = str(index.get("metric_type", "")).upper()
            if metric not in RANKING_METRICS:
                raise ArtifactError(
                    f"collection {name!r} ranks {field!r} by {metric or 'an unknown metric'}; nobackfill needs IP or "
                    f"COSINE over unit old-model vectors ({line})"
                )
            if settings.milvus_uri.endswith(".db"):
                # An embedded milvus-lite file is this process's own server: no one else can have loaded it
                # (its load state does not survive the process), so loading it here changes nobody's state.
                client.load_collection(name, timeout=max(timeout, EMBEDDED_LOAD_TIMEOUT_S))
            state = state_name(client.get_load_state(name, timeout=timeout).get("state"))
            if state != "Loaded":
                raise ArtifactError(
                    f"collection {name!r} is not loaded ({state}); load it first "
                    f"(`nobackfill gallery build --backend milvus` does; the service never changes it) ({line})"
                )
            meta = read_identity(description.get("properties") or {})
            if meta.get("d") not in (None, dim):
                raise ArtifactError(
                    f"collection {name!r}: {field!r} is {dim}-d but {IDENTITY_KEY} records d={meta['d']} ({line})"
                )
            rows = int(client.get_collection_stats(name, timeout=timeout).get("row_count", 0))
        except milvus_errors() as exc:
            client.close()
            raise GalleryUnavailable(f"Milvus at {settings.milvus_uri}: {_short(exc)} ({line})") from exc
        except ArtifactError:
            client.close()
            raise
        if not meta:
            log.warning("collection %s records no model identity (%s): identity checks skipped", name, IDENTITY_KEY)
        return cls(client, settings, field, primary, dim, index, rows, meta)

    @property
    def max_nprobe(self) -> int | None:
        """nlist for an IVF index (Milvus's bound when the server does not say), None for flat / graph indexes."""
        if not self.index_type.startswith("IVF"):
            return None
        return self.nlist if self.nlist is not None else MILVUS_MAX_NPROBE

    def search_params(self, k: int, nprobe: int, ef_search: int | None = None) -> dict[str, Any]:
        """The per-search parameters: nprobe for IVF, ef >= k for HNSW, none otherwise."""
        return search_params(self.index_type, self.metric, k, nprobe, ef_search)

    def search(
        self,
        queries: npt.ArrayLike,
        k: int,
        nprobe: int,
        exclude: Exclusion | None = None,
        ef_search: int | None = None,
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        """Top-k of queries [b, d] by the collection's IP / COSINE, skipping `exclude` (over-fetched): -1 pads.
        ef_search: an HNSW collection's ef for this call (None: at least HNSW_MIN_EF)."""
        q = checked_queries(queries, self.dim, k, nprobe, self.max_nprobe)
        scores = np.full((q.shape[0], k), PAD_SCORE, dtype=np.float32)
        ids = np.full((q.shape[0], k), -1, dtype=np.int64)
        if exclude is not None and len(exclude.ids) >= self.ntotal:
            return scores, ids  # every row moved: nothing here may answer (hybrid is the new search alone)
        if exclude is not None and len(exclude.ids):
            # An `id not in [...]` filter of up to millions of ids is no query to send: fetch more, drop locally.
            search = functools.partial(self.search, ef_search=ef_search)
            return excluding_by_overfetch(search, q, k, nprobe, exclude, max_fetch=MILVUS_MAX_TOPK)
        if q.shape[0] == 0:
            return scores, ids
        if self._problem is not None and time.monotonic() - self._failed_at < FAIL_FAST_S:
            # Just failed: answer at once rather than hold a worker thread for the whole timeout per request
            # (the default executor has few threads; requests queued behind stalled calls would wait longer).
            raise GalleryUnavailable(self._unavailable_message())
        try:
            hits = self._client.search(
                self.collection,
                data=q,
                limit=k,
                anns_field=self.field,
                output_fields=[self.primary],
                search_params=self.search_params(k, nprobe, ef_search),
                timeout=self.timeout_s,
            )
        except milvus_errors() as exc:
            self._failed("search", exc)
            raise GalleryUnavailable(self._unavailable_message()) from exc
        self._problem = None
        for row, found in enumerate(hits):
            n = min(len(found), k)
            # A hit carries its key under the primary field's own name ("id" only when the field is so named).
            ids[row, :n] = [hit[self.primary] for hit in found[:n]]
            scores[row, :n] = [hit["distance"] for hit in found[:n]]
        return scores, ids

    @property
    def client(self) -> Any:
        """The open client: a segment beside this collection shares its channel."""
        return self._client

    def _failed(self, call: str, exc: BaseException) -> None:
        """Remember the outage for /readyz, count it and log its cause (a response names no internals)."""
        self._problem = f"Milvus collection {self.collection!r} at {self.uri} is not answering"
        self._failed_at = time.monotonic()
        metrics.GALLERY_FAILURES.labels(call=call).inc()
        log.warning("milvus %s failed (%s): %s", call, type(exc).__name__, _short(exc))

    def _unavailable_message(self) -> str:
        """The 503's message: what did not answer and the deadline, nothing of the cause."""
        return (
            f"the gallery (Milvus collection {self.collection!r}) did not answer within "
            f"{self.timeout_s:g} s; retry later"
        )

    def describe(self) -> dict[str, Any]:
        """What /v1/info reports: collection, row count, index type and params, metric, dim."""
        index = {"index_type": self.index_type, "metric": self.metric, "nlist": self.nlist}
        return described(self, {"collection": self.collection}, index)

    def problem(self) -> str | None:
        """The last search's or probe's failure, until one succeeds."""
        return self._problem

    def probe(self) -> str | None:
        """Ask Milvus whether the collection is loaded (at most once per PROBE_INTERVAL_S); the problem or None."""
        with self._lock:
            now = time.monotonic()
            if now - self._probed_at < PROBE_INTERVAL_S:
                return self._problem
            self._probed_at = now
        try:
            state = self._client.get_load_state(self.collection, timeout=self.timeout_s).get("state")
        except milvus_errors() as exc:
            self._failed("probe", exc)
            return self._problem
        name = state_name(state)
        self._problem = None if name == "Loaded" else f"Milvus collection {self.collection!r} is {name}, not loaded"
        return self._problem

    def close(self) -> None:
        """Close the client's channel."""
        try:
            self._client.close()
        except milvus_errors():  # closing a channel to a dead server must not fail a shutdown
            pass
