"""The plugin contract a vendor can live with (issue 22): each failure a vendor met,
reproduced with a plugin written in the test, and what the contract does now.

- the platform owns its KV block size and dtype preferences (no global 16);
- the op registry is open: a plugin declares a new op with a torch reference;
- a plugin's model implementation is per platform, and a clash fails only that plugin;
- ``--device auto`` passes over a platform that cannot serve the model, saying why.
"""

from __future__ import annotations

import pytest
import torch

from portaserve.framework.config import EngineConfig
from portaserve.framework.errors import UnsupportedError
from portaserve.framework.plan import resolve_plan
from portaserve.framework.plugins import PLATFORM_GROUP, PLUGIN_GROUP, discover_entry_points, load_plugins
from portaserve.framework.selection import choose_platform

from test_plugins import Plugins  # noqa: E402 (tests/framework is on sys.path: rootdir-relative test modules)

pytestmark = pytest.mark.usefixtures("plugin_env")

# A host-CPU "accelerator" whose attention backend serves only 32-token blocks. The test
# reuses the CPU kernels (a test may; the example plugins may not).
ACME = """
import torch
from portaserve.framework.hookspecs import hookimpl
from portaserve.framework.interfaces import DeviceInfo, Platform, PlatformCapabilities
from portaserve.framework.distributed import TorchDistributedCommunicator
from portaserve.platforms.cpu.attention import CpuPagedAttentionBackend
from portaserve.platforms.cpu.kv_cache import HostKVCacheAllocator

PORTASERVE_CONTRACT = "1.1"


class Acme(Platform):
    name = "{name}"
    device_type = "cpu"
    dist_backend = "gloo"
    ranks_share_device = True

    @classmethod
    def probe(cls):
        return DeviceInfo(cls.name, "acme", 1, 2**33, {score}, "always here")

    def capabilities(self):
        return PlatformCapabilities(
            dtypes=frozenset({{torch.float32, torch.bfloat16}}),
            kv_cache_dtypes=frozenset({{"auto"}}),
            block_sizes=frozenset({{32}}),
            default_block_size=32,
            preferred_dtypes=(torch.float32,),
        )

    def preferred_attention_backends(self):
        return ("{name}_attn",)

    def default_communicator(self):
        return "{name}_comm"

    def default_kv_cache_allocator(self):
        return "{name}_kv"

    def _torch_device(self, local_rank):
        return torch.device("cpu")

    def _memory_info(self, local_rank):
        return (2**33, 2**33)


class Attn(CpuPagedAttentionBackend):
    name = "{name}_attn"
    platforms = frozenset({{"{name}"}})
    supported_block_sizes = frozenset({{32}})
    supported_head_sizes = {head_sizes}


class Kv(HostKVCacheAllocator):
    name = "{name}_kv"
    platforms = frozenset({{"{name}"}})


class Comm(TorchDistributedCommunicator):
    name = "{name}_comm"
    platforms = frozenset({{"{name}"}})
    dist_backend = "gloo"


@hookimpl
def portaserve_platform():
    return Acme


@hookimpl
def portaserve_attention_backends():
    return {{Attn.name: Attn}}


@hookimpl
def portaserve_kv_cache_allocators():
    return {{Kv.name: Kv}}


@hookimpl
def portaserve_communicators():
    return {{Comm.name: Comm}}
"""


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    p = Plugins(tmp_path, monkeypatch)
    yield p
    p.cleanup()


def acme(plugins: Plugins, name: str = "acme", score: int = -20, head_sizes: str = "None", extra: str = ""):
    return plugins.add(name, ACME.format(name=name, score=score, head_sizes=head_sizes) + extra, header=False)


def registry_with(*specs, first: bool = False):
    """The installed plugins plus `specs` (listed before them with `first`)."""
    installed = discover_entry_points()
    return load_plugins(entry_points=[*specs, *installed] if first else [*installed, *specs])


def use_registry(monkeypatch, registry) -> None:
    """Make `registry` the process-wide one (what LLM(...) resolves against)."""
    from portaserve.framework import plugins as plugins_module

    monkeypatch.setattr(plugins_module, "_DEFAULT_REGISTRY", registry)


