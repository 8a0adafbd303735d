"""Opening GGUF files: where a model is found, what the plan says, and every bad file
failing with a clear error naming the file before any weight is read."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from portaserve.framework.checkpoint import resolve_model_path
from portaserve.framework.config import EngineConfig
from portaserve.framework.engine.startup import resolve_engine
from portaserve.framework.engine.tokenizer import Tokenizer
from portaserve.framework.errors import InvalidParameterError
from portaserve.framework.gguf import open_gguf
from portaserve.framework.gguf.config import gguf_model_config

from .gguf_files import add_bpe_vocab, finish, tiny_vocab, write_decoder, write_vocab


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_decoder(tmp_path_factory.mktemp("tiny") / "tiny.gguf", matrix_type="Q8_0")


def spec_of(model, **kw):
    return resolve_engine(EngineConfig.create(model=str(model), device="cpu", **kw))


def test_config_from_metadata(tiny_gguf):
    config = gguf_model_config(open_gguf(tiny_gguf))
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (64, 1, 4)
    assert config["num_key_value_heads"] == 2 and config["intermediate_size"] == 128
    assert config["max_position_embeddings"] == 256 and config["rms_norm_eps"] == pytest.approx(1e-6)
    assert config["tie_word_embeddings"] is True  # no output.weight
    assert config["vocab_size"] == 261 and config["eos_token_id"] == 260
    assert config["portaserve_gguf"]["tensor_types"] == {"F32": 3, "Q8_0": 8}


def test_plan_names_the_file_architecture_and_tensor_types(tiny_gguf):
    spec = spec_of(tiny_gguf)
    reason = spec.plan.model_architecture.reason
    assert str(tiny_gguf) in reason and "architecture llama" in reason and "Q8_0 x8" in reason
    assert spec.model_path == str(tiny_gguf) and spec.tokenizer_path == str(tiny_gguf)
    assert "GGUF file" in str(spec.plan)


def test_a_folder_with_one_gguf_is_that_file(tiny_gguf, tmp_path):
    shutil.copy(tiny_gguf, tmp_path / "model.gguf")
    assert resolve_model_path(tmp_path) == (tmp_path / "model.gguf").resolve()


def test_a_folder_with_two_ggufs_needs_gguf_file(tiny_gguf, tmp_path):
    shutil.copy(tiny_gguf, tmp_path / "a.Q8_0.gguf")
    shutil.copy(tiny_gguf, tmp_path / "b.F32.gguf")
    with pytest.raises(InvalidParameterError) as err:
        spec_of(tmp_path)
    assert err.value.param == "gguf_file"
    assert "a.Q8_0.gguf" in str(err.value) and "b.F32.gguf" in str(err.value) and "--gguf-file" in str(err.value)
    assert spec_of(tmp_path, gguf_file="b.F32.gguf").model_path == str((tmp_path / "b.F32.gguf").resolve())
    with pytest.raises(InvalidParameterError, match="c.gguf"):
        spec_of(tmp_path, gguf_file="c.gguf")


def test_a_truncated_file_names_the_file_and_the_tensor(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(InvalidParameterError) as err:
        spec_of(cut)
    assert err.value.param == "model" and str(cut) in str(err.value) and "truncated" in str(err.value)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:200])
    with pytest.raises(InvalidParameterError, match="truncated or corrupt"):
        spec_of(header_only)


def test_not_a_gguf_file(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(InvalidParameterError, match="is not a GGUF file"):
        spec_of(fake)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + np.random.default_rng(0).integers(0, 256, 400, dtype=np.uint8).tobytes())
    with pytest.raises(InvalidParameterError, match="truncated or corrupt"):
        spec_of(garbage)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(InvalidParameterError, match="not a .gguf file"):
        spec_of(other)


def test_an_unsupported_architecture_lists_the_supported_ones(tmp_path):
    file = tmp_path / "gemma.gguf"
    writer = GGUFWriter(str(file), "gemma")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(InvalidParameterError) as err:
        spec_of(file)
    message = str(err.value)
    assert "'gemma' is not supported" in message and "llama, qwen2, qwen3, bert" in message and str(file) in message


def test_an_unsupported_tensor_type_names_the_tensor_and_the_supported_types(tmp_path):
    # IQ4_NL (32 values in 18 bytes): valid blocks of a type the loader does not support
    file = tmp_path / "iq4_nl.gguf"
    writer = GGUFWriter(str(file), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_context_length(256)
    tokens, types, merges = tiny_vocab()
    add_bpe_vocab(writer, tokens, types, merges)
    raw = np.zeros((64, 2 * 18), dtype=np.uint8)
    writer.add_tensor("token_embd.weight", raw, raw_dtype=GGMLQuantizationType.IQ4_NL)
    finish(writer)
    with pytest.raises(InvalidParameterError) as err:
        spec_of(file)
    message = str(err.value)
    assert "'token_embd.weight'" in message and "IQ4_NL" in message and "Q4_K" in message and str(file) in message


@pytest.mark.parametrize("pre", ["kimi-k2", "no-such-pre"])
def test_an_unsupported_pre_tokenizer_is_refused_by_name(tmp_path, pre):
    tokens, types, merges = tiny_vocab()
    file = write_vocab(tmp_path / "vocab.gguf", tokens, types, merges, pre=pre)
    with pytest.raises(InvalidParameterError) as err:
        Tokenizer.from_pretrained(file)
    assert err.value.param == "tokenizer" and repr(pre) in str(err.value) and str(file) in str(err.value)


def test_a_vocab_only_file_loads_as_a_tokenizer(tmp_path):
    tokens, types, merges = tiny_vocab()
    file = write_vocab(tmp_path / "vocab.gguf", tokens, types, merges, pre="gpt-2")
    tok = Tokenizer.from_pretrained(file)
    ids = tok.encode("hello<|endoftext|>", add_special_tokens=False)
    assert ids == [tokens.index("hello"), tokens.index("<|endoftext|>")]
    assert tok.decode(ids) == "hello" and tok.decode(ids, skip_special_tokens=False) == "hello<|endoftext|>"


def test_rope_scaling_and_window_from_metadata(tmp_path):
    from gguf import RopeScalingType

    def yarn(writer):
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(64)
        writer.add_sliding_window(32)

    config = gguf_model_config(open_gguf(write_decoder(tmp_path / "yarn.gguf", configure=yarn)))
    assert config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    assert config["sliding_window"] == 32

    def linear(writer):
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)

    config = gguf_model_config(open_gguf(write_decoder(tmp_path / "linear.gguf", configure=linear)))
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}


def test_llama3_rope_frequency_factors_are_refused_clearly(tmp_path):
    file = write_decoder(tmp_path / "l31.gguf", extra={"rope_freqs.weight": (np.ones(8, dtype=np.float32), "F32")})
    with pytest.raises(InvalidParameterError, match="rope_freqs.weight") as err:
        spec_of(file)
    assert str(file) in str(err.value)


def test_token_types_control_user_defined_unused_and_eog(tmp_path):
    tokens, types, merges = tiny_vocab()
    tokens += ["<tool_call>", "<|im_end|>", "[PAD7]"]
    types += [4, 3, 5]  # USER_DEFINED, CONTROL, UNUSED
    file = write_vocab(tmp_path / "v.gguf", tokens, types, merges, pre="qwen2")
    tok = Tokenizer.from_pretrained(file)
    call, im_end, pad = (tokens.index(t) for t in ("<tool_call>", "<|im_end|>", "[PAD7]"))
    ids = tok.encode("hello<tool_call><|im_end|>", add_special_tokens=False)
    assert ids == [tokens.index("hello"), call, im_end]
    assert tok.decode(ids) == "hello<tool_call>"  # control tokens are skipped, user-defined ones kept
    assert tok.is_special(im_end) and not tok.is_special(call) and not tok.is_special(pad)
    assert im_end in tok.eos_token_ids  # llama.cpp's end-of-generation texts
    assert tok.encode("[PAD7]", add_special_tokens=False) != [pad]  # an unused token is not matched in text


def test_the_fast_metadata_reader_reads_what_ggufs_own_reader_reads(tmp_path):
    # open_gguf parses arrays in one pass (file.py); every field must read the same as with
    # the gguf package's GGUFReader: strings (non-ASCII too), numbers, bools, empty and
    # nested arrays, whole and by index.
    from gguf import GGUFReader

    from portaserve.framework.gguf.file import _reader_class

    file = tmp_path / "fields.gguf"
    writer = GGUFWriter(str(file), "llama")
    tokens, types, merges = tiny_vocab()
    add_bpe_vocab(writer, tokens + ["", "é✓ 日本"], types + [1, 1], merges)
    writer.add_array("test.floats", [0.5, -1.25, 3.0])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.empty_strings", [])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_string("test.string", "plain")
    writer.add_uint32("test.scalar", 7)
    finish(writer)
    fast, plain = _reader_class()(str(file)), GGUFReader(str(file))
    assert list(fast.fields) == list(plain.fields) and fast.data_offset == plain.data_offset
    for key, field in plain.fields.items():
        mine = fast.fields[key]
        assert mine.types == field.types and mine.data == field.data and len(mine.parts) == len(field.parts), key
        assert mine.contents() == field.contents(), key
        if field.data and field.types[0].name == "ARRAY" and field.types[-1].name != "ARRAY":
            assert mine.contents(-1) == field.contents(-1) and mine.contents(slice(1, 3)) == field.contents(slice(1, 3))
    assert open_gguf(file).get_array("tokenizer.ggml.tokens")[-2:] == ["", "é✓ 日本"]


def test_a_string_array_cut_short_is_a_corrupt_file(tmp_path):
    tokens, types, merges = tiny_vocab()
    file = write_vocab(tmp_path / "vocab.gguf", tokens, types, merges, pre="gpt-2")
    data = file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: data.index("hell".encode()) + 2])  # inside the token list
    with pytest.raises(InvalidParameterError, match="truncated or corrupt") as err:
        open_gguf(cut)
    assert str(cut) in str(err.value)
