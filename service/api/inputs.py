"""Turn validated request bodies into pipeline queries: decode images, convert embeddings."""

from __future__ import annotations

import numpy as np

from service.api.schemas import QueryIn
from service.encoders.base import Embeddings
from service.errors import InputError
from service.images import verify_image
from service.pipeline import Query


def check_image(i: int, payload: str, max_bytes: int) -> None:
    """Refuse a payload that is not strict base64 of a decodable image within the size limit."""
    if len(payload) > max_bytes * 4 // 3 + 4:
        raise InputError(f"queries[{i}].image_b64 is over the {max_bytes}-byte limit")
    verify_image(payload, f"queries[{i}].image_b64")


def _vector(values: list[float] | None) -> Embeddings | None:
    """A float32 row, or None when the caller left that embedding out."""
    return None if values is None else np.asarray(values, dtype=np.float32)


def to_queries(items: list[QueryIn], max_image_bytes: int) -> list[Query]:
    """Pipeline queries in request order; images are checked here, everything else in the pipeline."""
    queries = []
    for i, item in enumerate(items):
        if item.text is not None:
            queries.append(Query(modality="text", content=item.text))
        elif item.image_b64 is not None:
            check_image(i, item.image_b64, max_image_bytes)
            # Image backends receive the base64 payload itself; it also keys the cache.
            queries.append(Query(modality="image", content=item.image_b64))
        else:
            queries.append(
                Query(
                    modality=item.modality or "text",
                    old_embedding=_vector(item.old_embedding),
                    new_embedding=_vector(item.new_embedding),
                )
            )
    return queries