def plan_for(registry, device: str, hf_config: dict, **config):
    cfg = EngineConfig.create(device=device, **config)
    return resolve_plan(cfg, registry, choose_platform(registry, device), hf_config)


# ----- 1. the platform owns its block size --------------------------------------------


def test_platform_default_block_size_is_used_without_flags(plugins, engine_tiny_config):
    registry = registry_with(acme(plugins))
    plan = plan_for(registry, "acme", engine_tiny_config)
    assert plan.block_size == 32
    assert "platform acme's default" in plan.block_size_choice.reason
    assert "block_size" in str(plan) and "32" in str(plan)
    assert plan_for(registry, "cpu", engine_tiny_config).block_size == 16
    # dtype: the checkpoint's bfloat16 is supported on acme, so it is kept; float16 is not
    assert plan.dtype == "bfloat16" and "checkpoint" in plan.dtype_choice.reason
    half = plan_for(registry, "acme", {**engine_tiny_config, "torch_dtype": "float16"})
    assert half.dtype == "float32" and "preferred dtype" in half.dtype_choice.reason


def test_a_block_size_the_platform_lacks_is_refused_naming_the_allowed(plugins, engine_tiny_config):
    registry = registry_with(acme(plugins))
    with pytest.raises(UnsupportedError, match=r"block_size: 16 is not supported on platform acme; supported: \[32\]"):
        plan_for(registry, "acme", engine_tiny_config, block_size=16)


def test_platform_capabilities_reject_a_default_outside_their_sizes():
    from portaserve.framework.interfaces import PlatformCapabilities

    with pytest.raises(ValueError, match="default_block_size 16 is not one of block_sizes"):
        PlatformCapabilities(dtypes=frozenset({torch.float32}), kv_cache_dtypes=frozenset({"auto"}), block_sizes=frozenset({32}))


