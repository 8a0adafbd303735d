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

Changing a hook's signature or meaning bumps the major version; adding a hook bumps the
minor version.
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
    from portaserve.framework.interfaces.ops import OpImpl

PROJECT_NAME = "portaserve"
#: The contract version of this portaserve: (major, minor).
CONTRACT_VERSION = (1, 0)

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
def portaserve_custom_ops() -> "Sequence[OpImpl]":
    """Return fused op implementations (RMSNorm, SiLU-and-mul, rotary, ...) for layers.

    See :mod:`portaserve.framework.interfaces.ops` for the op names and signatures.
    """


@hookspec
def portaserve_reasoning_parsers() -> "Mapping[str, type | str]":
    """Return reasoning parsers by name (``--reasoning-parser NAME``)."""


@hookspec
def portaserve_tool_parsers() -> "Mapping[str, type | str]":
    """Return tool-call parsers by name (``--tool-call-parser NAME``)."""
