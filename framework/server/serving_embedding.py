"""`/v1/embeddings` on a pooling (encoder) model: text or token-id inputs, float or base64 output."""

from __future__ import annotations

import asyncio
import base64
import math
import struct

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from portaserve.framework.engine.params import PoolingParams
from portaserve.framework.errors import invalid
from portaserve.framework.server.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse
from portaserve.framework.server.serving_common import (
    base_request_id,
    engine_outputs,
    engine_request_id,
    make_usage,
    until_disconnected,
)
from portaserve.framework.server.state import ServerState


def _inputs(value) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if not value:
        raise invalid("input", "must not be empty")
    if all(isinstance(v, int) for v in value):
        return [list(value)]
    return list(value)


def encode_base64(vector: list[float]) -> str:
    """OpenAI's base64 embedding: the float32 little-endian bytes."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def truncate(vector: list[float], dimensions: int | None, normalized: bool) -> list[float]:
    """OpenAI's `dimensions`: keep the first ones (matryoshka), re-normalized if the model normalizes."""
    if dimensions is None or dimensions == len(vector):
        return vector
    if dimensions > len(vector):
        raise invalid("dimensions", f"must be <= the model's embedding size {len(vector)}, got {dimensions}")
    head = vector[:dimensions]
    if normalized:
        norm = math.sqrt(sum(x * x for x in head)) or 1.0
        head = [x / norm for x in head]
    return head


class EmbeddingService:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, req: EmbeddingRequest, raw: Request) -> Response:
        return await until_disconnected(raw, self._create(req, raw))

    async def _create(self, req: EmbeddingRequest, raw: Request) -> Response:
        state = self.state
        engine = state.require_engine()
        model = state.check_model(req.model)
        limits = state.settings.limits
        limits.check_prompts("input", req.input, "max_embedding_inputs")
        limits.check_truncate(req.truncate_prompt_tokens, state.spec.max_model_len)
        state.check_priority(req.priority)
        tokenizer = engine.tokenizer
        response_id = f"embd-{base_request_id(raw, req.request_id)}"
        prompts = []
        for item in _inputs(req.input):
            if isinstance(item, str):
                if tokenizer is None:
                    raise invalid("input", "this server was started without a tokenizer; pass token ids")
                ids = tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
                prompts.append({"prompt": item, "prompt_token_ids": ids})
            else:
                prompts.append({"prompt_token_ids": list(item)})
            if req.truncate_prompt_tokens is not None:
                prompts[-1]["prompt_token_ids"] = prompts[-1]["prompt_token_ids"][-req.truncate_prompt_tokens:]
        params = PoolingParams(normalize=req.normalize, dimensions=req.dimensions)

        async def one(i: int, prompt: dict):
            last = None
            gen = engine_outputs(state, engine_request_id(f"{response_id}-{i}"), prompt, params,
                                 num_prompt_tokens=len(prompt["prompt_token_ids"]), priority=req.priority)
            async for out in gen:
                last = out
            return last

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        normalized = req.normalize
        if normalized is None:
            normalized = bool(((getattr(state.spec, "hf_config", None) or {}).get("portaserve_pooling") or {}).get("normalize", True))
        data = []
        for i, out in enumerate(results):
            vector = truncate(list(out.outputs.embedding), req.dimensions, normalized)
            data.append(EmbeddingData(index=i, embedding=encode_base64(vector) if req.encoding_format == "base64" else vector))
        num_prompt = sum(len(p["prompt_token_ids"]) for p in prompts)
        body = EmbeddingResponse(id=response_id, model=model, data=data, usage=make_usage(num_prompt, 0))
        payload = body.model_dump(mode="json")
        payload["usage"].pop("completion_tokens", None)  # OpenAI's embedding usage has no completion tokens
        payload["usage"].pop("prompt_tokens_details", None)
        return JSONResponse(payload)