@pytest.mark.timeout(120)
def test_llm_on_a_32_only_platform_generates_like_cpu(plugins, monkeypatch, checkpoint):
    from portaserve import LLM, SamplingParams

    folder = checkpoint("LlamaForCausalLM")
    registry = registry_with(acme(plugins))
    use_registry(monkeypatch, registry)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["hello world", "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3]
    on_acme = LLM(model=folder, device="acme", dtype="float32", kv_cache_memory=0.05)
    assert on_acme.plan.block_size == 32
    got = [o.outputs[0].token_ids for o in on_acme.generate(prompts, params)]
    on_acme.shutdown()
    on_cpu = LLM(model=folder, device="cpu", dtype="float32", kv_cache_memory=0.05)
    want = [o.outputs[0].token_ids for o in on_cpu.generate(prompts, params)]
    on_cpu.shutdown()
    assert got == want


def test_platforms_listing_warns_when_a_platform_cannot_serve_its_defaults(plugins, monkeypatch):
    from portaserve.framework.cli.platforms import collect, default_warnings, render

    registry = registry_with(acme(plugins))
    platform_cls = registry.platforms["acme"]
    platform = platform_cls(platform_cls.probe())
    assert default_warnings(registry, platform) == []
    # its only attention backend stops serving 32-token blocks: the listing says so
    monkeypatch.setattr(registry.get("attention_backends", "acme_attn"), "supported_block_sizes", frozenset({64}))
    (warning,) = default_warnings(registry, platform)
    assert "default block size 32 is served by none of its attention backends (acme_attn: [64])" in warning
    text = render(collect(registry))
    assert "warning: cannot serve the engine's defaults: its default block size 32" in text
    assert "block sizes 32 (default 32)" in text


# ----- 3. an open op registry ---------------------------------------------------------

OPS = """
from portaserve.framework.interfaces.ops import OpImpl, OpSpec


def gelu_and_mul_ref(x):
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def gelu_and_mul_fast(x):
    d = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def samples(device, dtype, gen):
    return [(torch.randn(3, 16, generator=gen).to(device=device, dtype=dtype),)]


@hookimpl
def portaserve_op_specs():
    return [OpSpec("gelu_and_mul", "gelu_and_mul(x: [..., 2d]) -> [..., d]", gelu_and_mul_ref, samples)]


@hookimpl
def portaserve_custom_ops():
    return [OpImpl("gelu_and_mul", "acme_fast", frozenset({"acme"}), gelu_and_mul_fast)]
"""


def test_a_plugin_declares_a_new_op_and_the_plan_binds_it(plugins, engine_tiny_config):
    from portaserve.framework.layer_context import LayerContext

    registry = registry_with(acme(plugins, extra=OPS))
    assert registry.record("acme").loaded, registry.record("acme").error
    plan = plan_for(registry, "acme", engine_tiny_config)
    ops = dict(plan.custom_ops)
    assert ops["gelu_and_mul"] == "acme_fast"
    assert ops["rms_norm"] == "reference"  # no acme implementation: the torch reference
    assert "gelu_and_mul=acme_fast" in str(plan)
    ctx = LayerContext.from_plan(plan, registry, torch.device("cpu"))
    x = torch.randn(2, 8)
    assert ctx.ops.binding("gelu_and_mul") == "acme_fast"
    torch.testing.assert_close(ctx.ops.get("gelu_and_mul")(x), registry.op_specs["gelu_and_mul"][1].reference(x))
    # on cpu nobody implements it: a model calling it gets the reference
    cpu_plan = plan_for(registry, "cpu", engine_tiny_config)
    assert dict(cpu_plan.custom_ops)["gelu_and_mul"] == "reference"
    cpu_ctx = LayerContext.from_plan(cpu_plan, registry, torch.device("cpu"))
    assert cpu_ctx.ops.get("gelu_and_mul") is registry.op_specs["gelu_and_mul"][1].reference
    with pytest.raises(KeyError, match="op 'nope' is not declared"):
        cpu_ctx.ops.get("nope")


def test_an_implementation_of_an_undeclared_op_fails_its_plugin_only(plugins):
    source = OPS.replace("@hookimpl\ndef portaserve_op_specs():", "def _not_a_hook():")
    registry = registry_with(acme(plugins, extra=source))
    rec = registry.record("acme")
    assert not rec.loaded or rec.error
    assert "implements undeclared op 'gelu_and_mul'" in rec.error and "portaserve_op_specs" in rec.error
    assert all(impl.op != "gelu_and_mul" for _p, impl in registry.custom_ops)
    assert "rms_norm" in registry.op_specs  # the built-ins are untouched


def test_two_plugins_declaring_one_op_fail_the_second(plugins):
    registry = registry_with(acme(plugins, extra=OPS), acme(plugins, "other", extra=OPS))
    assert registry.record("acme").error is None
    assert "op 'gelu_and_mul' is already declared by plugin 'acme'" in registry.record("other").error


# ----- 4. per-platform model implementations ------------------------------------------

CLASH = """
from portaserve.framework.hookspecs import hookimpl
from portaserve.models.llama import LlamaForCausalLM

PORTASERVE_CONTRACT = "1.1"


class Mine(LlamaForCausalLM):
    pass


@hookimpl
def portaserve_model_architectures():
    return {"LlamaForCausalLM": Mine}
"""

OWN_MODEL = """
from portaserve.models.llama import LlamaForCausalLM


class AcmeLlama(LlamaForCausalLM):
    pass


@hookimpl
def portaserve_platform_model_architectures():
    return {"acme": {"LlamaForCausalLM": AcmeLlama}}
"""


def test_a_generic_clash_with_a_builtin_fails_only_the_clashing_plugin(plugins):
    # listed before the built-ins: discovery order must not let it win
    spec = plugins.add("clash", CLASH, group=PLUGIN_GROUP, header=False)
    registry = registry_with(spec, first=True)
    assert "model architecture 'LlamaForCausalLM' is already registered by plugin 'models'" in registry.record("clash").error
    assert registry.record("models").loaded
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "BertModel"} <= set(registry.names("model_architectures"))
    assert registry.get("model_architectures", "LlamaForCausalLM").__module__ == "portaserve.models.llama"


def test_a_platform_model_is_preferred_on_its_platform_only(plugins):
    registry = registry_with(acme(plugins, extra=OWN_MODEL))
    assert registry.record("acme").loaded, registry.record("acme").error
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 1000,
              "max_position_embeddings": 512, "torch_dtype": "float32"}
    plan = plan_for(registry, "acme", config)
    assert "platform acme's own implementation from plugin acme" in plan.model_architecture.reason
    assert plan.model_architecture.rejected[0][0] == "LlamaForCausalLM (models)"
    assert registry.architecture("LlamaForCausalLM", "acme").__name__ == "AcmeLlama"
    assert registry.architecture("LlamaForCausalLM", "cpu").__name__ == "LlamaForCausalLM"
    cpu_plan = plan_for(registry, "cpu", config)
    assert "own implementation" not in cpu_plan.model_architecture.reason


