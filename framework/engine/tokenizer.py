"""The run-time tokenizer: a Hugging Face `tokenizer.json` through the `tokenizers` library.

No transformers at run time: `Tokenizer.from_pretrained(folder)` reads a GGUF file's
tokenizer metadata (see `framework.gguf.tokenizer`), or from a folder

- `tokenizer.json` (required): the whole pipeline, added tokens included;
- `tokenizer_config.json` (optional): the chat template, the bos / eos / pad / unk
  tokens, `added_tokens_decoder` (which added tokens are special), `add_bos_token` /
  `add_eos_token`, `model_max_length`;
- `chat_template.jinja` (optional, wins over the config's template, as in transformers),
  or a processor-style `chat_template.json`;
- `generation_config.json` (optional): its `eos_token_id` (an id or a list) joins the
  tokenizer's eos token in `eos_token_ids`.

Which ids are special (dropped by `skip_special_tokens`, listed in `all_special_ids`):
added tokens flagged special in tokenizer.json or in `added_tokens_decoder`, plus the
bos / eos / pad / unk tokens, as transformers registers them. Non-special added tokens
(`<tool_call>`, `<think>`) always decode to their text.

`decode` never applies transformers' `clean_up_tokenization_spaces`: like vLLM, streamed
and final texts are exactly what the tokenizer's decoder produces.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from portaserve.framework.errors import invalid


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise invalid("tokenizer", f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise invalid("tokenizer", f"{path} must hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick_chat_template(value: Any) -> str | None:
    """The config's chat template: a string, or a list of named templates (then "default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    return None


#: transformers tokenizer classes that rebuild tokenizer.json's byte-level pre-tokenizer
#: with tokenizer_config.json's `add_prefix_space` (its generic backend ignores the flag)
_BYTE_LEVEL_CLASSES = frozenset({
    "GPT2Tokenizer", "Qwen2Tokenizer", "RobertaTokenizer", "CodeGenTokenizer", "GPTNeoXTokenizer", "BartTokenizer",
    "LongformerTokenizer", "BlenderbotTokenizer", "DebertaTokenizer", "WhisperTokenizer",
})
#: transformers tokenizer classes that rebuild a SentencePiece-style BPE from `legacy`
#: and `add_prefix_space`, ignoring tokenizer.json's own normalizer and pre-tokenizer
_LLAMA_CLASSES = frozenset({"LlamaTokenizer", "CodeLlamaTokenizer"})


def _apply_transformers_class_settings(backend: Any, config: Mapping[str, Any]) -> None:
    """What transformers' tokenizer class (tokenizer_config.json's `tokenizer_class`) does
    to tokenizer.json's pipeline at load, so the ids match `AutoTokenizer`'s.

    - byte-level classes (GPT-2, Qwen2, RoBERTa, ...): `add_prefix_space` is set on the
      ByteLevel pre-tokenizer;
    - Llama's classes: a Metaspace pre-tokenizer with no normalizer, which prepends `▁` to
      every run of text (`legacy: true`), to the first one only (`legacy: false`, the
      default) or never (`add_prefix_space: false`); the decoder strips that space again.
    """
    from tokenizers import decoders, pre_tokenizers

    name = str(config.get("tokenizer_class") or "").removesuffix("Fast")
    add_prefix_space = config.get("add_prefix_space")
    if name in _BYTE_LEVEL_CLASSES and isinstance(add_prefix_space, bool):
        pre = backend.pre_tokenizer
        steps = [pre] if isinstance(pre, pre_tokenizers.ByteLevel) else []
        if isinstance(pre, pre_tokenizers.Sequence):
            index = 0
            while True:
                try:
                    step = pre[index]
                except IndexError:
                    break
                if isinstance(step, pre_tokenizers.ByteLevel):
                    steps.append(step)
                index += 1
        for step in steps:
            step.add_prefix_space = add_prefix_space
    elif name in _LLAMA_CLASSES and json.loads(backend.to_str()).get("model", {}).get("byte_fallback"):
        prefix = add_prefix_space if isinstance(add_prefix_space, bool) else True
        legacy = bool(config.get("legacy", False))
        scheme = ("always" if legacy else "first") if prefix else "never"
        backend.normalizer = None
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
        backend.decoder = decoders.Sequence(steps)


