"""Base64 image payloads (the API's `image_b64`, what the clip backend encodes): decode, check, open.

One error per bad payload, naming it (`what`): not strict base64, not an image PIL can read, or (the
API's check) more pixels than api.max_image_pixels.  The pixel count is read from the header: a small
file can declare a huge image (a 420 kB PNG of 10,000 x 10,000 grey pixels held its batch for 3.7 s in
the clip backend's decode and resize), and only the header check keeps that off the encoder's thread.
"""

from __future__ import annotations

import base64
import binascii
import io

from PIL import Image, UnidentifiedImageError

from service.errors import InputError

# What PIL raises on truncated, corrupt or unknown image bytes, and on a header declaring more than twice
# Image.MAX_IMAGE_PIXELS (a decompression bomb: not an Exception PIL files under its read errors).
_UNREADABLE = (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError)


def decode_b64(payload: str, what: str) -> bytes:
    """The bytes of a strict base64 payload; InputError naming `what` otherwise."""
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InputError(f"{what} is not valid base64") from exc


def verify_image(payload: str, what: str, max_pixels: int) -> None:
    """Refuse a payload that is not base64 of an image file PIL can read, or whose header declares more than
    max_pixels (without decoding its pixels)."""
    try:
        with Image.open(io.BytesIO(decode_b64(payload, what))) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise InputError(f"{what} is over the {max_pixels}-pixel limit ({width} x {height})")
            image.verify()
    except Image.DecompressionBombError as exc:  # PIL refused to open it: far over any sane limit
        raise InputError(f"{what} is over the {max_pixels}-pixel limit (PIL refuses to open it)") from exc
    except _UNREADABLE as exc:
        raise InputError(f"{what} is not a readable image") from exc


def rgb_image(payload: str, what: str) -> Image.Image:
    """The RGB pixels of a base64 image file; InputError naming `what` when it is not one."""
    try:
        with Image.open(io.BytesIO(decode_b64(payload, what))) as image:
            return image.convert("RGB")
    except _UNREADABLE as exc:
        raise InputError(f"{what} is not a readable image ({type(exc).__name__})") from exc
