"""`create_cache`: pick the cache backend from the settings."""

from __future__ import annotations

from service.cache.base import EmbeddingCache
from service.cache.memory import LruCache, NullCache
from service.settings import CacheSettings


def create_cache(settings: CacheSettings, old_model_id: str, dim: int) -> EmbeddingCache:
    """Redis when `redis_url` is set, else an LRU of `lru_size` rows, else (size 0) the null cache."""
    if settings.redis_url:
        # Imported here so a service without Redis never loads redis-py.
        from service.cache.redis_cache import RedisCache

        return RedisCache.from_settings(settings, old_model_id, dim)
    if settings.lru_size == 0:
        return NullCache(dim)
    return LruCache(settings.lru_size, dim, settings.dtype)
