"""Settings that are each valid but can never work together, as one clause each naming the variables to change.

Settings() refuses them when it is built (tree.py's `_refuse_contradictions`), not at the first request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.settings.names import env_name
from service.settings.sections import NO_MODEL, EncoderSettings
from service.vocabulary import Mode

if TYPE_CHECKING:
    from service.settings.tree import Settings

# The built-in backends that load a local model folder (encoders/registry.py); plug-ins check their own.
MODEL_FOLDER_BACKENDS = frozenset({"sentence-transformers", "clip"})
# The one backend `runtime: onnx` runs (encoders/onnx_runtime.py): a transformer and its pooling, as exported.
ONNX_BACKEND = "sentence-transformers"


def contradictions(settings: Settings) -> list[str]:
    """Each combination of settings that can never work, as one clause naming the variables to change."""
    problems = _cut_over_contradictions(settings)
    for role in ("old", "new"):
        encoder: EncoderSettings = getattr(settings, role)
        missing = [env_name(role, name) for name in ("dim", "model_id") if getattr(encoder, name) is None]
        if encoder.backend == "external" and missing:
            problems.append(
                f"{env_name(role, 'backend')}=external needs {' and '.join(missing)} "
                "(the width of the embeddings the client sends, and the name of their model)"
            )
        if encoder.backend in MODEL_FOLDER_BACKENDS and not encoder.path:
            problems.append(
                f"{env_name(role, 'backend')}={encoder.backend} needs {env_name(role, 'path')} (its local model folder)"
            )
        if encoder.runtime == "onnx" and encoder.backend != ONNX_BACKEND:
            problems.append(
                f"{env_name(role, 'runtime')}=onnx runs {env_name(role, 'backend')}={ONNX_BACKEND} models only "
                f"(not {encoder.backend})"
            )
        if encoder.runtime == "onnx" and not encoder.onnx_dir:
            problems.append(
                f"{env_name(role, 'runtime')}=onnx needs {env_name(role, 'onnx_dir')} "
                "(the folder `nobackfill encoder export` wrote)"
            )
    index = settings.index
    wanted = {
        "milvus_uri": "http://host:19530, or a milvus-lite ./x.db",
        "milvus_collection": "the collection to search",
    }
    missing = [f"{env_name('index', name)} ({what})" for name, what in wanted.items() if not getattr(index, name)]
    if index.backend == "milvus" and missing:
        problems.append(f"{env_name('index', 'backend')}=milvus needs {' and '.join(missing)}")
    unset = [env_name("index", name) for name in ("pgvector_dsn", "pgvector_table") if not getattr(index, name)]
    if index.backend == "pgvector" and unset:
        problems.append(f"{env_name('index', 'backend')}=pgvector needs {' and '.join(unset)}")
    in_database = [name for name in ("pgvector_new_column", "pgvector_new_table") if getattr(index, name) is not None]
    if in_database and index.backend != "pgvector":
        problems.append(
            f"{env_name('index', in_database[0])} is in the pgvector gallery's database: "
            f"it needs {env_name('index', 'backend')}=pgvector"
        )
    in_qdrant = [name for name in ("qdrant_new_vector", "qdrant_new_collection") if getattr(index, name) is not None]
    if in_qdrant and index.backend != "qdrant":
        problems.append(
            f"{env_name('index', in_qdrant[0])} is beside the Qdrant gallery's collection: "
            f"it needs {env_name('index', 'backend')}=qdrant"
        )
    if index.qdrant_new_vector is not None and index.qdrant_new_vector == (index.qdrant_vector or ""):
        problems.append(
            f"{env_name('index', 'qdrant_new_vector')} is the old model's vector "
            f"({env_name('index', 'qdrant_vector')}): the new rows go into a vector of their own"
        )
    if index.qdrant_new_collection is not None and index.qdrant_new_collection == index.qdrant_collection:
        problems.append(
            f"{env_name('index', 'qdrant_new_collection')} is the old model's collection "
            f"({env_name('index', 'qdrant_collection')}): the new rows go into a collection of their own"
        )
    if index.milvus_new_collection is not None and index.backend != "milvus":
        problems.append(
            f"{env_name('index', 'milvus_new_collection')} is beside the Milvus gallery's collection: "
            f"it needs {env_name('index', 'backend')}=milvus"
        )
    if index.milvus_new_collection is not None and index.milvus_new_collection == index.milvus_collection:
        problems.append(
            f"{env_name('index', 'milvus_new_collection')} is the old model's collection "
            f"({env_name('index', 'milvus_collection')}): the new rows go into a collection of their own"
        )
    in_milvus = ["milvus_new_collection"] if index.milvus_new_collection is not None else []
    named = [*in_database, *in_qdrant, *in_milvus, *(["segment_dir"] if index.segment_dir is not None else [])]
    if len(named) > 1:
        problems.append(f"{' and '.join(env_name('index', n) for n in named)} each name a segment: set one")
    if index.pgvector_new_column is not None and index.pgvector_new_column == index.pgvector_column:
        problems.append(
            f"{env_name('index', 'pgvector_new_column')} is the old model's column "
            f"({env_name('index', 'pgvector_column')}): the new rows go into a column of their own"
        )
    if index.backend == "qdrant" and (
        not index.qdrant_collection or (index.qdrant_url is None) == (index.qdrant_path is None)
    ):
        problems.append(
            f"{env_name('index', 'backend')}=qdrant needs {env_name('index', 'qdrant_collection')} and one of "
            f"{env_name('index', 'qdrant_url')} (a server) or {env_name('index', 'qdrant_path')} (local mode)"
        )
    if settings.traffic.store == "redis" and not (settings.traffic.redis_url or settings.cache.redis_url):
        problems.append(
            f"{env_name('traffic', 'store')}=redis needs a Redis URL: set {env_name('traffic', 'redis_url')} "
            f"or {env_name('cache', 'redis_url')} (or {env_name('traffic', 'store')}=local)"
        )
    api = settings.api
    if api.max_queries > api.max_in_flight:
        problems.append(
            f"{env_name('api', 'max_queries')}={api.max_queries} is over {env_name('api', 'max_in_flight')}="
            f"{api.max_in_flight}: a request of more queries than may be in flight would be refused (503) on "
            f"every retry (expected {env_name('api', 'max_queries')} <= {env_name('api', 'max_in_flight')})"
        )
    return problems


def _cut_over_contradictions(settings: Settings) -> list[str]:
    """The cut-over (old.backend none) serves the new model over the finished segment, in mode new, and nothing else."""
    problems = []
    if settings.new.backend == NO_MODEL:
        problems.append(f"{env_name('new', 'backend')}={NO_MODEL}: the new model is the one that is always served")
    if not settings.cut_over:
        return problems
    index = settings.index
    stores = (
        "segment_dir", "pgvector_new_column", "pgvector_new_table", "qdrant_new_vector", "qdrant_new_collection",
        "milvus_new_collection",
    )  # fmt: skip
    if all(getattr(index, name) is None for name in stores):
        problems.append(
            f"{env_name('old', 'backend')}={NO_MODEL} (the cut-over) needs {env_name('index', 'segment_dir')} "
            f"(or {env_name('index', 'pgvector_new_column')} / {env_name('index', 'pgvector_new_table')}, "
            f"{env_name('index', 'qdrant_new_vector')} / {env_name('index', 'qdrant_new_collection')}, "
            f"{env_name('index', 'milvus_new_collection')}): the finished segment is the only gallery then"
        )
    if settings.compat.default_mode not in (None, Mode.new):
        problems.append(
            f"{env_name('compat', 'default_mode')}={settings.compat.default_mode} after the cut-over "
            f"({env_name('old', 'backend')}={NO_MODEL}): only mode new is served (unset it, or set it to new)"
        )
    return problems
