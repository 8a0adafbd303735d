"""Structured outputs through the engine: every output that finishes validates.

Random-weight tiny models sample at temperature 1.0 with n = 4, so nothing but the
grammar keeps them on track. The reference is independent of the backends: the
`jsonschema` package validates JSON outputs (formats included), `re.fullmatch` checks
regexes, choices and a GBNF grammar with a regular language.
"""

from __future__ import annotations

import json
import re

import pytest

from portaserve import LLM, SamplingParams
from portaserve.framework.structured.params import StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")

S = {"type": "string", "maxLength": 8}
SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "ok"],
               "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["name", "id"],
                                       "properties": {"name": S, "id": {"type": "integer"}}},
                              "ok": {"type": "boolean"}}},
    "array_enum": {"type": "object", "additionalProperties": False, "required": ["colors"],
                   "properties": {"colors": {"type": "array", "minItems": 1, "maxItems": 4,
                                             "items": {"enum": ["red", "green", "blue"]}}}},
    "any_of": {"type": "object", "additionalProperties": False, "required": ["v"],
               "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, S, {"type": "null"}]}}},
    # a format a grammar can enforce exactly. Not "date" (a grammar takes 1729-11-31), "ipv4"
    # (xgrammar takes octets with leading zeros) or "email" (xgrammar lets the format override
    # maxLength, so it can run on): jsonschema's format checker refuses some of their outputs
    "formats": {"type": "object", "additionalProperties": False, "required": ["id", "n"],
                "properties": {"id": {"type": "string", "format": "uuid"}, "n": {"type": "integer"}}},
    "bounded_numbers": {"type": "object", "additionalProperties": False, "required": ["x", "p"],
                        "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                       "p": {"type": "number", "minimum": 0, "maximum": 1}}},
    "bounded_array": {"type": "array", "minItems": 2, "maxItems": 3, "items": S},
}
MODELS = ["Qwen2ForCausalLM", "LlamaForCausalLM"]
MAX_TOKENS = 256


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from portaserve.models.checkpoints import write_checkpoint

    made = {}

    def get(arch: str, backend: str = "xgrammar") -> LLM:
        if (arch, backend) not in made:
            folder = write_checkpoint(arch, "tiny", tmp_path_factory.mktemp(arch), 0)
            made[arch, backend] = LLM(model=str(folder), device="cpu", dtype="float32", structured_outputs_backend=backend)
        return made[arch, backend]

    yield get
    for llm in made.values():
        llm.shutdown()


def generate(llm: LLM, params: StructuredOutputsParams, n: int = 4, seed: int = 0, **kw):
    sp = SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, structured_outputs=params, **kw)
    return llm.generate("Reply in JSON:", sp, use_tqdm=False)[0].outputs


@pytest.mark.grid(keep=3)
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(engines, name, arch, backend):
    schema = SCHEMAS[name]
    outs = generate(engines(arch, backend), StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= 0.9 * len(outs), [(o.finish_reason, o.text[:80]) for o in outs]
    for o in finished:
        jsonschema.validate(json.loads(o.text), schema, format_checker=jsonschema.FormatChecker())
        assert ": " in o.text or "," in o.text or o.text.startswith("[")  # compact: only the separators' spaces
        assert "\n" not in o.text and "  " not in o.text


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_regex_choice_and_grammar_outputs_match(engines, backend):
    llm = engines("Qwen2ForCausalLM", backend)
    for o in generate(llm, StructuredOutputsParams(regex=r"[a-z]{2,5}-\d{3}")):
        assert re.fullmatch(r"[a-z]{2,5}-\d{3}", o.text), o.text
    choices = ["alpha", "beta", "gamma delta"]
    assert {o.text for o in generate(llm, StructuredOutputsParams(choice=choices), n=8)} <= set(choices)
    # a GBNF grammar whose language is regular, checked by an independent regex
    grammar = 'root ::= word (" " word){0,3} "."\nword ::= [a-z]{1,6}'
    for o in generate(llm, StructuredOutputsParams(grammar=grammar)):
        assert re.fullmatch(r"[a-z]{1,6}( [a-z]{1,6}){0,3}\.", o.text), o.text


@pytest.mark.slow
def test_constraints_survive_preemption_prefix_caching_stop_strings_and_streaming(tmp_path):
    from portaserve.models.checkpoints import write_checkpoint

    folder = write_checkpoint("Qwen2ForCausalLM", "tiny", tmp_path, 1)
    schema = SCHEMAS["nested"]
    llm = LLM(model=str(folder), device="cpu", dtype="float32", block_size=16, num_gpu_blocks_override=24)
    sp = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=60,
                        structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    outs = llm.generate(["Reply in JSON: " + "x " * 40] * 3, [sp] * 3, use_tqdm=False)  # 12 sequences, 24 blocks
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    for out in outs:
        for o in out.outputs:
            if o.finish_reason == "stop":
                jsonschema.validate(json.loads(o.text), schema)
    assert any(out.num_cached_tokens > 0 for out in outs)  # the shared prompt hit the prefix cache
    # a stop string ends the output early: a valid prefix, no error
    stopped = llm.generate("Reply in JSON:", SamplingParams(temperature=1.0, seed=1, max_tokens=100, stop=['"name"'],
                                                             structured_outputs=StructuredOutputsParams(
                                                                 json=schema, disable_any_whitespace=True)),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.text.startswith("{") and '"name"' not in stopped.text
