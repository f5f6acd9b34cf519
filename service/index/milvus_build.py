"""Load old-model vectors into a Milvus collection for users who have none yet; describe one.

    create the collection ──► insert in batches ──► flush ──► create the index (after the load: one
        training pass over all rows) ──► load for search
    reopen it (a resumed build) ──► index it if it has none, load it ──► insert the ids it lacks ──► ...

Resumable: an interrupted build re-run with the same arguments asks Milvus which ids of each batch it
already holds and inserts only the rest (Milvus would otherwise keep duplicate primary keys), then
goes on to the index.  Reopening checks the collection is this gallery: same dim, same old model.
The model identity (the block gallery.json holds) goes into the collection's properties under
milvus.IDENTITY_KEY, where the service reads it back; this is the only place nobackfill writes to
Milvus, and only from this command.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from service.errors import ArtifactError, GalleryUnavailable, InputError
from service.index.milvus import IDENTITY_KEY, index_of, milvus_errors, read_identity, state_name, vector_field
from service.index.sources import NpySource, SyntheticSource

FORMAT_VERSION = 1
VECTOR_FIELD = "vector"
PRIMARY_FIELD = "id"
# Rows per insert call: 2,000 x 512 floats is ~4 MiB per gRPC message, under Milvus's 64 MiB cap at
# any dim up to 4,096 (32 MiB), and big enough that per-call overhead stays small.
BATCH_ROWS = 2000
INDEX_TYPES = ("IVF_PQ", "IVF_FLAT", "IVF_SQ8", "HNSW", "FLAT", "AUTOINDEX")
# What the embedded milvus-lite (a ./x.db URI) builds, by its own refusal message (pymilvus 3 / milvus-lite
# 3.2): IVF_PQ is not among them.  IVF_FLAT is the default there: it keeps nprobe, as IVF_PQ does.
LITE_INDEX_TYPES = ("IVF_FLAT", "IVF_SQ8", "HNSW", "HNSW_SQ", "BRUTE_FORCE", "FLAT", "AUTOINDEX")
DEFAULT_INDEX, LITE_DEFAULT_INDEX = "IVF_PQ", "IVF_FLAT"


def is_lite(uri: str) -> bool:
    """Whether a Milvus URI names an embedded milvus-lite file rather than a server."""
    return not uri.startswith(("http://", "https://", "tcp://", "grpc://", "unix:"))


def chosen_index(index: str | None, uri: str) -> str:
    """The --index to build at `uri`: the target's default when none is given; InputError, before any row is
    inserted, for one the target does not build."""
    lite = is_lite(uri)
    if index is None:
        return LITE_DEFAULT_INDEX if lite else DEFAULT_INDEX
    wanted, known = index.upper(), LITE_INDEX_TYPES if lite else INDEX_TYPES
    if wanted not in known:
        target = f"milvus-lite ({uri})" if lite else f"the Milvus server at {uri}"
        raise InputError(
            f"--index {index}: {target} does not build it; give one of {', '.join(known)} "
            f"(default there: {known[0] if lite else DEFAULT_INDEX})"
        )
    return wanted


def index_params(index_type: str, nlist: int | None, pq_m: int, ntotal: int, dim: int) -> dict[str, Any]:
    """Milvus build params for index_type; InputError for an unknown type or a pq_m that does not divide dim."""
    if index_type not in {*INDEX_TYPES, *LITE_INDEX_TYPES}:
        raise InputError(
            f"--index must be one of {', '.join(dict.fromkeys([*INDEX_TYPES, *LITE_INDEX_TYPES]))}, got {index_type!r}"
        )
    lists = nlist if nlist is not None else max(1, min(65536, int(4 * np.sqrt(max(ntotal, 1)))))
    if index_type == "IVF_PQ":
        if dim % pq_m:
            raise InputError(f"--pq-m {pq_m} must divide the dimension {dim}")
        return {"nlist": lists, "m": pq_m, "nbits": 8}
    if index_type.startswith("IVF"):
        return {"nlist": lists}
    if index_type.startswith("HNSW"):
        return {"M": 16, "efConstruction": 200}
    return {}


def build_collection(
    client: Any,
    collection: str,
    source: NpySource | SyntheticSource,
    index_type: str = "IVF_PQ",
    nlist: int | None = None,
    pq_m: int = 64,
    metric: str = "IP",
    batch_rows: int = BATCH_ROWS,
    progress: bool = False,
    log: Callable[[str], None] = lambda _line: None,
) -> dict[str, Any]:
    """Create or resume `collection` from source, index and load it; returns counts and timings."""
    from service.progress import progress_bar

    if metric not in ("IP", "COSINE"):
        raise InputError(f"--metric must be IP or COSINE (unit vectors ranked by inner product), got {metric!r}")
    params = index_params(index_type, nlist, pq_m, source.ntotal, source.dim)
    identity = {
        "format_version": FORMAT_VERSION,
        "d": source.dim,
        "metric": metric,
        "old_model_id": source.model_id,
        "old_model": source.old_model,
        "index": {"type": index_type, "params": params},
        "source": source.describe(),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    started = time.perf_counter()
    try:
        existing = _open_or_create(client, collection, source, identity)
        if existing:  # asking which ids are there needs a loaded collection, and loading needs an index
            if index_of(client, collection, VECTOR_FIELD, timeout_s=60.0) is None:
                _create_index(client, collection, index_type, metric, params, log)
            client.load_collection(collection)
        inserted = skipped = 0
        with progress_bar(total=source.ntotal, unit="vec", unit_scale=True, desc="inserting", enabled=progress) as bar:
            for start in range(0, source.ntotal, batch_rows):
                stop = min(start + batch_rows, source.ntotal)
                ids = source.ids(start, stop)
                keep = _absent(client, collection, ids) if existing else np.ones(len(ids), dtype=bool)
                if keep.any():
                    rows = source.rows(np.arange(start, stop, dtype=np.int64)[keep])
                    client.insert(
                        collection,
                        [{PRIMARY_FIELD: int(i), VECTOR_FIELD: row} for i, row in zip(ids[keep], rows, strict=True)],
                    )
                inserted += int(keep.sum())
                skipped += int((~keep).sum())
                bar.update(stop - start)
        loaded_s = time.perf_counter() - started
        client.flush(collection)
        index = index_of(client, collection, VECTOR_FIELD, timeout_s=60.0)
        if index is None:
            _create_index(client, collection, index_type, metric, params, log)
        elif str(index.get("index_type")).upper() != index_type:
            log(f"note: {collection} keeps its {index.get('index_type')} index (drop it to build {index_type})")
        client.load_collection(collection)
        rows_now = int(client.get_collection_stats(collection).get("row_count", 0))
    except milvus_errors() as exc:
        raise GalleryUnavailable(f"Milvus refused or stopped answering while building {collection!r}: {exc}") from exc
    return {
        "collection": collection,
        "inserted": inserted,
        "skipped": skipped,
        "row_count": rows_now,
        "index": index_type,
        "params": params,
        "load_s": loaded_s,
        "total_s": time.perf_counter() - started,
    }


def _create_index(
    client: Any, collection: str, index_type: str, metric: str, params: dict[str, Any], log: Callable[[str], None]
) -> None:
    """Build the vector index over what the collection holds now (Milvus indexes later inserts as they seal)."""
    log(f"indexing {collection}: {index_type} {params} ({metric})")
    client.flush(collection)
    # pymilvus 3 sends the params as flat key-value pairs, milvus-lite 3.2 reads only a JSON `params`
    # pair (and silently builds its default nlist): both, with the same values; Milvus reads either.
    both = {**params, "params": params} if params else {}
    spec = client.prepare_index_params()
    spec.add_index(field_name=VECTOR_FIELD, index_type=index_type, metric_type=metric, params=both)
    try:
        client.create_index(collection, spec)
    except milvus_errors() as exc:
        if "already exists" in str(exc):
            # pymilvus retries a call whose connection dropped (a long build outlives gRPC keepalives):
            # the retry finds the index the first attempt built.
            log(f"note: {collection} already has its index (a retried call)")
        else:
            # milvus-lite records a refused index (IVF_PQ) before refusing it: drop it, so that a re-run with
            # another --index builds that one instead of keeping a broken one.  Best effort; the refusal stands.
            with contextlib.suppress(*milvus_errors()):
                client.release_collection(collection)
                client.drop_index(collection, VECTOR_FIELD)
            raise
    # The identity says which index was built (a resumed build may build another than the first run asked for).
    recorded = read_identity(client.describe_collection(collection).get("properties") or {})
    if recorded:
        recorded["index"] = {"type": index_type, "params": params}
        client.alter_collection_properties(collection, properties={IDENTITY_KEY: json.dumps(recorded)})


def _open_or_create(
    client: Any, collection: str, source: NpySource | SyntheticSource, identity: dict[str, Any]
) -> bool:
    """True when the collection existed (a resumed build), after checking it holds this gallery's vectors."""
    from pymilvus import DataType, MilvusClient

    if client.has_collection(collection):
        description = client.describe_collection(collection)
        _, dim, _ = vector_field(description)
        recorded = read_identity(description.get("properties") or {})
        where = source.path if isinstance(source, NpySource) else "the synthetic world"
        if dim != source.dim:
            raise ArtifactError(f"collection {collection!r} holds {dim}-d vectors; {where} is {source.dim}-d")
        if recorded and recorded.get("old_model_id") != source.model_id:
            raise ArtifactError(
                f"collection {collection!r} holds model {recorded.get('old_model_id')!r}; "
                f"{where} is {source.model_id!r} (one collection, one model)"
            )
        if not recorded:
            client.alter_collection_properties(collection, properties={IDENTITY_KEY: json.dumps(identity)})
        return True
    schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field(PRIMARY_FIELD, DataType.INT64, is_primary=True)
    schema.add_field(VECTOR_FIELD, DataType.FLOAT_VECTOR, dim=source.dim)
    client.create_collection(collection, schema=schema, properties={IDENTITY_KEY: json.dumps(identity)})
    return False


