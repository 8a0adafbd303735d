"""The portaserve hook contract: every hook a plugin may implement.

This module is the public API of the project. A plugin is a module (or an object in
one, for an entry point written ``"package.module:attr"``), named by an entry point in
the group ``portaserve.platforms`` (platforms) or ``portaserve.plugins`` (components
only), that

- sets ``PORTASERVE_CONTRACT = "<major>.<minor>"``, the contract version it was built
  for: the loader accepts it when the major versions are equal and the plugin's minor
  version is not newer than :data:`CONTRACT_VERSION`'s, and otherwise reports and skips
  it with both versions in the message;
- decorates its functions with :data:`hookimpl`.

Every hook is called once per plugin, in isolation: a hook that raises is reported
against its plugin and that plugin's contribution is dropped; no hook stops at the first
non-None result. Components are contributed as mappings of name to class, or to a
``"module:Class"`` string imported when first used (the class's ``name`` attribute
must equal the key); each class declares its own capabilities, see
``portaserve.framework.interfaces``. Two plugins registering different classes under
one name is an error reported against the second.

Versioning, as for any API: additions (a hook, an interface method or attribute with a
default, an op) bump the minor version, and plugins built for any older 1.x keep loading
unchanged. Removing or changing a hook's or a method's signature or meaning bumps the
major version; the loader's rule then becomes "major equal, or a supported older major
loaded through an adapter" (an adapter module that wraps the old plugin's hooks in the
new signatures), and this docstring lists the adapters. There are none: every 1.x plugin
loads as written.

History:

- 1.0: platforms, attention backends, communicators, KV-cache allocators, quant
  methods, model architectures, checkpoint writers, custom ops, parsers.
- 1.1: ``portaserve_op_specs`` (new named ops with a torch reference: the op registry
  is open); ``portaserve_platform_model_architectures`` (a platform's own model
  implementations); platform-owned defaults (``PlatformCapabilities.block_sizes``,
  ``default_block_size``, ``preferred_dtypes``; ``Platform.ranks_share_device``); the
  KV layout's block dimension declared by the attention backend
  (``AttentionBackend.kv_cache_block_dim``); ``AttentionBackend.platforms = None`` for
  a backend that runs wherever its required features are declared; declared interface
  members for what the engine used to reach around the contract: the Communicator
  constructor and ``weight_update_group``, the QuantMethod loader conventions and
  ``release_weights`` / ``restore_weights`` (sleep level 2, weight updates),
  ``Platform.ray_resource``, ``Platform.graph_capture`` and ``Platform.compute_units``;
  ``AttentionBackend.forward`` a public wrapper that checks shapes, dtypes, the cache
  and ``AttentionBackend.metadata_type`` and calls the ``_forward`` a backend defines (a
  1.0 backend that overrides ``forward`` itself keeps working, unchecked).
  All have defaults, so 1.0 plugins load unchanged.
- 1.2: quantized embedding tables: ``QuantMethod.quantizes_embedding`` and
  ``QuantMethod.embedding`` (a format that quantizes the table, GGUF, keeps it
  quantized; the default keeps tables dense, so 1.x methods load unchanged).
- 1.3: graph recorders beyond CUDA graphs: ``PlatformCapabilities.graph_backends`` (the
  compile backends that record rather than trace, so the plan keeps untraceable
  components under them), ``GraphCapture.batch_sizes`` (the decode batch sizes worth a
  recording; None keeps the engine's buckets) and ``GraphCaptureUnsupported`` (a recorder
  refusing a callable it cannot replay; the engine then decodes eagerly). The CPU
  platform records its C kernel calls. Defaults keep 1.x platforms unchanged.
- 1.4: vision-language models: ``ModelArchitecture.multimodal_processor`` (how the
  front end prepares a model's images: preprocessing, the placeholder token, tokens per
  image), ``ModelArchitecture.embed_multimodal`` (images to input embeddings) and
  ``ModelStepContext.mm_embeds`` (the rows of a step whose embeddings the model
  replaces). A vision encoder attends through an attention backend's encoder mode
  (``AttentionSpec.causal`` False, already in the conformance kit). Defaults (no images)
  keep 1.x models unchanged.
- 1.5: structured outputs: ``portaserve_structured_output_backends`` (grammar backends
  by name, the ``StructuredOutputBackend`` interface: compile a constraint for the
  model's vocabulary, match tokens, fill a token bitmask, roll back) and the
  ``apply_token_bitmask`` op (a torch reference; the GPU platforms bind a Triton kernel).
- 1.6: LoRA adapters: the ``lora_linear`` op (many adapters over one linear layer in one
  batch, grouped by adapter slot: a torch reference, a C kernel on the CPU platform, a
  Triton kernel on the GPU platforms). Adapters load in the worker through the model's
  linear layers, so a platform needs nothing else; one that binds no implementation runs
  the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence  # noqa: F401 (annotations)
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from portaserve.framework.interfaces import (
        AttentionBackend,
        Communicator,
        KVCacheAllocator,
        ModelArchitecture,
        Platform,
        QuantMethod,
    )
    from portaserve.framework.interfaces.ops import OpImpl, OpSpec

PROJECT_NAME = "portaserve"
#: The contract version of this portaserve: (major, minor).
CONTRACT_VERSION = (1, 6)

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
#: Decorator for plugin hook implementations: ``@hookimpl def portaserve_platform(): ...``
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def portaserve_platform() -> "type[Platform] | None":
    """Return this plugin's :class:`~portaserve.framework.interfaces.Platform` class.

    The class is not instantiated: the loader calls its side-effect-free ``probe()``
    for ``portaserve platforms`` and ``--device auto``, and instantiates only the
    chosen one. A component-only plugin does not implement this hook.

    :returns: a Platform subclass, or None.
    """


@hookspec
def portaserve_attention_backends() -> "Mapping[str, type[AttentionBackend] | str]":
    """Return attention backend classes this plugin contributes.

    Each class declares the platforms it runs on and its capabilities (dtypes, KV
    dtypes, head sizes, block sizes, sliding window, encoder support, GQA ratio). The
    plan picks, per layer type, the first backend in the platform's preference order
    that supports the layer (or the one forced with ``--attention-backend``).

    :returns: mapping of backend name to class or ``"module:Class"`` string (imported
        when first needed, so a plugin's import stays cheap); names are global.
    """


@hookspec
def portaserve_communicators() -> "Mapping[str, type[Communicator] | str]":
    """Return communicator classes (collectives for tensor parallelism and weight sync).

    :returns: mapping of name to class or ``"module:Class"`` string.
    """


@hookspec
def portaserve_kv_cache_allocators() -> "Mapping[str, type[KVCacheAllocator] | str]":
    """Return KV-cache allocator classes (sizing, allocation, device <-> host copies).

    :returns: mapping of name to class or ``"module:Class"`` string.
    """


@hookspec
def portaserve_quant_methods() -> "Mapping[str, type[QuantMethod] | str]":
    """Return quantization methods, registered by their ``name`` (``--quantization NAME``).

    Each declares the platforms and platform features it requires. A platform's faster
    implementation of another method's numerics (a prepacked-weight matmul for "none")
    sets ``variant_of`` to that method's name; the plan then uses it in that method's place
    wherever it can run.

    :returns: mapping of method name to class or ``"module:Class"`` string.
    """


@hookspec
def portaserve_model_architectures() -> "Mapping[str, type[ModelArchitecture] | str]":
    """Return model architectures by the name HF config.json lists in ``architectures``.

    :returns: mapping of architecture name to class or ``"module:Class"`` string.
    """


@hookspec
def portaserve_checkpoint_writers() -> "Mapping[str, Callable | str]":
    """Return writers of deterministic random-weight checkpoints, by architecture name.

    A writer is called as ``writer(out_dir: str, size: str, seed: int) -> None`` with
    size "tiny", "small" or "bench", and writes a complete HF folder (config.json,
    safetensors, tokenizer). ``portaserve make-checkpoint``, the demo default model and
    the conformance kit use them, so a plugin that adds an architecture can add its test
    checkpoint too.
    """


@hookspec
def portaserve_platform_model_architectures() -> "Mapping[str, Mapping[str, type[ModelArchitecture] | str]]":
    """Return this plugin's own model implementations, per platform (contract 1.1).

    ``{"acme": {"LlamaForCausalLM": "acme_plugin.llama:AcmeLlama"}}`` makes the plan use
    ``AcmeLlama`` for Llama checkpoints on platform ``acme`` (and say so), while every
    other platform keeps the generic implementation. A registration never replaces
    another plugin's: the same (platform, architecture) registered by two plugins fails
    the second. A generic registration under a built-in name (through
    ``portaserve_model_architectures``) likewise fails only the plugin that made it.

    :returns: mapping of platform name to a mapping of architecture name to class or
        ``"module:Class"`` string.
    """


@hookspec
def portaserve_op_specs() -> "Sequence[OpSpec]":
    """Declare new named ops, each with a torch reference implementation (contract 1.1).

    A model calls an op by name (``ctx.ops.get(name)``) and gets the platform's
    implementation where one is bound, else the reference, so a model using a new op runs
    everywhere. Names are global: declaring a name another plugin declared fails this
    plugin. See :class:`~portaserve.framework.interfaces.ops.OpSpec`.

    :returns: a sequence of OpSpec.
    """


@hookspec
def portaserve_custom_ops() -> "Sequence[OpImpl]":
    """Return implementations of declared ops (RMSNorm, SiLU-and-mul, rotary, or a
    plugin's own) for the platforms they name.

    See :mod:`portaserve.framework.interfaces.ops` for the built-in op names and
    signatures. An implementation of an op no loaded plugin declares is reported against
    this plugin and dropped. The conformance kit compares every implementation with the
    op's reference.
    """


@hookspec
def portaserve_reasoning_parsers() -> "Mapping[str, type | str]":
    """Return reasoning parsers by name (``--reasoning-parser NAME``)."""


@hookspec
def portaserve_tool_parsers() -> "Mapping[str, type | str]":
    """Return tool-call parsers by name (``--tool-call-parser NAME``)."""


@hookspec
def portaserve_structured_output_backends() -> "Mapping[str, type | str]":
    """Return structured-output backends by name (``--structured-outputs-backend NAME``):
    subclasses of ``portaserve.framework.interfaces.structured_output.StructuredOutputBackend``
    (or "module:Class" strings, imported when chosen). The plan picks the one asked for, or
    the first whose library is installed (xgrammar, then llguidance); the conformance kit
    checks every registered one (contract 1.5)."""