class Tokenizer:
    """Encode / decode with one model's tokenizer; built by `Tokenizer.from_pretrained`."""

    def __init__(
        self,
        backend: Any,
        *,
        path: str | None = None,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        extra_special_ids: Iterable[int] = (),
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        generation_eos_ids: Iterable[int] = (),
        model_max_length: int | None = None,
    ) -> None:
        """Wrap a `tokenizers.Tokenizer`; the keyword arguments are what the config files say."""
        self._backend = backend
        self.path = path
        self.chat_template = chat_template
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self.bos_token_id = self.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = self.token_to_id(eos_token) if eos_token else None
        self.pad_token_id = self.token_to_id(pad_token) if pad_token else None
        self.unk_token_id = self.token_to_id(unk_token) if unk_token else None
        self._add_bos = add_bos_token
        self._add_eos = add_eos_token
        self.model_max_length = model_max_length

        special = set(extra_special_ids)
        added: dict[int, str] = {}
        for token_id, token in backend.get_added_tokens_decoder().items():
            added[token_id] = token.content
            if token.special:
                special.add(token_id)
        for token_id in (self.bos_token_id, self.eos_token_id, self.pad_token_id, self.unk_token_id):
            if token_id is not None:
                special.add(token_id)
        self._special_ids = frozenset(special)
        self._added_tokens = added
        eos = set(generation_eos_ids)
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        #: Ids that end generation (unless ignore_eos): the eos token and generation_config's eos ids.
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)

    # ----- loading ---------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> "Tokenizer":
        """Load the tokenizer files of a local model folder (see the module docstring)."""
        from tokenizers import Tokenizer as Backend

        from portaserve.framework.gguf import is_gguf_path

        if is_gguf_path(folder):
            return cls._from_gguf(folder)
        root = Path(folder)
        if not root.is_dir():
            raise invalid("tokenizer", f"{str(root)!r} is not a folder")
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise invalid(
                "tokenizer",
                f"the folder {str(root)!r} has no tokenizer.json; portaserve loads tokenizers in the Hugging Face "
                "tokenizers format (tokenizer.json). Pass --tokenizer FOLDER with one, or --skip-tokenizer-init "
                "to serve token ids only",
            )
        try:
            backend = Backend.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust loader raises its own Exception type
            raise invalid("tokenizer", f"cannot load {tokenizer_file}: {e}") from None
        # As transformers does: the file's own padding and truncation settings (a
        # sentence-transformers export carries `Fixed 128` padding and truncation at 128)
        # are training-time choices. Prompts are never padded, and never cut silently: a
        # prompt over the model's limit is a 400, or `truncate_prompt_tokens` when asked.
        backend.no_padding()
        backend.no_truncation()

        config_file = root / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        _apply_transformers_class_settings(backend, config)
        chat_template = _pick_chat_template(config.get("chat_template"))
        jinja_file = root / "chat_template.jinja"
        json_template_file = root / "chat_template.json"
        if jinja_file.is_file():
            chat_template = jinja_file.read_text(encoding="utf-8")
        elif chat_template is None and json_template_file.is_file():
            chat_template = _pick_chat_template(_read_json(json_template_file).get("chat_template"))

        extra_special: list[int] = []
        decoder = config.get("added_tokens_decoder")
        if isinstance(decoder, Mapping):
            for key, entry in decoder.items():
                if isinstance(entry, Mapping) and entry.get("special"):
                    content = _token_content(entry)
                    token_id = backend.token_to_id(content) if content is not None else None
                    if token_id is None and str(key).isdigit():
                        token_id = int(key)
                    if token_id is not None:
                        extra_special.append(token_id)

        generation_eos: list[int] = []
        generation_file = root / "generation_config.json"
        if generation_file.is_file():
            value = _read_json(generation_file).get("eos_token_id")
            values = value if isinstance(value, list) else [value]
            generation_eos = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]

        max_len = config.get("model_max_length")
        return cls(
            backend,
            path=str(root),
            chat_template=chat_template,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            pad_token=_token_content(config.get("pad_token")),
            unk_token=_token_content(config.get("unk_token")),
            extra_special_ids=extra_special,
            add_bos_token=config.get("add_bos_token") if isinstance(config.get("add_bos_token"), bool) else None,
            add_eos_token=config.get("add_eos_token") if isinstance(config.get("add_eos_token"), bool) else None,
            generation_eos_ids=generation_eos,
            model_max_length=max_len if isinstance(max_len, int) and max_len < 10**12 else None,
        )

    @classmethod
    def _from_gguf(cls, file: str | os.PathLike) -> "Tokenizer":
        """The tokenizer a GGUF file's metadata describes (see `framework.gguf.tokenizer`)."""
        from portaserve.framework.gguf import open_gguf
        from portaserve.framework.gguf.tokenizer import gguf_tokenizer

        parts = gguf_tokenizer(open_gguf(file))
        return cls(
            parts.backend,
            path=str(file),
            chat_template=parts.chat_template,
            bos_token=parts.bos_token,
            eos_token=parts.eos_token,
            pad_token=parts.pad_token,
            unk_token=parts.unk_token,
            extra_special_ids=parts.extra_special_ids,
            add_bos_token=parts.add_bos_token,
            add_eos_token=parts.add_eos_token,
            generation_eos_ids=parts.generation_eos_ids,
            model_max_length=parts.model_max_length,
        )

    # ----- encoding and decoding -----------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, the bos / eos the tokenizer adds.

        tokenizer.json's post-processor decides first; `add_bos_token` / `add_eos_token`
        from tokenizer_config.json then add a missing bos / eos, or drop one the
        post-processor added when the config sets them to false (as transformers does).
        """
        if not isinstance(text, str):
            raise invalid("prompt", f"must be a string, got {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if not add_special_tokens:
            return ids
        bos, eos = self.bos_token_id, self.eos_token_id
        plain: list[int] | None = None  # the ids without the post-processor's additions
        if bos is not None and self._add_bos is not None:
            starts = bool(ids) and ids[0] == bos
            if self._add_bos and not starts:
                ids = [bos] + ids
            elif not self._add_bos and starts:
                plain = self._backend.encode(text, add_special_tokens=False).ids
                if ids[1 : 1 + len(plain)] == plain:  # the leading bos is the post-processor's
                    ids = ids[1:]
        if eos is not None and self._add_eos is not None:
            ends = bool(ids) and ids[-1] == eos
            if self._add_eos and not ends:
                ids = ids + [eos]
            elif not self._add_eos and ends:
                if plain is None:
                    plain = self._backend.encode(text, add_special_tokens=False).ids
                if len(ids) > len(plain) and ids[len(ids) - 1 - len(plain) : -1] == plain:
                    ids = ids[:-1]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`. Ids with no token (a model's padded vocabulary rows) decode to nothing."""
        if skip_special_tokens:
            special = self._special_ids
            ids = [i for i in ids if i not in special]
        return self._backend.decode(list(ids), skip_special_tokens=False)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        """The vocabulary strings of `ids` (byte-level spelling for byte-level BPE); None for unknown ids."""
        return [self._backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary string or added token, or None."""
        return self._backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def added_token(self, token_id: int) -> str | None:
        """The text of an added token (special or not), or None for an ordinary token."""
        return self._added_tokens.get(token_id)

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer has text for, added tokens included (transformers' `len(tokenizer)`).

        A model's embedding may have more rows (padded); those ids decode to nothing.
        """
        return self._vocab_size

    def __len__(self) -> int:
        return self._vocab_size

    @property
    def all_special_ids(self) -> list[int]:
        """Sorted special ids: what `skip_special_tokens` drops."""
        return sorted(self._special_ids)

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def backend(self) -> Any:
        """The underlying `tokenizers.Tokenizer`."""
        return self._backend

    # ----- chat ------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Any],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tokenize: bool = False,
    ) -> str | list[int]:
        """Render `messages` with this model's template (or `chat_template`); see `chat.render_chat`.

        With `tokenize`, returns the prompt's ids, encoded without adding special tokens
        (the template writes them itself).
        """
        from portaserve.framework.engine.chat import render_chat

        text = render_chat(
            chat_template if chat_template is not None else self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return (
            f"Tokenizer(path={self.path!r}, vocab_size={self._vocab_size}, eos_token_ids={sorted(self.eos_token_ids)}, "
            f"chat_template={'yes' if self.chat_template else 'no'})"
        )
