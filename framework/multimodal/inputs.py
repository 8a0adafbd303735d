"""The processed media of one request, as the engine carries it.

A prompt with images reaches the engine with each image's placeholder token already
expanded to the number of embeddings the model produces for it. A `MultiModalFeature`
records where those placeholders lie (`offset`, `length` in prompt tokens), the pixels
the vision encoder reads, and a content hash. The hash keys the encoder cache (one
encoding per distinct image, however many requests show it) and enters the prefix
cache's block hashes, so two different images behind identical placeholder tokens
never share KV blocks.

Features are plain data (bytes and tuples): they cross the engine-core socket inside a
`Request` and reach worker processes inside a `NewRequestData`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where pixels are touched: the request path must not
    import numpy as np  # load it before the engine process forks (OpenBLAS threads)

IMAGE = "image"


@dataclass(frozen=True, slots=True)
class MultiModalFeature:
    """One image of a prompt after preprocessing."""

    modality: str
    #: sha256 (hex) of what the encoder reads: the model's processing key, shape and pixels
    hash: str
    #: first placeholder token of this image in the prompt, and how many there are
    offset: int
    length: int
    #: float32 pixel values, C-contiguous, of `shape`
    pixel_values: bytes
    shape: tuple[int, ...]
    #: (temporal, height, width) patch grid for models that need it (Qwen2-VL); () otherwise
    grid_thw: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.offset + self.length

    def pixels(self) -> "np.ndarray":
        """The pixel values as a read-only float32 array of `shape`."""
        import numpy as np

        return np.frombuffer(self.pixel_values, dtype=np.float32).reshape(self.shape)

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any of this image's placeholders lies in token range [start, end)."""
        return self.offset < end and start < self.end


def feature_hash(key: str, pixels: "np.ndarray", grid_thw: Sequence[int] = ()) -> str:
    import numpy as np

    h = hashlib.sha256(key.encode())
    h.update(repr((tuple(pixels.shape), tuple(grid_thw))).encode())
    h.update(np.ascontiguousarray(pixels, dtype=np.float32).tobytes())
    return h.hexdigest()

