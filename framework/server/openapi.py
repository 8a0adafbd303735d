"""The OpenAPI schema, honest about what the server accepts.

FastAPI derives the schema from the pydantic models, which cannot know this server's
limits or model names. This adds them to the request schemas: `model` is one of the
served names, counts and lengths carry the `--max-*` limits, token ids and sampling
parameters their ranges. A client generator or a fuzzer (CI runs schemathesis on it) then
produces requests the server accepts, and the rest are 400s it documents.
"""

from __future__ import annotations

from typing import Any

from portaserve.framework.server.limits import RequestLimits

# request schema -> {property: JSON-schema constraints} (limits filled in by `_constraints`)
_SAMPLING = {
    "n": {"minimum": 1},
    "temperature": {"minimum": 0, "maximum": 1e4},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "min_p": {"minimum": 0, "maximum": 1},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"minimum": 1e-4, "maximum": 1e4},
    "top_k": {"minimum": -1},
    "min_tokens": {"minimum": 0},
    "seed": {"minimum": -(2**63), "maximum": 2**64 - 1},
}


def _constraints(limits: RequestLimits, max_model_len: int | None, vocab_size: int | None) -> dict[str, dict[str, dict]]:
    token = {"minimum": 0, **({"maximum": vocab_size - 1} if vocab_size else {})}
    length = {"minimum": 1, **({"maximum": max_model_len} if max_model_len else {})}
    sampling = {
        **_SAMPLING,
        "n": {"minimum": 1, "maximum": limits.max_n},
        "stop": {"maxItems": limits.max_stop_strings, "maxLength": limits.max_stop_string_chars},
        "logit_bias": {"maxProperties": limits.max_logit_bias},
        "stop_token_ids": {"maxItems": limits.max_stop_token_ids, "items": token},
        "allowed_token_ids": {"maxItems": limits.max_token_ids, "items": token},
        "truncate_prompt_tokens": length,
        "max_tokens": length,
    }
    return {
        "ChatCompletionRequest": {
            **sampling,
            "max_completion_tokens": length,
            "messages": {"maxItems": limits.max_messages},
            "tools": {"maxItems": limits.max_tools},
            "top_logprobs": {"minimum": 0},
        },
        "CompletionRequest": {**sampling, "prompt": {"maxItems": limits.max_prompts}, "logprobs": {"minimum": 0}},
        "EmbeddingRequest": {"input": {"maxItems": limits.max_embedding_inputs}, "truncate_prompt_tokens": length,
                             "dimensions": {"minimum": 1}},
        "TokenizeRequest": {"messages": {"maxItems": limits.max_messages}, "tools": {"maxItems": limits.max_tools}},
        "DetokenizeRequest": {"tokens": {"maxItems": limits.max_token_ids, "items": token}},
        "GenerateRequest": {"token_ids": {"minItems": 1, "maxItems": limits.max_token_ids, "items": token}},
        "MessagesRequest": {
            "max_tokens": {"minimum": 0, **({"maximum": max_model_len} if max_model_len else {})},
            "messages": {"maxItems": limits.max_messages}, "tools": {"maxItems": limits.max_tools},
            "stop_sequences": {"maxItems": limits.max_stop_strings, "maxLength": limits.max_stop_string_chars},
            **{k: v for k, v in _SAMPLING.items() if k in ("temperature", "top_p", "top_k", "seed")},
        },
        "CountTokensRequest": {"messages": {"maxItems": limits.max_messages}, "tools": {"maxItems": limits.max_tools}},
        "ResponsesRequest": {
            "max_output_tokens": length, "input": {"maxItems": limits.max_messages},
            "tools": {"maxItems": limits.max_tools},
            "stop": {"maxItems": limits.max_stop_strings, "maxLength": limits.max_stop_string_chars},
            **{k: v for k, v in _SAMPLING.items() if k in ("temperature", "top_p", "top_k", "min_p", "seed",
                                                          "repetition_penalty")},
        },
    }


def _apply(prop: dict[str, Any], constraints: dict[str, Any]) -> None:
    """Put `constraints` on every branch of `prop` that they fit (anyOf: str | list | null)."""
    branches = prop.get("anyOf") or [prop]
    for branch in branches:
        kind = branch.get("type")
        for key, value in constraints.items():
            if key in ("minimum", "maximum", "exclusiveMinimum") and kind in ("integer", "number"):
                branch[key] = value
            elif key in ("maxItems", "minItems") and kind == "array":
                branch[key] = value
            elif key == "items" and kind == "array" and branch.get("items", {}).get("type") == "integer":
                branch["items"] = {**branch["items"], **value}
            elif key == "maxLength" and kind == "string":
                branch[key] = value
            elif key == "maxLength" and kind == "array" and branch.get("items", {}).get("type") == "string":
                branch["items"] = {**branch["items"], "maxLength": value}
            elif key == "maxProperties" and kind == "object":
                branch[key] = value


def honest_openapi(schema: dict[str, Any], limits: RequestLimits, model_names: list[str],
                   max_model_len: int | None, vocab_size: int | None) -> dict[str, Any]:
    """Add the served model names and this server's limits to `schema` (in place)."""
    components = schema.get("components", {}).get("schemas", {})
    for name, constraints in _constraints(limits, max_model_len, vocab_size).items():
        properties = components.get(name, {}).get("properties", {})
        for prop_name, constraint in constraints.items():
            if prop_name in properties:
                _apply(properties[prop_name], constraint)
        if "model" in properties and model_names:
            properties["model"] = {"anyOf": [{"type": "string", "enum": list(model_names)}, {"type": "null"}],
                                   "title": "Model", "description": "one of the served model names (or null: the first)"}
    return schema
