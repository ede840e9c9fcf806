"""Images as API clients send them: ``data:`` URLs (base64 PNG, JPEG, WebP, GIF) decoded into
PIL images whose size is checked on the header, before any pixel is decoded. Remote URLs are
refused unless the server lists their host (``--allowed-media-domains``).

Every refusal is a ``ValueError`` naming the problem; each API turns it into its own 400.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import time
import warnings
from dataclasses import dataclass
from typing import Any

MAX_IMAGE_BYTES = 20 * 2**20  # one image's file, decoded from base64
# What a data URL may hold (the formats the OpenAI and Anthropic APIs document), and the one PIL
# decoder each may reach (a file of another format is refused, whatever it says it is).
PIL_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}
IMAGE_MEDIA_TYPES = tuple(PIL_FORMATS)
_DATA_URL = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)(?:;[\w.+-]+=[\w.+-]+)*;base64,", re.IGNORECASE)


def allowed_hosts(entries: list[str]) -> frozenset[tuple[str, int | None]]:
    """``--allowed-media-domains`` entries as (host, port) pairs: ``host`` (its scheme's default
    port only) or ``host:port``; ValueError for anything else (a scheme, a path, an empty name)."""
    hosts = set()
    for entry in entries:
        host, _, port = entry.strip().lower().partition(":")
        host = host.rstrip(".")
        if not re.fullmatch(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?", host) or (port and not port.isdigit()):
            raise ValueError(f"--allowed-media-domains takes host names, or host:port, not {entry!r}")
        hosts.add((host, int(port) if port else None))
    return frozenset(hosts)


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from: inline always; by URL only from the hosts a server lists
    (``--allowed-media-domains``: exact names, on their scheme's default port unless an entry
    names one), all of a request's fetches within ``timeout_s``, no redirect followed, at most
    ``MAX_IMAGE_BYTES`` each."""

    allowed_hosts: frozenset[tuple[str, int | None]] = frozenset()
    timeout_s: float = 10.0

    def image(self, url: str, max_pixels: int, deadline: float | None = None) -> Any:
        """A PIL image from ``url`` of at most ``max_pixels``, fetched before ``deadline``
        (``time.monotonic()``; None: ``timeout_s`` from now); ValueError naming what is wrong."""
        match = _DATA_URL.match(url)
        if match is not None:
            return image_from_base64(match["type"].lower(), url[match.end() :], max_pixels, MAX_IMAGE_BYTES)
        if not url.lower().startswith(("http://", "https://")):
            raise ValueError("an image URL must be a data:image/...;base64 URL or an http(s) URL")
        import httpx

        try:  # (the host as the client that fetches reads it)
            parsed = httpx.URL(url)
            host, port = parsed.host.lower().rstrip("."), parsed.port
        except (httpx.InvalidURL, ValueError):
            raise ValueError("the image URL is not a valid URL") from None
        if (host, port) not in self.allowed_hosts:  # (httpx reads a scheme's default port as None)
            where = host if port is None else f"{host}:{port}"
            raise ValueError(f"image URLs of {where!r} are not fetched: send the image inline, as a "
                             "data:image/...;base64 URL (a server fetches from the hosts --allowed-media-domains lists)")  # fmt: skip
        media_type, raw = _fetch(url, time.monotonic() + self.timeout_s if deadline is None else deadline)
        return image_from_bytes(media_type, raw, max_pixels)


def _fetch(url: str, deadline: float) -> tuple[str, bytes]:
    """(media type, bytes) of an allowed URL: no redirect, done by ``deadline``, bounded size."""
    import httpx

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ValueError("fetching the image took too long")
        return remaining

    try:
        with httpx.stream("GET", url, timeout=left(), follow_redirects=False) as response:
            if response.status_code != 200:
                raise ValueError(f"fetching the image answered HTTP {response.status_code}")
            media_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                left()  # (each read waits at most the whole timeout: the deadline bounds them all)
                size += len(chunk)
                if size > MAX_IMAGE_BYTES:
                    raise ValueError(f"the image is larger than {MAX_IMAGE_BYTES} bytes")
                chunks.append(chunk)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise ValueError(f"the image could not be fetched: {type(exc).__name__}") from None
    return media_type, b"".join(chunks)


def image_from_base64(media_type: str, data: str, max_pixels: int, max_bytes: int) -> Any:
    """A PIL image from base64 ``data`` of ``media_type``, at most ``max_bytes`` decoded."""
    if media_type not in IMAGE_MEDIA_TYPES:
        raise ValueError(f"image media type {media_type!r} is not one of {', '.join(IMAGE_MEDIA_TYPES)}")
    if len(data) > 4 * (max_bytes // 3 + 1):
        raise ValueError(f"the image is larger than {max_bytes} bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the image is not valid base64") from None
    return image_from_bytes(media_type, raw, max_pixels)


def image_from_bytes(media_type: str, raw: bytes, max_pixels: int) -> Any:
    """A PIL image from a file's bytes of ``media_type``, its size checked on its header."""
    from PIL import Image

    if media_type not in IMAGE_MEDIA_TYPES:
        raise ValueError(f"image media type {media_type!r} is not one of {', '.join(IMAGE_MEDIA_TYPES)}")
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
