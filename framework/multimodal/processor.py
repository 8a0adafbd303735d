"""Prompts with images: expanding each image's placeholder token and recording features.

A vision-language model tells the front end, through its architecture class's
`multimodal_processor(hf_config, model_path)` (contract 1.4), how its images are
prepared: an `ImagePromptProcessor` with the image preprocessing, the placeholder token
the prompt (or the chat template) carries once per image, and the number of
embeddings each processed image becomes. `expand` then turns a tokenized prompt and
its images into the engine's prompt, each placeholder repeated that many times, and one
`MultiModalFeature` per image.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from portaserve.framework.errors import InvalidParameterError

from .inputs import IMAGE, MultiModalFeature, feature_hash
from .preprocess import ProcessedImage


@dataclass(frozen=True)
class ImagePromptProcessor:
    #: PIL image -> ProcessedImage (see preprocess.py)
    image_processor: Callable[..., ProcessedImage]
    #: the token that stands for one image in the prompt before expansion
    placeholder_token_id: int
    #: ProcessedImage -> how many placeholder tokens (= embeddings) it takes
    num_tokens: Callable[[ProcessedImage], int]
    #: identifies the model's processing in feature hashes
    key: str

    def expand(self, token_ids: Sequence[int], images: Sequence, *, param: str = "multi_modal_data") -> tuple[list[int], list[MultiModalFeature]]:
        """(expanded token ids, one feature per image). The prompt must hold exactly one
        placeholder per image, in order."""
        slots = [i for i, t in enumerate(token_ids) if t == self.placeholder_token_id]
        if len(slots) != len(images):
            raise InvalidParameterError(
                param,
                f"{param}: the prompt has {len(slots)} image placeholder token(s) (id {self.placeholder_token_id}) "
                f"for {len(images)} image(s); each image needs exactly one",
            )
        out: list[int] = []
        features: list[MultiModalFeature] = []
        prev = 0
        for k, (slot, image) in enumerate(zip(slots, images)):
            try:
                processed = self.image_processor(image)
            except InvalidParameterError:
                raise
            except Exception as exc:  # a broken image is the request's fault, never the engine's
                raise InvalidParameterError(f"{param}.image[{k}]", f"{param}.image[{k}]: cannot process the image: {exc}") from None
            n = int(self.num_tokens(processed))
            out += token_ids[prev:slot]
            offset = len(out)
            out += [self.placeholder_token_id] * n
            prev = slot + 1
            pixels = processed.pixel_values
            features.append(
                MultiModalFeature(
                    modality=IMAGE,
                    hash=feature_hash(self.key, pixels, processed.grid_thw),
                    offset=offset,
                    length=n,
                    pixel_values=pixels.tobytes(),
                    shape=tuple(pixels.shape),
                    grid_thw=tuple(processed.grid_thw),
                )
            )
        out += token_ids[prev:]
        return out, features
