"""GET /ui/api/thumb/{id}: a small JPEG of an image item, read from the operator's own item store.

The client names a gallery id, never a path: the path is the item store's value for that id (what
`encode --items-out` recorded), so the route reads no file the operator did not put in the store.
Even then it only thumbnails a regular file under MAX_BYTES that Pillow identifies as one of FORMATS
with at most MAX_PIXELS pixels; anything else is a 404 saying why.  Takes the API key, as item texts do.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response
from PIL import Image, UnidentifiedImageError

from service.api.auth import ApiKey
from service.api.deps import PipelineDep
from service.errors import NotFound

SIDE = 96  # pixels of the longer side: a result row's height, twice over for sharp high-DPI screens
MAX_BYTES = 32 * 1024 * 1024  # a gallery photo may be larger than a query image (api.max_image_bytes)
MAX_PIXELS = 64_000_000  # decoding more would take seconds and hundreds of MB (a decompression bomb)
FORMATS = frozenset({"JPEG", "PNG", "GIF", "WEBP", "BMP", "TIFF"})
# Private: the bytes are the gallery's content and the route takes the key; an id's image does not change.
HEADERS = {"Cache-Control": "private, max-age=300", "X-Content-Type-Options": "nosniff"}

router = APIRouter(prefix="/ui/api", include_in_schema=False)


@router.get("/thumb/{item_id}")
async def thumb(item_id: int, pipeline: PipelineDep, _: ApiKey) -> Response:
    """The image item's thumbnail (JPEG, longer side SIDE); 404 without an image item store or a usable file."""
    store = pipeline.items
    if store is None or store.modality != "image":
        raise NotFound("no thumbnails: the item store holds no images")
    # SQLite and Pillow block: off the event loop.
    (value,) = await asyncio.to_thread(store.get_many, [item_id])
    if value is None:
        raise NotFound(f"item {item_id} is not in the item store")
    return Response(await asyncio.to_thread(thumbnail, Path(value), item_id), media_type="image/jpeg", headers=HEADERS)


def thumbnail(path: Path, item_id: int) -> bytes:
    """The JPEG bytes of `path` shrunk to SIDE; NotFound saying why it is not thumbnailed."""
    if not path.is_absolute():
        raise NotFound(f"item {item_id}: its path is not absolute (encode --items-out records absolute ones)")
    try:
        if not path.is_file():
            raise NotFound(f"item {item_id}: no image file at its path")
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise NotFound(f"item {item_id}: its file is {size:,} bytes, more than {MAX_BYTES:,}")
        with Image.open(path) as image:
            if image.format not in FORMATS:
                raise NotFound(f"item {item_id}: {image.format} is not an image format thumbnailed here")
            if image.width * image.height > MAX_PIXELS:
                raise NotFound(f"item {item_id}: {image.width}x{image.height} pixels, more than {MAX_PIXELS:,}")
            image.draft("RGB", (SIDE * 2, SIDE * 2))  # JPEG: decode at a reduced scale, much faster
            image.thumbnail((SIDE, SIDE))
            out = io.BytesIO()
            image.convert("RGB").save(out, "JPEG", quality=85)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        raise NotFound(f"item {item_id}: its file is not an image Pillow can read") from None
    return out.getvalue()