PICKY_MODEL = """
from portaserve.models.llama import LlamaForCausalLM


class PickyLlama(LlamaForCausalLM):
    @classmethod
    def unsupported_reason(cls, hf_config, tensor_parallel_size):
        if hf_config.get("rope_scaling"):
            return "rope scaling is not implemented here"
        return None


@hookimpl
def portaserve_platform_model_architectures():
    return {"acme": {"LlamaForCausalLM": PickyLlama}}
"""

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 512,
         "torch_dtype": "float32"}


def test_a_platform_model_that_declines_a_checkpoint_falls_back_to_the_generic_one(plugins):
    registry = registry_with(acme(plugins, extra=PICKY_MODEL))
    plan = plan_for(registry, "acme", LLAMA)
    assert plan.platform_model and plan.model_class(registry).__name__ == "PickyLlama"
    scaled = {**LLAMA, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    plan = plan_for(registry, "acme", scaled)
    assert not plan.platform_model and plan.model_class(registry).__name__ == "LlamaForCausalLM"
    assert "the generic implementation (platform acme's own cannot run it)" in plan.model_architecture.reason
    assert plan.model_architecture.rejected == (("LlamaForCausalLM (acme, platform acme's own)", "rope scaling is not implemented here"),)


def test_two_plugins_registering_one_platform_model_fail_the_second(plugins):
    registry = registry_with(acme(plugins, extra=OWN_MODEL), plugins.add("copycat", "\nPORTASERVE_CONTRACT = '1.1'\n" + OWN_MODEL, group=PLUGIN_GROUP))
    assert "for platform 'acme' is already registered by plugin 'acme'" in registry.record("copycat").error


# ----- 7. --device auto sees the model ------------------------------------------------


def test_auto_passes_over_a_higher_scored_platform_that_cannot_serve_the_model(plugins, engine_tiny_config):
    # "big" outscores cpu but serves only head size 256; the tiny model's heads are 16 wide
    registry = registry_with(acme(plugins, "big", score=500, head_sizes="frozenset({256})"))
    choice = choose_platform(registry, "auto", can_serve=lambda c: _why_not(registry, c, engine_tiny_config))
    assert choice.platform_cls.name == "cpu"
    passed = dict(choice.rejected)["big"]
    assert "score 500, but cannot serve the model" in passed and "head size 16 not in [256]" in passed
    # forcing it still fails with the reason
    with pytest.raises(UnsupportedError, match=r"head size 16 not in \[256\]"):
        plan_for(registry, "big", engine_tiny_config)


def test_auto_in_the_engine_lists_why_in_the_plan(plugins, monkeypatch, checkpoint):
    from portaserve.framework.engine.startup import resolve_engine

    folder = checkpoint("LlamaForCausalLM")
    registry = registry_with(acme(plugins, "big", score=500, head_sizes="frozenset({256})"))
    spec = resolve_engine(EngineConfig.create(model=folder), registry)
    assert spec.plan.platform.name == "cpu"
    assert "cannot serve the model" in dict(spec.plan.platform.rejected)["big"]
    assert "cannot serve the model" in str(spec.plan)


def _why_not(registry, choice, hf_config):
    try:
        resolve_plan(EngineConfig.create(), registry, choice, hf_config)
    except UnsupportedError as exc:
        return str(exc)
    return None


def test_contract_loads_1_0_plugins_unchanged(plugins):
    spec = plugins.good("old")
    registry = load_plugins(entry_points=[spec])
    assert registry.record("old").loaded and registry.record("old").contract == "1.0"
    assert PLATFORM_GROUP  # the 1.0 platform gets the defaults of every 1.1 addition
    caps = registry.platforms["old"](registry.platforms["old"].probe()).capabilities()
    assert caps.default_block_size == 16 and caps.block_sizes == frozenset({16})
