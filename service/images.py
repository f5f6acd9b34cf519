"""Base64 image payloads (the API's `image_b64`, what the clip backend encodes): decode, check, open.

One error per bad payload, naming it (`what`): not strict base64, or not an image PIL can read.
"""

from __future__ import annotations

import base64
import binascii
import io

from PIL import Image, UnidentifiedImageError

from service.errors import InputError

# What PIL raises on truncated, corrupt or unknown image bytes.
_UNREADABLE = (UnidentifiedImageError, OSError, SyntaxError, ValueError)


def decode_b64(payload: str, what: str) -> bytes:
    """The bytes of a strict base64 payload; InputError naming `what` otherwise."""
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InputError(f"{what} is not valid base64") from exc


def verify_image(payload: str, what: str) -> None:
    """Refuse a payload that is not base64 of an image file PIL can read (without decoding its pixels)."""
    try:
        with Image.open(io.BytesIO(decode_b64(payload, what))) as image:
            image.verify()
    except _UNREADABLE as exc:
        raise InputError(f"{what} is not a readable image") from exc


def rgb_image(payload: str, what: str) -> Image.Image:
    """The RGB pixels of a base64 image file; InputError naming `what` when it is not one."""
    try:
        with Image.open(io.BytesIO(decode_b64(payload, what))) as image:
            return image.convert("RGB")
    except _UNREADABLE as exc:
        raise InputError(f"{what} is not a readable image ({type(exc).__name__})") from exc
