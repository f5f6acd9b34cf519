"""Old-embedding cache: Redis (shared, fail-open) or an in-process LRU, behind `EmbeddingCache`.

    create_cache(settings, old_model_id, dim) -> EmbeddingCache
        RedisCache   kind "redis"   state "ok" | "cooling_down"     (redis_cache.py, breaker.py)
        LruCache     kind "memory"  state "memory"                  (memory.py)
        NullCache    kind "off"     state "off"                     (memory.py)

Key: `{namespace}:{old_model_id}:{sha256(modality NUL input)}`; value: one row of float16
(default) or float32 little-endian bytes (base.py). No backend raises on backend trouble.
"""

from __future__ import annotations

from service.cache.base import CacheKind, CacheState, EmbeddingCache, cache_key
from service.cache.factory import create_cache

__all__ = ["CacheKind", "CacheState", "EmbeddingCache", "cache_key", "create_cache"]
