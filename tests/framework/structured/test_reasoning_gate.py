"""A reasoning model's constraint starts after its reasoning section: the engine watches
for the end marker's token ids (`reasoning_end`) and constrains from the next token.
A logits processor forces a free-text reasoning section first; the rest must validate."""

from __future__ import annotations

import json

import pytest
import torch

from portaserve import LLM, SamplingParams
from portaserve.framework.structured.params import StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}


class ForcePrefix:
    """Forces the first len(TOKENS) outputs (set by the test), then leaves the row alone."""

    TOKENS: list[int] = []

    def __call__(self, output_ids, row):
        if len(output_ids) < len(self.TOKENS):
            forced = torch.full_like(row, float("-inf"))
            forced[self.TOKENS[len(output_ids)]] = 0.0
            return forced
        return row


def test_constraint_starts_after_the_reasoning_end(tmp_path):
    from portaserve.models.checkpoints import write_checkpoint

    folder = write_checkpoint("Qwen2ForCausalLM", "tiny", tmp_path, 0)
    llm = LLM(model=str(folder), device="cpu", dtype="float32")
    tok = llm.get_tokenizer()
    reasoning = tok.encode("<think>\nlet me see: not JSON at all {{{\n</think>", add_special_tokens=False)
    end = tok.encode("</think>", add_special_tokens=False)
    ForcePrefix.TOKENS = reasoning
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=80, logits_processors=[ForcePrefix()],
                            structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True,
                                                                       reasoning_end=end))
    out = llm.generate("Think, then answer in JSON:", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[: len(reasoning)] == reasoning  # the reasoning was not constrained
    answer = tok.decode(out.token_ids[len(reasoning):])
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(answer), SCHEMA)
    # without the gate, the grammar refuses the forced reasoning: the request fails alone
    params.structured_outputs.reasoning_end = None
    failed = llm.generate("Think, then answer in JSON:", params, use_tqdm=False)[0].outputs[0]
    assert failed.finish_reason == "error"
