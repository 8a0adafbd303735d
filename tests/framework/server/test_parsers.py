"""Reasoning and tool-call parsers: whole-output results against hand-written expectations,
and the streaming form fed every split of each sample (two- and three-piece, and one
character at a time) giving exactly those results."""

from __future__ import annotations

import itertools
import json

import pytest

from portaserve.framework.errors import InvalidParameterError
from portaserve.framework.server.parsers import ToolCall, get_reasoning_parser, get_tool_parser


def splits(text: str, max_pieces: int = 3):
    """Every way of cutting `text` into up to `max_pieces` pieces (some empty), and char by char."""
    n = len(text)
    yield [text]
    yield list(text)
    for i in range(n + 1):
        yield [text[:i], text[i:]]
    if max_pieces >= 3:
        for i, j in itertools.combinations(range(n + 1), 2):
            yield [text[:i], text[i:j], text[j:]]


def stream_reasoning(parser, pieces):
    reasoning, content = [], []
    for p in pieces:
        d = parser.feed(p)
        reasoning.append(d.reasoning)
        content.append(d.content)
    d = parser.finish()
    reasoning.append(d.reasoning)
    content.append(d.content)
    return "".join(reasoning) or None, "".join(content) or None


def stream_tools(parser, pieces):
    content, calls = [], []
    for p in pieces:
        d = parser.feed(p)
        content.append(d.content)
        calls.extend(d.tool_calls)
    d = parser.finish()
    content.append(d.content)
    calls.extend(d.tool_calls)
    return "".join(content) or None, calls


# (parser, prompt, output, expected reasoning, expected content)
REASONING_CASES = [
    ("qwen3", "", "<think>\nLet me think.\n</think>\n\nThe answer is 4.", "Let me think.", "The answer is 4."),
    ("qwen3", "", "  <think>a  b </think>c ", "a  b", "c "),
    ("qwen3", "", "No thinking here </think> at all", None, "No thinking here </think> at all"),
    ("qwen3", "", "<think>\ncut off by max_tokens", "cut off by max_tokens", None),
    ("qwen3", "", "<thin", None, "<thin"),
    ("qwen3", "", "<think>", None, None),
    ("qwen3", "", "\n\n", None, "\n\n"),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "pre-opened\n</think>\n\nDone", "pre-opened", "Done"),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "Plain answer", None, "Plain answer"),
    ("qwen3", "", "<think></think>", None, None),
    ("qwen3", "", "<think>x</think></think>y", "x", "</think>y"),
    ("deepseek_r1", "", "Reasoning first.\n</think>\n\nAnswer.", "Reasoning first.", "Answer."),
    ("deepseek_r1", "", "<think>With its own tag</think>Answer", "With its own tag", "Answer"),
    ("deepseek_r1", "", "never closes", "never closes", None),
    ("deepseek_r1", "", "  <thi", "<thi", None),
    ("deepseek_r1", "", "</think>", None, None),
    ("deepseek_r1", "", "a</think", "a</think", None),
]


@pytest.mark.parametrize("name,prompt,text,reasoning,content", REASONING_CASES)
def test_reasoning_parsers(name, prompt, text, reasoning, content):
    cls = get_reasoning_parser(name)
    assert cls(prompt=prompt).extract(text) == (reasoning, content)
    for pieces in splits(text):
        assert stream_reasoning(cls(prompt=prompt), pieces) == (reasoning, content), pieces


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'

# (parser, output, expected content, expected calls as (name, arguments-object))
TOOL_CASES = [
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (
        "hermes",
        f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\n",
        "Let me check.",
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "Europe/Paris"})],
    ),
    ("hermes", "No tools needed.  \n", None, None),  # content verbatim (filled below)
    ("hermes", "<tool_call>\n{not json}\n</tool_call> after", "<tool_call>\n{not json}\n</tool_call> after", []),
    ("hermes", f"<tool_call>\n{WEATHER}", None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("hermes", "text <tool_ca", "text <tool_ca", []),
    ("hermes", "a < b <tool_callx>", "a < b <tool_callx>", []),
    ("hermes", f"A\n<tool_call>{TIME}</tool_call>\nB", "A\n\nB", [("get_time", {"tz": "Europe/Paris"})]),
    ("hermes", '<tool_call>{"name": "noargs"}</tool_call>', None, [("noargs", {})]),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
        None,
        [("a", {}), ("b", {"x": 1})],
    ),
    ("llama3_json", "Hello, {not a call}", "Hello, {not a call}", []),
    ("llama3_json", ' {"name": "broken", ', ' {"name": "broken", ', []),
    ("llama3_json", "<|python_ta", "<|python_ta", []),
    ("llama3_json", "  ", "  ", []),
]


@pytest.mark.parametrize("name,text,content,calls", TOOL_CASES)
def test_tool_parsers(name, text, content, calls):
    if calls is None:  # plain content
        content, calls = text, []
    cls = get_tool_parser(name)
    got_content, got_calls = cls().extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    expected = (got_content, got_calls)
    pieces_list = list(splits(text, max_pieces=3 if len(text) < 90 else 2))
    for pieces in pieces_list:
        assert stream_tools(cls(), pieces) == expected, pieces


def test_reasoning_then_tools_stream_equals_whole():
    """The chat pipeline's composition: reasoning parser, then the tool parser on its content."""
    text = f"<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{WEATHER}\n</tool_call>"
    rp, tp = get_reasoning_parser("qwen3"), get_tool_parser("hermes")
    reasoning, content = rp().extract(text)
    content, calls = tp().extract(content)
    assert (reasoning, content) == ("The user wants the weather.", None)
    assert calls == [ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "celsius"}))]
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        r, t = rp(), tp()
        got_r, got_c, got_calls = [], [], []
        for piece in (text[:i], text[i:j], text[j:], None):
            d = r.feed(piece) if piece is not None else r.finish()
            got_r.append(d.reasoning)
            td = t.feed(d.content)
            if piece is None:
                end = t.finish()
                td = type(td)(td.content + end.content, td.tool_calls + end.tool_calls)
            got_c.append(td.content)
            got_calls.extend(td.tool_calls)
        assert ("".join(got_r) or None, "".join(got_c) or None, got_calls) == (reasoning, content, calls)


def test_unknown_parser_names_the_registered_ones():
    with pytest.raises(InvalidParameterError, match="registered: deepseek_r1, qwen3"):
        get_reasoning_parser("nope")
    with pytest.raises(InvalidParameterError, match="hermes"):
        get_tool_parser("nope")


def test_plugin_parser_is_found_through_the_registry():
    from portaserve.framework.plugins import EntryPointSpec, load_plugins

    registry = load_plugins(strict=True, entry_points=[EntryPointSpec("fake", "parser_plugin", "portaserve.plugins", "fake-dist", "1.0")])
    cls = get_tool_parser("upper", registry)
    assert cls.name == "upper"
    assert cls().extract("abc") == ("ABC", [])
