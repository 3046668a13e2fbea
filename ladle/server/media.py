"""Images named by requests' content parts, fetched and decoded: data: URLs, http(s) URLs fetched with a
size and a time limit, and local files only under --allowed-local-media-path (as vLLM). Whatever fails
is a 400 naming the part; nothing here can take the server down."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from ladle.errors import InvalidRequestError

if TYPE_CHECKING:
    from PIL.Image import Image

DEFAULT_MAX_IMAGE_BYTES = 20 * 2**20
DEFAULT_MAX_IMAGE_PIXELS = 64 * 2**20
DEFAULT_FETCH_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class MediaLimits:
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # of an image's encoded file
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # width x height, read from its header before decoding
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S  # for the whole of an http(s) fetch
    allowed_local_media_path: str | None = None  # file:// URLs only under it; None: none at all


async def load_image(url: str, where: str, limits: MediaLimits) -> "Image":
    """The image url names, decoded (RGB); raises InvalidRequestError with param=where."""
    scheme = urlparse(url).scheme.lower()
    if scheme == "data":
        data = _data_url(url, where)
    elif scheme in ("http", "https"):
        data = await _fetch(url, where, limits)
    elif scheme == "file":
        data = _local_file(url, where, limits)
    else:
        raise InvalidRequestError(f"{where}: an image URL must be data:, http(s): or file:, not {url[:40]!r}",
                                  param=where)
    if len(data) > limits.max_bytes:
        raise InvalidRequestError(f"{where}: the image is {len(data)} bytes, over the limit of {limits.max_bytes}",
                                  param=where)
    return decode_image(data, where, limits.max_pixels)


def decode_image(data: bytes, where: str, max_pixels: int) -> "Image":
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > max_pixels:
            raise InvalidRequestError(f"{where}: the image is {width}x{height} pixels, over the limit of "
                                      f"{max_pixels}", param=where)
        image.load()
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        if isinstance(e, InvalidRequestError):
            raise
        raise InvalidRequestError(f"{where}: could not decode the image ({e})", param=where) from None


def _data_url(url: str, where: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise InvalidRequestError(f"{where}: a data: URL needs a comma before its data", param=where)
    try:
        return base64.b64decode(payload, validate=True) if header.endswith(";base64") else unquote(payload).encode()
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{where}: the data: URL's base64 does not decode", param=where) from None


async def _fetch(url: str, where: str, limits: MediaLimits) -> bytes:
    import httpx

    async def read() -> bytes:
        async with httpx.AsyncClient(follow_redirects=True, timeout=limits.fetch_timeout_s) as client:
            async with client.stream("GET", url) as reply:
                if reply.status_code != 200:
                    raise InvalidRequestError(f"{where}: fetching the image got HTTP {reply.status_code}",
                                              param=where)
                body = bytearray()
                async for chunk in reply.aiter_bytes():
                    body += chunk
                    if len(body) > limits.max_bytes:
                        raise InvalidRequestError(f"{where}: the image is over the limit of {limits.max_bytes} "
                                                  "bytes", param=where)
                return bytes(body)

    try:
        return await asyncio.wait_for(read(), limits.fetch_timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise InvalidRequestError(f"{where}: fetching the image timed out after {limits.fetch_timeout_s} s",
                                  param=where) from None
    except httpx.HTTPError as e:
        raise InvalidRequestError(f"{where}: could not fetch the image ({type(e).__name__})", param=where) from None


def _local_file(url: str, where: str, limits: MediaLimits) -> bytes:
    root = limits.allowed_local_media_path
    if root is None:
        raise InvalidRequestError(f"{where}: file: URLs need the server started with --allowed-local-media-path",
                                  param=where)
    path = Path(unquote(urlparse(url).path)).resolve()
    if not path.is_relative_to(Path(root).resolve()):
        raise InvalidRequestError(f"{where}: {path} is outside --allowed-local-media-path", param=where)
    if not path.is_file():
        raise InvalidRequestError(f"{where}: no file {path}", param=where)
    if path.stat().st_size > limits.max_bytes:
        raise InvalidRequestError(f"{where}: the image is over the limit of {limits.max_bytes} bytes", param=where)
    return path.read_bytes()
