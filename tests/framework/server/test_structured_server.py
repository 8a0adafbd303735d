"""Structured outputs on the real default model (SmolLM2-135M-Instruct, GGUF) through the
official openai client: every JSON output validates against its schema (jsonschema),
streamed or not, with n > 1; a choice comes back verbatim."""

from __future__ import annotations

import json

import openai
import pytest

from portaserve.framework.config import EngineConfig
from server_harness import ServerThread

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytestmark = pytest.mark.slow  # a server on a real model

CITY = {"type": "object", "additionalProperties": False, "required": ["city", "country", "population"],
        "properties": {"city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40},
                       "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000_000}}}
PEOPLE = {"type": "array", "minItems": 1, "maxItems": 3,
          "items": {"type": "object", "additionalProperties": False, "required": ["name", "role"],
                    "properties": {"name": {"type": "string", "maxLength": 30},
                                   "role": {"enum": ["engineer", "doctor", "teacher"]}}}}


@pytest.fixture(scope="module")
def client(smollm2_gguf):
    with ServerThread(EngineConfig.create(model=str(smollm2_gguf), served_model_name="smol")) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("schema, prompt", [(CITY, "Describe a large city as JSON."),
                                            (PEOPLE, "List some people and their jobs as JSON.")])
def test_response_format_json_schema_always_validates(client, schema, prompt):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    resp = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": prompt}], n=3,
                                          temperature=0.8, max_tokens=200, response_format=fmt,
                                          extra_body={"disable_any_whitespace": True})
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
    stream = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": prompt}], stream=True,
                                            temperature=0.8, max_tokens=200, response_format=fmt)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), schema)


def test_json_object_and_choice(client):
    resp = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Give me a JSON object."}],
                                          response_format={"type": "json_object"}, max_tokens=150,
                                          extra_body={"disable_any_whitespace": True})
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content), dict)
    resp = client.completions.create(model="smol", prompt="Is the sky blue? Answer:", max_tokens=5,
                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert resp.choices[0].text in ("yes", "no")
