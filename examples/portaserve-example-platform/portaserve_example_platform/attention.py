"""The example device reuses portaserve's CPU paged attention, declared for its own platform.

A real vendor plugin would put its kernels here; subclassing shows that a backend's
platform list is all that ties it to a device.
"""

from portaserve.platforms.cpu.attention import CpuPagedAttentionBackend


class ExamplePagedAttentionBackend(CpuPagedAttentionBackend):
    name = "example_paged"
    platforms = frozenset({"example"})
