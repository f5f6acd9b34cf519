"""Sampling (old, new) query-embedding pairs from live traffic, for refitting R (docs/traffic-learning.md).

    pipeline.search ──► TrafficSampler.offer (event loop: one random draw, float16 copies of the few
                        │                    sampled rows, offered to a bounded sink; full: dropped)
                        ▼
             the sink's thread ──► PairStore.append   RedisPairStore (a stream capped by MAXLEN, TTL)
                                                      LocalPairStore (rotating .npz shards, bounded, TTL)
    nobackfill traffic export ──► PairStore.read ──► old_query.npy, new_query.npy, models.json

Only embeddings (float16) and the two model identities are stored, never a query's text or image.
Every store error is counted (nobackfill_traffic_pairs_total{event="failed"}) and dropped: fail-open.
"""

from __future__ import annotations

from service.traffic.base import PairBatch, PairStore, StoredPairs
from service.traffic.sampler import TrafficSampler, create_sampler, create_store

__all__ = ["PairBatch", "PairStore", "StoredPairs", "TrafficSampler", "create_sampler", "create_store"]
