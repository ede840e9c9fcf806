"""Images as API clients send them: ``data:`` URLs (base64 PNG, JPEG, WebP, GIF) decoded into
PIL images whose size is checked on the header, before any pixel is decoded. Remote URLs are
refused: the server fetches nothing on a client's behalf.

Every refusal is a ``ValueError`` naming the problem; each API turns it into its own 400.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from typing import Any

MAX_IMAGE_BYTES = 20 * 2**20  # one image's file, decoded from base64
# What a data URL may hold (the formats the OpenAI and Anthropic APIs document), and the one PIL
# decoder each may reach (a file of another format is refused, whatever it says it is).
PIL_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}
IMAGE_MEDIA_TYPES = tuple(PIL_FORMATS)
_DATA_URL = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)(?:;[\w.+-]+=[\w.+-]+)*;base64,", re.IGNORECASE)


def image_from_url(url: str, max_pixels: int, max_bytes: int) -> Any:
    """A PIL image from a ``data:`` URL; ValueError for a remote URL, another media type, bad
    base64, a file no decoder reads, or more than ``max_pixels`` pixels / ``max_bytes`` bytes."""
    match = _DATA_URL.match(url)
    if match is None:
        if url.lower().startswith(("http://", "https://")):
            raise ValueError("image URLs are not fetched: send the image inline, as a data:image/...;base64 URL")
        raise ValueError("an image URL must be a data:image/...;base64 URL")
    return image_from_base64(match["type"].lower(), url[match.end() :], max_pixels, max_bytes)


def image_from_base64(media_type: str, data: str, max_pixels: int, max_bytes: int) -> Any:
    """A PIL image from base64 ``data`` of ``media_type`` (see :func:`image_from_url`)."""
    from PIL import Image

    if media_type not in IMAGE_MEDIA_TYPES:
        raise ValueError(f"image media type {media_type!r} is not one of {', '.join(IMAGE_MEDIA_TYPES)}")
    if len(data) > 4 * (max_bytes // 3 + 1):
        raise ValueError(f"the image is larger than {max_bytes} bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the image is not valid base64") from None
    try:
        with warnings.catch_warnings():  # (PIL warns of, then refuses, huge sizes: a refusal here either way)
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw), formats=[PIL_FORMATS[media_type]])
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise ValueError(f"the image could not be read: {exc}") from None
    width, height = image.size
    if width * height > max_pixels:
        raise ValueError(f"the image is {width} x {height} pixels: more than the limit of {max_pixels} pixels")
    return image
