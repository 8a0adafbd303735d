"""Images from a request: `data:` URLs, http(s) URLs (fetch.py's rules) and local files,
decoded with Pillow under limits, every failure a 400 naming the request part.

- `data:image/...;base64,...`: base64 checked, size checked before decoding;
- `http(s)://...`: only what `MediaPolicy.allowed_domains` allows (fetch.py);
- `file://...` or an absolute path: only under `MediaPolicy.allowed_local_path`
  (symlinks resolved first), as vLLM's `--allowed-local-media-path`;
- PNG, JPEG, WebP and GIF (its first frame); the pixel count is read from the header and
  checked before the pixels are decoded (no decompression bombs); the result is RGB.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

from portaserve.framework.errors import InvalidParameterError

from . import fetch as fetching

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,", re.I)


@dataclass(frozen=True)
class MediaPolicy:
    """What the server lets a request load (the serve flags of the same names)."""

    allowed_domains: frozenset[str] = frozenset()  # --allowed-media-domains; empty: no fetching
    allowed_local_path: Path | None = None  # --allowed-local-media-path; None: no local files
    max_bytes: int = 20 << 20  # one image's encoded size
    max_pixels: int = 8192 * 8192  # one image's width x height
    timeout_s: float = 10.0  # one fetch, redirects included
    max_redirects: int = 3
    resolver: fetching.Resolver | None = field(default=None, compare=False)  # tests: no network
    transport: fetching.Transport | None = field(default=None, compare=False)

    @classmethod
    def create(cls, allowed_domains=(), allowed_local_path: str | os.PathLike | None = None, **kw) -> "MediaPolicy":
        domains = frozenset(d.strip().lower().rstrip(".") for d in allowed_domains if d and d.strip())
        local = Path(allowed_local_path).resolve(strict=False) if allowed_local_path else None
        return cls(domains, local, **kw)


def _param(where: str) -> str:
    return where.split(".")[0].split("[")[0]


def load_image_bytes(url: str, policy: MediaPolicy, where: str) -> bytes:
    """The encoded bytes `url` names, under `policy`."""
    if not isinstance(url, str) or not url:
        raise InvalidParameterError(_param(where), f"{where}: must be a non-empty URL string")
    if url[:5].lower() == "data:":
        return _data_url(url, policy, where)
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        return fetching.fetch(url, allowed_domains=policy.allowed_domains, max_bytes=policy.max_bytes,
                              timeout_s=policy.timeout_s, max_redirects=policy.max_redirects, where=where,
                              resolver=policy.resolver, transport=policy.transport)
    if scheme == "file" or url.startswith("/"):
        return _local_file(url, policy, where)
    raise InvalidParameterError(_param(where), f"{where}: unsupported URL scheme {scheme!r}; "
                                               "use a data: URL, http(s) or (where allowed) file://")


def _data_url(url: str, policy: MediaPolicy, where: str) -> bytes:
    m = _DATA_URL.match(url)
    if m is None or not m.group("b64"):
        raise InvalidParameterError(_param(where), f"{where}: a data URL must be 'data:image/<type>;base64,<data>'")
    mime = (m.group("mime") or "").lower()
    if mime and not mime.startswith("image/"):
        raise InvalidParameterError(_param(where), f"{where}: a data URL of type {mime!r} is not an image")
    payload = url[m.end():]
    if len(payload) * 3 // 4 > policy.max_bytes:
        raise InvalidParameterError(_param(where), f"{where}: the image is larger than {policy.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidParameterError(_param(where), f"{where}: the data URL is not valid base64") from None


def _local_file(url: str, policy: MediaPolicy, where: str) -> bytes:
    if policy.allowed_local_path is None:
        raise InvalidParameterError(_param(where), f"{where}: local files are off on this server "
                                                   "(the operator allows a folder with --allowed-local-media-path)")
    parts = urlsplit(url)
    if parts.scheme.lower() == "file" and parts.netloc not in ("", "localhost"):
        raise InvalidParameterError(_param(where), f"{where}: a file URL must name a local path")
    raw = unquote(parts.path) if parts.scheme.lower() == "file" else url
    path = Path(raw).resolve(strict=False)
    if not path.is_relative_to(policy.allowed_local_path):
        raise InvalidParameterError(_param(where), f"{where}: {raw!r} is not under the allowed local media folder")
    try:
        size = path.stat().st_size
        if size > policy.max_bytes:
            raise InvalidParameterError(_param(where), f"{where}: the image is larger than {policy.max_bytes} bytes")
        return path.read_bytes()
    except OSError:
        raise InvalidParameterError(_param(where), f"{where}: {raw!r} cannot be read") from None


def decode_image(data: bytes, policy: MediaPolicy, where: str):
    """`data` as an RGB PIL image (GIF: the first frame), within `policy.max_pixels`."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > policy.max_bytes:
        raise InvalidParameterError(_param(where), f"{where}: the image is larger than {policy.max_bytes} bytes")
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as img:  # reads the header only
            width, height = img.size
            if width * height > policy.max_pixels:
                raise InvalidParameterError(_param(where), f"{where}: the image has {width} x {height} pixels, more "
                                                           f"than the limit of {policy.max_pixels}")
            img.seek(0)
            return img.convert("RGB")  # decodes the pixels
    except InvalidParameterError:
        raise
    except Image.DecompressionBombError:  # Pillow's own check, at open, for headers far past any limit
        raise InvalidParameterError(_param(where), f"{where}: the image declares more pixels than the limit of "
                                                   f"{policy.max_pixels}") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise InvalidParameterError(_param(where), f"{where}: not a readable image (PNG, JPEG, WebP or GIF)") from None


def load_image(url: str, policy: MediaPolicy, where: str):
    """The RGB image `url` names (see the module docstring); InvalidParameterError (400)
    naming `where` (for example 'messages[0].content[1].image_url.url') otherwise."""
    return decode_image(load_image_bytes(url, policy, where), policy, where)
