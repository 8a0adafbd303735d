"""Multimodal inputs (issue #25): loading the media of a request safely.

`media.py` turns an image URL of a request (data:, http(s), file) into a decoded image
under the server's `MediaPolicy`; `fetch.py` fetches over HTTP without letting a request
reach the server's own network. Preprocessing and the vision-language models build on it.
"""

from .media import MediaPolicy, decode_image, load_image, load_image_bytes

__all__ = ["MediaPolicy", "decode_image", "load_image", "load_image_bytes"]
