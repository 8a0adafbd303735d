"""Loads fine, but its platform's probe raises, as a buggy driver query does."""

import torch

from portaserve.framework.hookspecs import hookimpl
from portaserve.framework.interfaces import Platform, PlatformCapabilities

PORTASERVE_CONTRACT = "1.0"


class BrokenPlatform(Platform):
    name = "broken"
    device_type = "cpu"
    dist_backend = "gloo"

    @classmethod
    def probe(cls):
        raise RuntimeError("broken driver query (portaserve-broken-plugin is broken on purpose)")

    def capabilities(self) -> PlatformCapabilities:
        return PlatformCapabilities(dtypes=frozenset({torch.float32}), kv_cache_dtypes=frozenset({"auto"}))

    def _torch_device(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def _memory_info(self, local_rank: int) -> tuple[int, int]:
        return (0, 0)


@hookimpl
def portaserve_platform():
    return BrokenPlatform
