"""Parsers by name, through the plugin registry.

The built-in parsers are registered by `portaserve.framework.builtin_components`
exactly as a plugin registers its own (the `portaserve_reasoning_parsers` and
`portaserve_tool_parsers` hooks, name -> class or "module:Class"), so a plugin adds a
parser by implementing the hook; nothing here lists the built-ins.
"""

from __future__ import annotations

from portaserve.framework.errors import invalid
from portaserve.framework.plugins import PluginRegistry, get_registry

from .base import ReasoningParser, ToolParser


def _get(kind: str, base: type, flag: str, name: str, registry: PluginRegistry | None) -> type:
    registry = registry or get_registry()
    known = registry.names(kind)
    if name not in known:
        raise invalid(flag, f"unknown parser {name!r}; registered: {', '.join(known) or 'none'}")
    try:
        cls = registry.get(kind, name)
    except Exception as exc:  # a plugin's lazy import failed
        raise invalid(flag, f"parser {name!r} failed to load: {type(exc).__name__}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise invalid(flag, f"parser {name!r} is {cls!r}, not a {base.__name__} subclass")
    return cls


def get_reasoning_parser(name: str, registry: PluginRegistry | None = None) -> type[ReasoningParser]:
    """The reasoning parser class registered as `name` (``--reasoning-parser``)."""
    return _get("reasoning_parsers", ReasoningParser, "reasoning_parser", name, registry)


def get_tool_parser(name: str, registry: PluginRegistry | None = None) -> type[ToolParser]:
    """The tool-call parser class registered as `name` (``--tool-call-parser``)."""
    return _get("tool_parsers", ToolParser, "tool_call_parser", name, registry)


def reasoning_parser_names(registry: PluginRegistry | None = None) -> list[str]:
    return (registry or get_registry()).names("reasoning_parsers")


def tool_parser_names(registry: PluginRegistry | None = None) -> list[str]:
    return (registry or get_registry()).names("tool_parsers")
