"""Turn validated request bodies into pipeline queries: decode images, convert embeddings.

Image checks decode base64 and open the file header (its width x height against api.max_image_pixels),
milliseconds each: the search route runs `to_queries` on a worker thread when a request carries images.
"""

from __future__ import annotations

import numpy as np

from service.api.schemas import QueryIn
from service.encoders.base import Embeddings
from service.errors import InputError, TooManyQueries
from service.images import verify_image
from service.query import Query
from service.vocabulary import Modality


def _check_image(i: int, payload: str, max_bytes: int, max_pixels: int) -> None:
    """Refuse a payload that is not strict base64 of a decodable image within the byte and pixel limits."""
    if len(payload) > max_bytes * 4 // 3 + 4:
        raise InputError(f"queries[{i}].image_b64 is over the {max_bytes}-byte limit")
    verify_image(payload, f"queries[{i}].image_b64", max_pixels)


def _vector(values: list[float] | None) -> Embeddings | None:
    """A float32 row, or None when the caller left that embedding out."""
    return None if values is None else np.asarray(values, dtype=np.float32)


def to_queries(items: list[QueryIn], max_queries: int, max_image_bytes: int, max_image_pixels: int) -> list[Query]:
    """Pipeline queries in request order; the count and images are checked here, the rest in the pipeline."""
    if len(items) > max_queries:  # before any image is decoded (the pipeline checks the count again)
        raise TooManyQueries(f"{len(items)} queries in one request; the limit is {max_queries}")
    queries = []
    for i, item in enumerate(items):
        if item.text is not None:
            queries.append(Query(modality=Modality.text, content=item.text))
        elif item.image_b64 is not None:
            _check_image(i, item.image_b64, max_image_bytes, max_image_pixels)
            # Image backends receive the base64 payload itself; it also keys the cache.
            queries.append(Query(modality=Modality.image, content=item.image_b64))
        else:
            queries.append(
                Query(
                    modality=item.modality or Modality.text,
                    old_embedding=_vector(item.old_embedding),
                    new_embedding=_vector(item.new_embedding),
                )
            )
    return queries
