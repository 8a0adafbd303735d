"""The ExecutionPlan: every component choice for one engine, made once, before weights load.

The driver resolves the plan from the config, the chosen platform, the plugins'
components and the checkpoint's config.json; workers receive it and look components up
by name, never re-selecting. Each choice records why it won and what it beat. A request
the platform cannot serve fails here with what is supported instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import EngineConfig
from .errors import UnsupportedError, invalid
from .interfaces import AttentionSpec, DeviceInfo, Platform
from .interfaces.ops import REFERENCE
from .plugins import PluginRegistry
from .selection import PlatformChoice

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HF_DTYPE_ALIASES = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class Choice:
    """One decision: the name chosen, why, and the candidates it beat (name, why not)."""

    name: str
    reason: str
    rejected: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    """Frozen, picklable, printable: what runs, where, and why."""

    platform: Choice
    device: DeviceInfo
    model_architecture: Choice
    dtype: str
    attention: tuple[tuple[str, Choice], ...]  # (layer type, backend choice)
    attention_specs: tuple[tuple[str, AttentionSpec], ...]
    kv_cache_dtype: str
    block_size: int
    kv_cache_allocator: Choice
    communicator: Choice
    quantization: Choice
    compilation: Choice  # name = mode; reason names the platform's compile backend
    compile_backend: str | None
    custom_ops: tuple[tuple[str, str], ...] = ()  # (op, implementation name or "reference"), every declared op
    tensor_parallel_size: int = 1
    quantization_config: Mapping[str, Any] = field(default_factory=dict)
    #: The platform's declared features (QuantMethods pick variants by them, e.g. an fp8 flavour).
    platform_features: tuple[str, ...] = ()
    #: The method for layers that are never quantized (the LM head): "none", or the
    #: platform's variant of it (see QuantMethod.variant_of).
    unquantized_method: str = "none"
    #: The scheduler's prompt-token cap for steps that carry decodes (None: no cap), and why.
    prefill_cap_with_decodes: int | None = None
    prefill_cap: Choice = Choice("none", "no cap requested")
    #: Where the dtype and the KV block size came from (the user, the checkpoint, the platform).
    dtype_choice: Choice = Choice("float32", "default")
    block_size_choice: Choice = Choice("16", "default")
    #: True when the model is the platform's own implementation of the architecture.
    platform_model: bool = False
    #: The structured-outputs backend (name "none" when none can run: such requests get a 400).
    structured_outputs: Choice = Choice("none", "not chosen")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def model_class(self, registry: PluginRegistry):
        """The architecture class the plan chose (the platform's own or the generic one)."""
        return registry.architecture(self.model_architecture.name, self.platform.name, generic=not self.platform_model)

    def attention_backend_for(self, layer_type: str) -> str:
        return dict(self.attention)[layer_type]

    def spec_for(self, layer_type: str) -> AttentionSpec:
        return dict(self.attention_specs)[layer_type]

    def choices(self) -> list[tuple[str, Choice]]:
        rows = [("platform", self.platform), ("model", self.model_architecture), ("dtype", self.dtype_choice),
                ("block_size", self.block_size_choice)]
        rows += [(f"attention[{t}]", c) for t, c in self.attention]
        rows += [
            ("kv_cache_allocator", self.kv_cache_allocator),
            ("communicator", self.communicator),
            ("quantization", self.quantization),
            ("compilation", self.compilation),
            ("prefill_cap", self.prefill_cap),
            ("structured_outputs", self.structured_outputs),
        ]
        return rows

    def __str__(self) -> str:
        lines = [
            "ExecutionPlan",
            f"  device              {self.device.describe()}",
            f"  dtype               {self.dtype}",
            f"  kv cache            dtype={self.kv_cache_dtype} block_size={self.block_size}",
            f"  tensor parallel     {self.tensor_parallel_size}",
        ]
        for label, choice in self.choices():
            lines.append(f"  {label:<20}{choice.name}  ({choice.reason})")
            for cand, why in choice.rejected:
                lines.append(f"  {'':<20}  not {cand}: {why}")
        if self.custom_ops:
            lines.append("  ops                 " + ", ".join(f"{op}={impl}" for op, impl in self.custom_ops))
        return "\n".join(lines)


def checkpoint_dtype(hf_config: Mapping[str, Any]) -> str:
    """The dtype a checkpoint declares (`torch_dtype`, or `dtype` in newer transformers)."""
    raw = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    raw = str(raw).removeprefix("torch.")
    raw = _HF_DTYPE_ALIASES.get(raw, raw)
    return raw if raw in DTYPES else "float32"


def resolve_plan(
    config: EngineConfig,
    registry: PluginRegistry,
    platform_choice: PlatformChoice,
    hf_config: Mapping[str, Any],
) -> ExecutionPlan:
    """Make every choice for `config` on the chosen platform, or fail saying what is supported."""
    platform = platform_choice.instantiate()
    caps = platform.capabilities()
    platform_row = Choice(platform.name, platform_choice.reason, platform_choice.rejected)

    arch_choice, arch_cls = _choose_architecture(registry, hf_config, platform.name, config.tensor_parallel_size)
    dtype_choice = _choose_dtype(config, platform, hf_config)
    dtype = dtype_choice.name
    block_size_choice = _choose_block_size(config, platform)
    block_size = int(block_size_choice.name)
    torch_dtype = DTYPES[dtype]
    if config.kv_cache_dtype not in caps.kv_cache_dtypes:
        raise UnsupportedError(
            f"kv_cache_dtype: {config.kv_cache_dtype!r} is not supported on platform {platform.name}; "
            f"supported: {sorted(caps.kv_cache_dtypes)}"
        )
    specs = arch_cls.attention_specs(hf_config, torch_dtype, config.kv_cache_dtype)
    attention = tuple(
        (layer_type, _choose_attention(config, registry, platform, layer_type, spec, block_size))
        for layer_type, spec in specs.items()
    )
    compilation, compile_backend = _choose_compilation(config, platform)
    # traced by torch.compile (a graph recorder, such as CUDA graphs, traces nothing)
    traced = compile_backend is not None and compile_backend not in caps.graph_backends
    quant_choice, quant_config, unquantized = _choose_quantization(
        config, registry, platform, hf_config, torch_dtype, compiled=traced
    )
    return ExecutionPlan(
        platform=platform_row,
        device=platform.info,
        model_architecture=arch_choice,
        dtype=dtype,
        attention=attention,
        attention_specs=tuple(specs.items()),
        kv_cache_dtype=config.kv_cache_dtype,
        block_size=block_size,
        kv_cache_allocator=_choose_component(registry, "kv_cache_allocators", platform, platform.default_kv_cache_allocator()),
        communicator=_choose_component(registry, "communicators", platform, platform.default_communicator()),
        quantization=quant_choice,
        compilation=compilation,
        compile_backend=compile_backend,
        custom_ops=_choose_ops(registry, platform, compiled=traced),
        tensor_parallel_size=config.tensor_parallel_size,
        quantization_config=quant_config,
        platform_features=tuple(sorted(caps.features)),
        unquantized_method=unquantized,
        dtype_choice=dtype_choice,
        block_size_choice=block_size_choice,
        platform_model=registry.platform_models.get((platform.name, arch_choice.name)) is not None
        and arch_cls is registry.platform_models[(platform.name, arch_choice.name)].load(),
        structured_outputs=choose_structured_backend(config, registry),
        **_choose_prefill_cap(config, platform, is_pooling=bool(getattr(arch_cls, "is_pooling", False))),
    )


def choose_structured_backend(config: EngineConfig, registry: PluginRegistry) -> Choice:
    """The requested structured-outputs backend, or for 'auto' the first that can run
    (xgrammar, then llguidance, then any other registered one)."""
    names = registry.names("structured_output_backends")
    wanted = config.structured_outputs_backend
    if wanted != "auto":
        if wanted not in names:
            raise invalid("structured_outputs_backend", f"{wanted!r} is not registered; registered: {', '.join(names) or 'none'}")
        reason = registry.get("structured_output_backends", wanted).unavailable_reason()
        if reason is not None:
            raise invalid("structured_outputs_backend", f"{wanted!r} cannot run: {reason}")
        return Choice(wanted, "--structured-outputs-backend")
    order = sorted(names, key=lambda n: ({"xgrammar": 0, "llguidance": 1}.get(n, 2), n))
    rejected = []
    for name in order:
        reason = registry.get("structured_output_backends", name).unavailable_reason()
        if reason is None:
            return Choice(name, "the first available of " + ", ".join(order), tuple(rejected))
        rejected.append((name, reason))
    return Choice("none", "no structured-outputs backend is installed (pip install xgrammar)", tuple(rejected))


def resolve_platform_choices(
    config: EngineConfig, registry: PluginRegistry, platform: Platform
) -> tuple[tuple[str, Choice], ...]:
    """The plan's choices that need no model: KV-cache allocator, communicator, compilation.

    `portaserve platforms --device NAME` shows them; `resolve_plan` makes the same choices.
    """
    compilation, _backend = _choose_compilation(config, platform)
    return (
        ("kv_cache_allocator", _choose_component(registry, "kv_cache_allocators", platform, platform.default_kv_cache_allocator())),
        ("communicator", _choose_component(registry, "communicators", platform, platform.default_communicator())),
        ("compilation", compilation),
    )


def attention_candidates(registry: PluginRegistry, platform: Platform) -> tuple[Choice, ...]:
    """Every registered attention backend, in the order the plan tries them on `platform`.

    A candidate's `reason` says why it can run there ("runs on ...") or why not; the
    per-layer checks (head size, dtype, window...) need the model and happen in `resolve_plan`.
    """
    backends = registry.load_all("attention_backends")
    features = platform.capabilities().features
    preference = list(platform.preferred_attention_backends())
    out = []
    for name in preference + sorted(n for n in backends if n not in preference):
        cls = backends.get(name)
        if cls is None:
            out.append(Choice(name, "preferred by the platform but not registered (plugin not installed?)"))
        elif not cls.runs_on(platform.name):
            out.append(Choice(name, f"unusable: runs on {sorted(cls.platforms)}, not {platform.name}"))
        elif cls.required_features - features:
            out.append(Choice(name, f"unusable: needs platform features {sorted(cls.required_features - features)}"))
        else:
            rank = "preferred" if name in preference else "candidate"
            out.append(Choice(name, f"{rank}: runs on {platform.name}"))
    return tuple(out)


def _choose_architecture(registry: PluginRegistry, hf_config: Mapping[str, Any], platform: str, tp: int = 1):
    archs = list(hf_config.get("architectures") or [])
    known = registry.architecture_names(platform)
    for arch in archs:
        if arch not in known:
            continue
        gguf = hf_config.get("portaserve_gguf")
        if gguf:
            from .gguf.config import describe_gguf

            reason = describe_gguf(gguf)
        else:
            reason = f"config.json architectures lists {arch}"
        rejected: list[tuple[str, str]] = []
        own = registry.platform_models.get((platform, arch))
        if own is not None:
            cls = own.load()
            why = _arch_unsupported(cls, hf_config, tp)
            if why is None:
                if arch in registry.components["model_architectures"]:
                    generic = registry.components["model_architectures"][arch]
                    rejected.append((f"{arch} ({generic.plugin})", f"platform {platform} has its own implementation"))
                return Choice(arch, f"{reason}; platform {platform}'s own implementation from plugin {own.plugin}",
                              tuple(rejected)), cls
            rejected.append((f"{arch} ({own.plugin}, platform {platform}'s own)", why))
            if arch not in registry.components["model_architectures"]:
                raise UnsupportedError(f"model: platform {platform}'s {arch} (plugin {own.plugin}) cannot run it: {why}")
        cls = registry.get("model_architectures", arch)
        why = _arch_unsupported(cls, hf_config, tp)
        if why is not None:
            raise UnsupportedError(f"model: {arch} cannot run this checkpoint: {why}")
        if rejected:
            reason += f"; the generic implementation (platform {platform}'s own cannot run it)"
        return Choice(arch, reason, tuple(rejected)), cls
    raise UnsupportedError(
        f"model: architecture {archs or '(none listed)'} is not supported; supported architectures: "
        f"{', '.join(known) or 'none registered'} (a plugin can add one through portaserve_model_architectures)"
    )


def _arch_unsupported(cls, hf_config: Mapping[str, Any], tp: int) -> str | None:
    check = getattr(cls, "unsupported_reason", None)  # 1.0 architectures need not subclass the interface
    return check(hf_config, tp) if check is not None else None


def _choose_dtype(config: EngineConfig, platform: Platform, hf_config: Mapping[str, Any]) -> Choice:
    caps = platform.capabilities()
    supported = sorted(dtype_name(d) for d in caps.dtypes)
    if config.dtype != "auto":
        if DTYPES[config.dtype] not in caps.dtypes:
            raise UnsupportedError(
                f"dtype: {config.dtype} is not supported on platform {platform.name}; supported: {', '.join(supported)}"
            )
        return Choice(config.dtype, f"--dtype {config.dtype}")
    dtype = checkpoint_dtype(hf_config)
    if DTYPES[dtype] in caps.dtypes:
        return Choice(dtype, "the checkpoint's dtype (--dtype auto)")
    # auto follows the checkpoint where the platform can, else the platform's preference
    order = [dtype_name(d) for d in caps.preferred_dtypes] or [d for d in ("bfloat16", "float16", "float32") if d in supported]
    fallback = next((d for d in order if d in DTYPES), None)
    if fallback is None:
        raise UnsupportedError(f"dtype: platform {platform.name} supports none of {list(DTYPES)}")
    source = f"platform {platform.name}'s preferred dtype" if caps.preferred_dtypes else "the first supported of bfloat16, float16, float32"
    return Choice(fallback, f"{source}: the checkpoint's {dtype} is not supported there", ((dtype, f"not supported on {platform.name}"),))


def _choose_block_size(config: EngineConfig, platform: Platform) -> Choice:
    caps = platform.capabilities()
    allowed = sorted(caps.block_sizes)
    if config.block_size is None:
        return Choice(str(caps.default_block_size), f"platform {platform.name}'s default (supported: {allowed})")
    if config.block_size not in caps.block_sizes:
        raise UnsupportedError(
            f"block_size: {config.block_size} is not supported on platform {platform.name}; supported: {allowed} "
            f"(unset, it takes the platform's default {caps.default_block_size})"
        )
    return Choice(str(config.block_size), f"--block-size {config.block_size}")


def _choose_attention(
    config: EngineConfig, registry: PluginRegistry, platform: Platform, layer_type: str, spec: AttentionSpec, block_size: int
) -> Choice:
    backends = registry.load_all("attention_backends")
    features = platform.capabilities().features
    preference = list(platform.preferred_attention_backends())
    names = preference + sorted(n for n in backends if n not in preference)
    rejected: list[tuple[str, str]] = []
    usable: list[str] = []
    for name in names:
        cls = backends.get(name)
        if cls is None:
            continue
        if not cls.runs_on(platform.name):
            rejected.append((name, f"runs on {sorted(cls.platforms)}, not {platform.name}"))
            continue
        missing = cls.required_features - features
        if missing:
            rejected.append((name, f"needs platform features {sorted(missing)}"))
            continue
        why = cls.unsupported_reason(spec, block_size)
        if why:
            rejected.append((name, why))
            continue
        usable.append(name)
    if config.attention_backend is not None:
        forced = config.attention_backend
        if forced in usable:
            others = [(n, "not requested") for n in usable if n != forced] + rejected
            return Choice(forced, f"forced with --attention-backend {forced}", tuple(others))
        why = dict(rejected).get(forced, "not registered" if forced not in backends else "unusable")
        raise UnsupportedError(
            f"attention_backend: {forced!r} cannot serve {layer_type} layers on {platform.name}: {why}; "
            f"usable: {usable or 'none'}"
        )
    if not usable:
        detail = "; ".join(f"{n}: {w}" for n, w in rejected) or "no attention backend is registered"
        raise UnsupportedError(f"no attention backend can serve {layer_type} layers ({_spec_summary(spec)}) on {platform.name}: {detail}")
    winner = usable[0]
    reason = "the platform's preferred backend" if winner in preference else "the only usable backend" if len(usable) == 1 else "first usable backend by name"
    others = [(n, f"lower preference than {winner}") for n in usable[1:]] + rejected
    return Choice(winner, f"{reason} for {_spec_summary(spec)}", tuple(others))


def _spec_summary(spec: AttentionSpec) -> str:
    parts = [f"head_size={spec.head_size}", f"heads={spec.num_heads}/{spec.num_kv_heads}", dtype_name(spec.dtype)]
    if spec.sliding_window:
        parts.append(f"window={spec.sliding_window}")
    if not spec.causal:
        parts.append("encoder")
    return " ".join(parts)


def _choose_component(registry: PluginRegistry, kind: str, platform: Platform, wanted: str) -> Choice:
    comps = registry.load_all(kind)
    label = kind.replace("_", " ")[:-1]
    cls = comps.get(wanted)
    if cls is None or platform.name not in cls.platforms:
        candidates = [n for n, c in comps.items() if platform.name in c.platforms]
        if not candidates:
            raise UnsupportedError(f"no {label} is registered for platform {platform.name} (wanted {wanted!r})")
        wanted = candidates[0]
        return Choice(wanted, f"first {label} registered for {platform.name}")
    others = tuple((n, f"runs on {sorted(c.platforms)}") for n, c in comps.items() if n != wanted)
    return Choice(wanted, f"platform {platform.name}'s default", others)


def _choose_quantization(
    config, registry, platform, hf_config, torch_dtype, compiled: bool = False
) -> tuple[Choice, dict, str]:
    """(the linear layers' method, the checkpoint's quantization_config, the method for
    layers that are never quantized)."""
    methods = registry.load_all("quant_methods")
    qcfg = dict(hf_config.get("quantization_config") or {})
    features = platform.capabilities().features
    checkpoint_method = _checkpoint_quant_method(qcfg) if qcfg else None

    def usable_reason(name: str, for_checkpoint: bool = True) -> str | None:
        cls = methods.get(name)
        if cls is None:
            return "not registered"
        if cls.platforms is not None and platform.name not in cls.platforms:
            return f"runs on {sorted(cls.platforms)}, not {platform.name}"
        # a checkpoint format's needs depend on its config (the schemes it dispatches to)
        config = qcfg if for_checkpoint and name == checkpoint_method else {}
        return cls.unsupported_reason(features, torch_dtype, config)

    # what the platform offers at all (a checkpoint format is listed whatever this checkpoint holds)
    # (platform variants are implementations, not choices: they are not listed)
    supported = [
        n for n in sorted(methods)
        if usable_reason(n, for_checkpoint=False) is None and getattr(methods[n], "variant_of", None) is None
    ]
    if config.quantization is not None and checkpoint_method == "gguf" and config.quantization != "gguf":
        # a GGUF file's blocks can be dequantized at load for any other method
        qcfg, checkpoint_method = {}, None
    if config.quantization is not None:
        name, source = config.quantization, f"--quantization {config.quantization}"
        if checkpoint_method not in (None, "none", name):
            raise UnsupportedError(
                f"quantization: the checkpoint is already quantized ({qcfg.get('quant_method')!r}); "
                f"--quantization {name} cannot re-quantize it: leave --quantization unset or pass {checkpoint_method}"
            )
        if name == "gguf" and checkpoint_method != "gguf":
            raise UnsupportedError(
                "quantization: 'gguf' keeps a GGUF file's quantized blocks; this checkpoint is not a quantized "
                "GGUF decoder file (leave --quantization unset for GGUF files)"
            )
    elif qcfg:
        name = checkpoint_method
        source = f"the checkpoint's quantization_config ({qcfg.get('quant_method', '?')})"
    else:
        name, source = "none", "no quantization requested"
    why = usable_reason(name)
    if why is not None:
        raise UnsupportedError(
            f"quantization: {name!r} is not available on platform {platform.name} ({why}); "
            f"methods supported there: {', '.join(supported)}"
        )
    rejected = [(n, "not requested") for n in supported if n != name]
    # a platform variant replaces the method unless the user named the method itself
    # (`--quantization none` is the escape hatch to plain F.linear)
    unquantized = _choose_variant(methods, "none", usable_reason, compiled)[0] or "none"
    variant, variant_rejected = None, []
    if config.quantization is None:
        variant, variant_rejected = _choose_variant(methods, name, usable_reason, compiled)
    elif name == "none":
        unquantized = "none"
        variant_rejected = [(n, f"--quantization {name} names the plain method") for n, c in methods.items() if getattr(c, "variant_of", None) == name]
    rejected += variant_rejected
    if variant is not None:
        cls = methods[variant]
        summary = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else "a platform variant"
        choice = Choice(variant, f"{source}; {variant} implements {name!r} on {platform.name} ({summary})", tuple(rejected))
        return choice, qcfg, unquantized
    return Choice(name, source, tuple(rejected)), qcfg, unquantized


def _choose_variant(methods, name: str, usable_reason, compiled: bool) -> tuple[str | None, list[tuple[str, str]]]:
    """The best registered platform variant of method `name` (see QuantMethod.variant_of)."""
    best: tuple[int, str] | None = None
    rejected = []
    for cand, cls in sorted(methods.items()):
        if cand == name or getattr(cls, "variant_of", None) != name:
            continue
        why = usable_reason(cand, for_checkpoint=False)
        if why is None and compiled and not cls.traceable:
            why = "cannot be traced by torch.compile; the compiled graph does its own weight packing"
        if why is not None:
            rejected.append((cand, why))
        elif best is None or cls.variant_priority > best[0]:
            best = (cls.variant_priority, cand)
    return (best[1] if best else None), rejected


def _checkpoint_quant_method(qcfg: Mapping[str, Any]) -> str:
    """Map a checkpoint's quantization_config to a registered method name."""
    method = str(qcfg.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return "compressed-tensors"
    return method or "none"


def _choose_prefill_cap(config: EngineConfig, platform: Platform, *, is_pooling: bool) -> dict[str, Any]:
    asked = config.max_prefill_tokens_with_decodes
    if asked == "auto":
        cap = platform.capabilities().serving_prefill_cap
        reason = f"platform {platform.name}'s measured serving default"
    else:
        cap = asked or None
        reason = f"max_prefill_tokens_with_decodes={asked}" if asked is not None else "not requested (the LLM API's default)"
    if cap is not None and (is_pooling or not config.enable_chunked_prefill):
        why = "an encoder's prompts are never split" if is_pooling else "chunked prefill is off: prompts are not split"
        cap, reason = None, f"{reason}, but {why}"
    if cap is None:
        choice = Choice("none", f"{reason}: a step with decodes takes the whole token budget")
    else:
        choice = Choice(f"{cap} prompt tokens", f"{reason}: at most {cap} prompt tokens in a step that carries decodes")
    return {"prefill_cap_with_decodes": cap, "prefill_cap": choice}


def _choose_compilation(config: EngineConfig, platform: Platform) -> tuple[Choice, str | None]:
    backends = dict(platform.capabilities().compile_backends)
    mode = config.effective_compilation_mode
    if mode is None:
        mode = platform.capabilities().default_compilation_mode
        reason = f"platform {platform.name}'s measured default"
    else:
        reason = "--enforce-eager" if config.enforce_eager else f"--compilation-mode {mode}"
    if mode == "none":
        return Choice("none", f"{reason}: eager execution"), None
    backend = backends.get(mode)
    if backend is None:
        offered = sorted(backends)
        raise UnsupportedError(
            f"compilation_mode: {mode!r} is not supported on platform {platform.name}; supported: none, {', '.join(offered) or '(none)'}"
        )
    return Choice(mode, f"{reason}; compile backend {backend}"), backend


def _choose_ops(registry: PluginRegistry, platform: Platform, compiled: bool = False) -> tuple[tuple[str, str], ...]:
    """Every declared op with its binding: the best usable implementation, else "reference"."""
    features = platform.capabilities().features
    best: dict[str, tuple[int, str]] = {}
    for _plugin, impl in registry.custom_ops:
        if platform.name not in impl.platforms or impl.required_features - features:
            continue
        if compiled and not impl.traceable:
            continue
        if impl.op not in best or impl.priority > best[impl.op][0]:
            best[impl.op] = (impl.priority, impl.name)
    return tuple(sorted((op, best[op][1] if op in best else REFERENCE) for op in registry.op_specs))
