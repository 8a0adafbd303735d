"""portaserve-example-platform: the hook implementations portaserve loads.

portaserve imports this module because pyproject.toml names it in the
``portaserve.platforms`` entry-point group. Keep it cheap: the classes live in
submodules, imported when a hook is called (the platform) or when a component is
first used (the ``"module:Class"`` strings).

From portaserve it imports only the public contract: ``portaserve.framework.hookspecs``,
``portaserve.framework.interfaces`` and ``portaserve.framework.errors``
(``ci/check_example_imports.py`` checks it).
"""

from portaserve.framework.hookspecs import hookimpl

# The hook contract this plugin was written against (1.1: `Platform.ranks_share_device`,
# `PlatformCapabilities.block_sizes`); portaserve skips it, and says why, when its own
# contract is incompatible.
PORTASERVE_CONTRACT = "1.1"


@hookimpl
def portaserve_platform():
    from .platform import ExamplePlatform

    return ExamplePlatform


@hookimpl
def portaserve_communicators():
    return {"example_gloo": "portaserve_example_platform.communicator:ExampleGlooCommunicator"}


@hookimpl
def portaserve_kv_cache_allocators():
    return {"example": "portaserve_example_platform.kv_cache:ExampleKVCacheAllocator"}


@hookimpl
def portaserve_attention_backends():
    return {"example_paged": "portaserve_example_platform.attention:ExamplePagedAttentionBackend"}
