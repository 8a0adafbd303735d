"""Collectives for the example device: torch.distributed's gloo, which runs on host tensors."""

from portaserve.framework.distributed import TorchDistributedCommunicator


class ExampleGlooCommunicator(TorchDistributedCommunicator):
    name = "example_gloo"
    platforms = frozenset({"example"})
    dist_backend = "gloo"
