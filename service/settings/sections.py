"""The sections of the settings tree (service/settings/tree.py's Settings): one model a section, one field a
setting, the docstring line under each field its one line of meaning (`nobackfill settings`, docs/settings.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from service.vocabulary import Merge, Mode

ARTIFACTS = Path("artifacts")
NO_MODEL = "none"  # old.backend after the cut-over


class Section(BaseModel):
    """One section of the settings tree: a key it does not have is a typo, refused rather than ignored."""

    # use_attribute_docstrings: the line under each field is its description, the one line of meaning
    # `nobackfill settings` and docs/settings.md print (commands/settings_reference.py).
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class EncoderSettings(Section):
    """One encoder: which backend, where it runs, how it batches."""

    backend: str = "synthetic-old"
    """synthetic-old/-new, sentence-transformers, clip, external or a plug-in; old only: none (the cut-over)."""
    # old.backend "none": the cut-over (docs/backfill.md): the new model alone over the finished segment.
    # Real backends (sentence-transformers, clip, plug-ins): the local model folder; never a hub name.
    path: str | None = None
    """Local model folder of a real backend (never downloaded from a hub)."""
    # Backend `external`: its width (required).  Real backends: the name recorded in artifacts and
    # compared at startup (default: the model folder's name); the weights' sha256 is compared too.
    dim: int | None = Field(None, ge=1)
    """Width of the embeddings: required with backend external (the client sends them)."""
    model_id: str | None = None
    """Model name recorded in artifacts and checked at startup (default: the model folder's name)."""
    device: str = "auto"
    """auto (cuda:0 / cuda:1 with two GPUs, shared with one, else cpu), cpu, or cuda:N."""
    # Half precision on CUDA (real backends).
    fp16: bool = True
    """Half precision on CUDA (real backends)."""
    # bfloat16 on CPU (real backends; float32 otherwise): worth it where the CPU multiplies bfloat16 in
    # hardware (AMX, AVX512-BF16); MiniLM's rows then agree with float32 to a cosine of 0.9999.
    cpu_bf16: bool = False
    """bfloat16 on CPU (real backends): faster where the CPU has AMX or AVX512-BF16."""
    # Torch threads of this encoder's worker on CPU; unset: the usable CPUs (the container's CPU limit,
    # else the cores: service/cpu_limit.py) split between the two encoders.
    threads: int | None = Field(None, ge=1)
    """Torch CPU threads of this encoder (unset: the usable CPUs, split between the two encoders)."""
    # How a sentence-transformers model runs: "torch" (the library itself), or "onnx": ONNX Runtime's CPU
    # provider over the graph `nobackfill encoder export` wrote into onnx_dir (fp32 or int8), with the
    # same tokenizer, pooling and normalisation; path stays the source model folder, whose weights must
    # be the ones the export was made from, so the model's identity (and the profile's match) is unchanged.
    runtime: Literal["torch", "onnx"] = "torch"
    """sentence-transformers: torch, or onnx (ONNX Runtime on CPU over onnx_dir, extra nobackfill[onnx])."""
    onnx_dir: str | None = None
    """runtime onnx: the folder `nobackfill encoder export` wrote from this encoder's path (fp32 or int8)."""
    # Copies of the model, each on its own worker thread, running batches side by side.  On a CPU
    # box N one-thread copies out-run one N-thread copy (no barrier waits between threads that
    # share the cores with the event loop and the other encoder); each copy costs the model's memory.
    replicas: int = Field(1, ge=1)
    """Copies of the model taking batches side by side (each costs the model's memory)."""
    # "process": each copy runs in a child process of its own (encoders/process.py), so its Python
    # work (tokenizer, the model's modules, every torch op re-taking the GIL) never waits behind the
    # event loop or the other encoder.  "thread": in the service's process, on its worker thread.
    # "auto": process for the built-in model backends (sentence-transformers, clip), thread otherwise.
    isolation: Literal["auto", "thread", "process"] = "auto"
    """process: each copy in a child process; thread: in the service's; auto: process for real models."""
    max_batch_size: int = Field(32, ge=1)
    """Most items in one encoder batch."""
    # A sentence-transformers transformer on CPU runs a batch as forward passes of at most this many
    # texts, sorted by length first, so short ones are not padded to the batch's longest
    # (docs/benchmarks.md: +27-56 % texts/s at batches of 16-32 real queries). 0: one pass per batch,
    # as on CUDA and for static models, which pad nothing.
    cpu_forward_batch_size: int = Field(4, ge=0)
    """sentence-transformers on CPU: texts per length-sorted forward pass (0: one pass)."""
    # 0: a call runs as soon as a replica is free, and the calls that arrive while a batch runs form
    # the next one (continuous batching).  A window only helps with several replicas under load; with
    # one (the default) it is latency: +2.2 ms p50 a query at 2 ms (docs/benchmarks.md).
    max_wait_ms: float = Field(0.0, ge=0)
    """How long a batch waits for more items before it runs (0: runs as soon as a replica is free)."""
    # Off only for benchmarks: every call then runs alone on the encoder.
    batching: bool = True
    """Gather concurrent calls into batches (off only for benchmarks)."""
    # A batch with no answer after this long fails (504 encoder_timeout) and its replica is set
    # aside until the call returns; /readyz is 503 while every replica is stuck like that.
    timeout_s: float = Field(30.0, gt=0)
    """A batch with no answer after this long fails: 504 encoder_timeout."""
    # An input that hung this encoder alone (its call timed out with no batch-mate to blame) is refused
    # at once for this long (422 poison_input), so a client retrying it does not stick a replica
    # again; at most poison_capacity inputs are remembered, by a hash of the input.  0: never refused.
    poison_ttl_s: float = Field(600.0, ge=0)
    """An input that alone hung the encoder is refused (422 poison_input) this long; 0: never."""
    poison_capacity: int = Field(10_000, ge=1)
    """Most hung inputs remembered at once (by a hash of the input)."""
    # `isolation: thread`: a call cannot be interrupted.  Up to this many calls that run past 10 x their
    # measured cost (at least 0.25 s) keep running on threads of their own while a fresh thread takes
    # their replica's place, so a hung input holds a replica for 0.25 s, not timeout_s (the encoder then
    # sees two calls at once: set 0 for a model that cannot take that).  Past it, a replica whose call
    # times out is set aside until the call returns.  0: always set aside.
    # A child process (`isolation: process`) is killed at the timeout and replaced instead.
    stuck_threads: int = Field(2, ge=0)
    """isolation thread: overrunning calls that may run on aside while a fresh thread serves (0: none)."""
    # `isolation: process`: a child that has not loaded and warmed its model after this long is
    # killed and the start (or the restart) fails, rather than wait on a hung load forever.
    load_timeout_s: float = Field(300.0, gt=0)
    """isolation process: a child not loaded and warm after this long is killed; the start fails."""
    # Simulated per-batch cost (base + per item), to give synthetic encoders a real model's latency.
    simulated_cost_ms: float = Field(0.0, ge=0)
    """Synthetic backends: added cost per batch, to mimic a real model's latency."""
    simulated_cost_per_item_ms: float = Field(0.0, ge=0)
    """Synthetic backends: added cost per item of a batch."""


class CacheSettings(Section):
    """Old-embedding cache: Redis when a URL is set, an in-process LRU otherwise."""

    redis_url: str | None = None
    """Redis of the old-embedding cache, e.g. redis://127.0.0.1:6379/0; unset: an in-process LRU."""
    namespace: str = "nobackfill"
    """Prefix of the cache's Redis keys."""
    ttl_s: int = Field(7 * 24 * 3600, ge=1)
    """A cached old embedding expires after this long (Redis)."""
    dtype: Literal["float16", "float32"] = "float16"
    """Cached old embeddings as float16 or float32."""
    socket_timeout_s: float = Field(0.05, gt=0)
    """A Redis call (or connect) past this fails and counts as a miss: the cache fails open."""
    error_threshold: int = Field(3, ge=1)
    """Redis errors in a row after which the cache is skipped for cooldown_s."""
    cooldown_s: float = Field(10.0, ge=0)
    """How long Redis is skipped after error_threshold errors in a row, before one trial call."""
    lru_size: int = Field(100_000, ge=0)
    """Rows of the in-process LRU used without Redis; 0: no cache at all."""
    max_connections: int = Field(64, ge=1)  # per process (per node for a cluster): the pool never grows past it
    """Redis connections per process; a burst waits up to socket_timeout_s for one, then misses."""


class IndexSettings(Section):
    """The frozen old-model gallery."""

    gallery_dir: Path = ARTIFACTS / "gallery"
    """The frozen old-model gallery folder (nobackfill gallery build)."""
    nprobe: int = Field(16, ge=1)
    """IVF lists probed per query when a request names none (capped at the gallery's nlist)."""
    # FAISS's threads per search are OpenMP's: OMP_NUM_THREADS caps them (no setting of ours, which
    # would have to change process-wide OpenMP state under concurrent searches).
    # How each search picks its nprobe lists: "flat" scans every centroid exactly; "hnsw" searches a
    # graph built over them at load (4-8x faster at 10^7 items, see index/graph_quantizer.py);
    # "auto" uses the graph on CPU from 4,096 lists up.  coarse_ef: the graph's efSearch.
    coarse: Literal["auto", "flat", "hnsw"] = "auto"
    """How a search picks its lists: flat (exact), hnsw (graph over the centroids), auto (hnsw on CPU, >= 4,096)."""
    coarse_ef: int = Field(128, ge=1)
    """coarse hnsw: the graph's efSearch."""
    # An adopted HNSW index (`gallery adopt`) is searched at the efSearch its file stores (faiss's default
    # is 16) unless this names another: the file is never rewritten.  `gallery eval` shows what each costs.
    adopted_ef_search: int | None = Field(None, ge=1)
    """An adopted HNSW index: efSearch of each search (unset: the one stored in its file; at least k)."""
    # "milvus": search an existing Milvus collection read-only instead of gallery_dir (docs/scale-out.md).
    backend: Literal["faiss", "milvus", "pgvector", "qdrant"] = "faiss"
    """faiss (gallery_dir), milvus or qdrant (an existing collection), pgvector (your table); read-only."""
    milvus_uri: str | None = None  # http://host:19530, or a milvus-lite ./x.db for development
    """backend milvus: http://host:19530, or a milvus-lite ./x.db."""
    milvus_collection: str | None = None
    """backend milvus: the collection to search."""
    milvus_token: SecretStr | None = None  # "user:password" or an API key; unset: no auth
    """backend milvus: user:password or an API key; unset: no auth."""
    # Every Milvus call (search, readiness probe) fails after this long: 503 gallery_unavailable, never a hang.
    milvus_timeout_s: float = Field(2.0, gt=0)
    """backend milvus: a call past this fails (503 gallery_unavailable)."""
    # The migration beside the collection (segment/milvus_collection.py): the new model's rows in a second
    # collection of nobackfill's own, same primary keys, created by `backfill run --add-collection`; the
    # user's collection is never written.  Set, the default mode is hybrid.
    milvus_new_collection: str | None = None
    """backend milvus: the new model's rows in a collection of nobackfill's own (the segment), e.g. items_v2."""
    # "pgvector": the user's PostgreSQL table of old-model vectors, searched read-only (index/pgvector.py).
    pgvector_dsn: SecretStr | None = None
    """backend pgvector: the connection string, postgresql://user:password@host:5432/db."""
    pgvector_table: str | None = None
    """backend pgvector: the table (schema.table allowed) holding the old model's vectors."""
    pgvector_id_column: str = "id"
    """backend pgvector: the integer column of gallery ids."""
    pgvector_column: str = "embedding"
    """backend pgvector: the vector column of the old model's rows."""
    pgvector_ef_search: int = Field(40, ge=1)
    """backend pgvector: hnsw.ef_search for an HNSW index (at least k)."""
    # Each search statement (the gallery's, and the new rows' beside it) and each lock it waits for gives up
    # after this long: 503 gallery_unavailable, never a search thread held by a lock or a slow plan.
    pgvector_timeout_s: float = Field(2.0, gt=0)
    """backend pgvector: a search (or a lock it waits for) past this fails (503 gallery_unavailable)."""
    # The migration in the table's own form (segment/pgvector_column.py): the new model's rows in a
    # second vector column, added by `backfill run --add-column`; set, the default mode is hybrid.
    pgvector_new_column: str | None = None
    """backend pgvector: the new model's vector column of the same table (the segment), e.g. embedding_v2."""
    # Or a side table of nobackfill's own in the same database, (id, embedding), created by `backfill run
    # --add-table`: the user's table is never written (no UPDATE: its indexes and size stay as they are).
    pgvector_new_table: str | None = None
    """backend pgvector: the new model's rows in a side table of nobackfill's own (the segment), e.g. items_v2."""
    # "qdrant": the user's Qdrant collection, searched read-only (index/qdrant.py).
    qdrant_url: str | None = None
    """backend qdrant: the server, http://host:6333."""
    qdrant_path: Path | None = None
    """backend qdrant: a folder for qdrant-client's embedded local mode (development, tests), instead of a url."""
    qdrant_collection: str | None = None
    """backend qdrant: the collection holding the old model's vectors."""
    qdrant_vector: str | None = None
    """backend qdrant: the named vector of the old model (unset: the collection's default vector)."""
    qdrant_api_key: SecretStr | None = None
    """backend qdrant: the server's API key."""
    qdrant_hnsw_ef: int | None = Field(None, ge=1)
    """backend qdrant: hnsw_ef of each search (unset: the collection's own)."""
    # The migration in the collection's own form (segment/qdrant_vector.py): the new model's rows in a
    # named vector of the same collection, added by `backfill run --add-vector`; set, the default mode is hybrid.
    qdrant_new_vector: str | None = None
    """backend qdrant: the new model's named vector of the same collection (the segment), e.g. embedding_v2."""
    # Or a second collection of nobackfill's own, same point ids, created by `backfill run --add-collection`
    # (a server older than 1.18, which cannot add a vector): the user's collection is never written.
    qdrant_new_collection: str | None = None
    """backend qdrant: the new model's rows in a collection of nobackfill's own (the segment), e.g. items_v2."""
    # Threads of the pipeline's own search pool (the heads and the gallery search), apart from the pool
    # that decodes images and runs probes.  Unset: one per usable CPU; for Milvus, which waits, CPUs + 4.
    search_threads: int | None = Field(None, ge=1)
    """Threads running the heads and the gallery search (unset: the usable CPUs; Milvus: CPUs + 4)."""
    # The new-model segment beside the frozen gallery (docs/backfill.md): set, the default mode is hybrid.
    # A folder with no segment.json yet is served as empty until `backfill run` creates it.
    segment_dir: Path | None = None
    """The new-model segment `backfill run` fills; set, the service searches both (mode hybrid)."""
    # How often the service looks for shards published since (new ones are searched from then on).
    segment_refresh_s: float = Field(5.0, gt=0)
    """How often the service looks for newly published segment shards."""
    # The segment's sealed indexes (HNSW graphs `backfill run` / `backfill index` store in it) are
    # searched at ef_search candidates, the rows they do not cover exactly (segment/sealed.py).  exact:
    # every row exactly, sealed indexes unread (the re-indexed answer to the last digit, at a cost that
    # grows with the rows).
    segment_exact: bool = False
    """Search every segment row exactly, leaving its sealed HNSW indexes unread."""
    # A request's ef_search (up to api.max_ef_search) overrides it for that request.  Unset, each sealed index
    # searches at the width its seal measured to find 0.99 of the exact top 10 (the recall a given ef finds
    # falls as the index grows: docs/backfill.md); an index sealed before seals measured one, at 128.
    segment_ef_search: int | None = Field(None, ge=1)
    """A sealed HNSW index's efSearch when a request names none; unset: the one its seal measured for recall 0.99."""
    # The recall the traffic finds (segment/recall_sample.py): one segment search in this many is searched again
    # exactly in the background, over the same rows, and the share of the exact top k it held is recorded.
    segment_recall_every: int = Field(1000, ge=0)
    """One in this many segment searches is measured against an exact search in the background (0: none)."""
    # How hybrid puts both lists on one scale: the profile's fitted calibration (raw cosines when it has
    # none), raw cosines, or reciprocal rank fusion.
    hybrid_merge: Merge = Merge.calibrated
    """How hybrid puts the gallery's and the segment's scores on one scale: calibrated, raw or rrf."""
    # The gallery's raw items (nobackfill encode --items-out): read-only here, for what re-encodes them.
    item_store: Path | None = None
    """The gallery's raw items (encode --items-out): the re-rank cascade encodes them; the page shows them."""


class CascadeSettings(Section):
    """The re-rank cascade (docs/backfill.md): stage-1 candidates re-ranked by the new query against their new rows."""

    # How many of stage 1's hits are re-ranked (the requested k, when larger, wins).
    candidates: int = Field(50, ge=1, le=1000)
    """Stage-1 hits re-ranked by the new model (a larger requested k wins)."""
    # Per query: at most this many candidates with no row in the segment are encoded from the item store
    # on the request's path; the others keep their stage-1 order below the re-ranked ones.
    encode_budget: int = Field(10, ge=0, le=1000)
    """Per query: most candidates without a segment row encoded on the request's path."""
    # A request waits this long for its candidates' encodings; later ones still reach the segment.
    encode_timeout_s: float = Field(2.0, gt=0)
    """How long a request waits for its candidates' encodings."""
    # With an item store, hybrid re-ranks too (mode cascade always does).
    in_hybrid: bool = True
    """With an item store, hybrid re-ranks too (mode cascade always does)."""
    # Candidates encoded on the path are published into index.segment_dir (a lazy, traffic-ordered
    # backfill): a shard once shard_rows wait or flush_s has passed since the first of them.
    write_segment: bool = True
    """Publish what the cascade encodes into segment_dir: a backfill ordered by traffic."""
    shard_rows: int = Field(1024, ge=1)
    """The cascade publishes a shard once this many encoded rows wait (or flush_s has passed)."""
    flush_s: float = Field(2.0, gt=0)
    """The cascade publishes its waiting rows at most this long after the first of them."""
    # Rows waiting to be published; past it new ones are dropped (counted), e.g. while the disk is full.
    max_pending: int = Field(100_000, ge=1)
    """Rows waiting to be published; past it new ones are dropped (counted)."""


class CompatSettings(Section):
    """The compatibility profile and the default head."""

    profile_dir: Path = ARTIFACTS / "profile"
    """The compatibility profile folder (nobackfill fit)."""
    # Mode for requests that name none; unset means the profile's own head (slerp, adapter, psp, ...).
    default_mode: Mode | None = None
    """Mode of a request that names none (unset: the profile's head; hybrid with a segment)."""
    # Off only for benchmarks: the old encoder then finishes before the new one starts.
    concurrent_encoders: bool = True
    """Run the old and the new encoder side by side (off only for benchmarks)."""
    # The gallery's hubness sidecar (`nobackfill gallery hubness`): queries answered by the profile's head
    # are re-ranked over hubness_candidates hits, each score less its item's bias (compat/hubness.py).
    hubness_dir: Path | None = None
    """The gallery's hubness sidecar (gallery hubness): the head's hits re-ranked, less each item's bias."""
    hubness_candidates: int = Field(100, ge=1, le=10_000)
    """Hits the hubness correction re-ranks."""


class ApiSettings(Section):
    """HTTP server and request limits."""

    host: str = "127.0.0.1"
    """Address nobackfill serve binds."""
    port: int = Field(8000, ge=1, le=65535)
    """Port nobackfill serve (and nobackfill demo, without --port) listens on."""
    workers: int = Field(1, ge=1)
    """uvicorn worker processes."""
    # One access line per request, with its request id (ours: uvicorn's own is always off).  They cost
    # the event loop real time at hundreds of requests per second; /metrics counts every request anyway.
    access_log: bool = False
    """One access line per request, with its request id."""
    # Bearer key of the search routes; unset: they are open.
    api_key: SecretStr | None = None
    """Bearer key the search routes require; unset: they are open."""
    # Bearer key of the admin routes, separate from api_key; unset: the admin routes do not exist (404).
    admin_key: SecretStr | None = None
    """Bearer key of /v1/admin/*; unset: those routes do not exist (404)."""
    # The admin reload only loads profile folders under this one (symlinks and `..` resolved first).
    # Unset: the folder that holds compat.profile_dir, where its sibling profiles live.
    profiles_root: Path | None = None
    """Admin reloads load only profile folders under it (unset: the folder holding profile_dir)."""
    # Serve /metrics on this port (same host) instead of the main one; unset: on the main port.
    metrics_port: int | None = Field(None, ge=1, le=65535)
    """Serve /metrics on this port instead of the main one."""
    max_queries: int = Field(64, ge=1)
    """Queries per request (more: 413)."""
    max_text_chars: int = Field(2048, ge=1)
    """Characters per text query."""
    max_image_bytes: int = Field(8 * 1024 * 1024, ge=1)
    """Decoded bytes per image query (more: 400)."""
    # Width x height an image query may declare (read from its header; 400 past it).  Bytes do not bound
    # it: a 420 kB PNG of 10,000 x 10,000 pixels held its whole batch 3.7 s in the clip backend's decode
    # and resize (a tiny CLIP, one thread; 16 MP took 0.29 s).  25 MP holds a 12 MP phone photo twice over.
    max_image_pixels: int = Field(25_000_000, ge=1)
    """Width x height an image query may declare in its header (more: 400)."""
    # Request bodies over this are refused with 413 while they are read (and at once when the
    # Content-Length says so).  16 MiB holds one image at max_image_bytes (10.7 MiB as base64) or a
    # full request of max_queries images of ~190 kB each, while bounding what one request can pin.
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    """Request body cap (more: 413, as soon as it is known)."""
    max_k: int = Field(1000, ge=1)
    """Largest k a request may ask for."""
    # A graph search's cost grows with its ef; without a bound one request could walk a whole graph.
    max_ef_search: int = Field(4096, ge=1)
    """Largest ef_search a request may ask for (4x the widest a seal measures)."""
    max_in_flight: int = Field(256, ge=1)
    """Queries in flight per worker before 503 + Retry-After."""
    # A search is admitted only while the wait it can expect in front of the encoders (queued items
    # over each encoder's measured service rate, after the cache's hits) is under this; past it, 503
    # overloaded with a Retry-After from the estimate.  An admitted search still queued twice this
    # long is answered 503 before it is encoded, and a batch gathers no more items than its measured cost
    # says end within half of it (pipeline/parts.py's BATCH_SHARE).  max_in_flight stays the hard memory bound.  0: off.
    max_queue_ms: float = Field(250.0, ge=0)
    """A search is admitted while its expected wait for the encoders is under this (503 past it); 0: off."""
    # While the event loop wakes later than this, searches are refused with 503 before their body is
    # read (api/admission.py): the queue past the CPU's capacity, which max_in_flight never sees.  0: off.
    shed_lag_ms: float = Field(150.0, ge=0)
    """While the event loop runs this late, searches get 503 before any work; 0: off."""
    # SIGTERM: in-flight requests get this long to finish before the process exits anyway; keep it
    # below the orchestrator's grace period (Kubernetes terminationGracePeriodSeconds, default 30).
    shutdown_grace_s: int = Field(20, ge=1)
    """On SIGTERM, seconds in-flight requests get before the process exits."""
    # The operator page at /ui (api/ui/: old and new answers side by side, the profile, health).  Off by
    # default: a search service exposes no browser page unless asked to; with api_key set it asks for it.
    ui: bool = False
    """Serve the operator page at /ui/ (docs/ui.md)."""
    # What the page's profile view shows beside the fit report: a saved `eval ... --json-out` of the
    # served profile, and a saved `profile compare ... --json-out` whose current profile is the served
    # one (compat/saved.py).  A file that is not one, or scores another profile, is refused at startup.
    ui_eval: Path | None = None
    """A saved `eval --json-out` of the served profile, shown on the page's profile view."""
    ui_compare: Path | None = None
    """A saved `profile compare --json-out` against the served profile, shown on the page."""


class TrafficSettings(Section):
    """Sampling (old, new) query-embedding pairs from live traffic for refitting R (docs/traffic-learning.md)."""

    # Fraction of blending-mode queries whose two embeddings are stored (float16, never the input
    # itself).  0, the default, stores nothing: no sampler is even created.
    sample_rate: float = Field(0.0, ge=0.0, le=1.0)
    """Share of blending-mode queries whose (old, new) embeddings are stored for refitting R; 0: off."""
    # The store keeps at most this many pairs (the oldest go first) and none older than ttl_s.
    max_pairs: int = Field(100_000, ge=1)
    """Most pairs the store keeps (the oldest go first)."""
    ttl_s: int = Field(7 * 24 * 3600, ge=1)
    """No stored pair is kept longer than this."""
    # auto: the Redis stream when a Redis URL is set (redis_url, else cache.redis_url), local shards otherwise.
    store: Literal["auto", "redis", "local"] = "auto"
    """Where pairs go: redis, local (shards in local_dir), or auto (Redis when a URL is set)."""
    redis_url: str | None = None
    """Redis of the pairs and hit counts (unset: cache.redis_url)."""
    stream_key: str = "nobackfill:traffic"
    """The Redis stream holding the pairs."""
    local_dir: Path = ARTIFACTS / "traffic"
    """store local: the folder of the pair shards."""
    # Batches of sampled pairs waiting for the drain thread; past it, pairs are dropped (counted).
    queue_size: int = Field(1024, ge=1)
    """Batches of pairs waiting to be written; past it, pairs are dropped (counted)."""
    # The drain thread writes at least this often while pairs wait.
    flush_s: float = Field(0.5, gt=0)
    """The writer writes at least this often while pairs wait."""
    # Share of result lists whose gallery ids are counted, for `backfill run --order hot` (hottest
    # items move first; traffic/hits.py).  0, the default, counts nothing.  Counts live in Redis when
    # a URL is set (as for the pairs), in hits_dir otherwise; at most hits_capacity ids are kept, and
    # every count halves each hits_half_life_s, so they say what is hot now.
    hit_rate: float = Field(0.0, ge=0.0, le=1.0)
    """Share of result lists whose ids are counted, for `backfill run --order hot`; 0: off."""
    hits_dir: Path = ARTIFACTS / "hits"
    """Hit counts' folder when no Redis URL is set."""
    hits_key: str = "nobackfill:hits"
    """The Redis key of the hit counts."""
    hits_capacity: int = Field(1_000_000, ge=1)
    """Most ids whose hits are counted."""
    hits_half_life_s: float = Field(86_400.0, gt=0)
    """Every hit count halves this often, so the counts say what is hot now."""
