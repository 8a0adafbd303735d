"""portaserve: an LLM inference and serving engine whose hardware support is a plugin system.

`import portaserve` stays cheap (plugins import `portaserve.framework.interfaces` without
pulling in the engine); the user-facing names below load on first use.
"""

__version__ = "0.1.0"

_LAZY = {
    "LLM": "portaserve.framework.engine.llm",
    "SamplingParams": "portaserve.framework.engine.params",
    "PoolingParams": "portaserve.framework.engine.params",
    "RequestOutput": "portaserve.framework.engine.outputs",
    "CompletionOutput": "portaserve.framework.engine.outputs",
    "EmbeddingRequestOutput": "portaserve.framework.engine.outputs",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'portaserve' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value