def _absent(client: Any, collection: str, ids: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """Mask of the ids this collection does not hold yet."""
    found = client.query(
        collection, filter=f"{PRIMARY_FIELD} in {ids.tolist()}", output_fields=[PRIMARY_FIELD], limit=len(ids)
    )
    present = {int(row[PRIMARY_FIELD]) for row in found}
    return np.fromiter((int(i) not in present for i in ids), dtype=bool, count=len(ids))


def describe_collection(client: Any, collection: str) -> dict[str, Any]:
    """What `gallery info --backend milvus` prints: fields, index, row count, load state, recorded identity
    (`serve` refuses a collection with no index: Milvus cannot load one)."""
    try:
        if not client.has_collection(collection):
            raise ArtifactError(f"no collection {collection!r}")
        description = client.describe_collection(collection)
        field, dim, primary = vector_field(description)
        state = state_name(client.get_load_state(collection).get("state"))
        return {
            "collection": collection,
            "vector_field": field,
            "primary_key": primary,
            "dim": dim,
            "row_count": int(client.get_collection_stats(collection).get("row_count", 0)),
            "index": index_of(client, collection, field, timeout_s=60.0),
            "load_state": state,
            IDENTITY_KEY: read_identity(description.get("properties") or {}),
        }
    except milvus_errors() as exc:
        raise GalleryUnavailable(f"Milvus did not answer about {collection!r}: {exc}") from exc


def progress_default() -> bool:
    """A progress bar when stderr is a terminal."""
    return sys.stderr.isatty()
