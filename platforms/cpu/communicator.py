"""gloo collectives between CPU ranks."""

from portaserve.framework.distributed import TorchDistributedCommunicator


class GlooCommunicator(TorchDistributedCommunicator):
    name = "gloo"
    platforms = frozenset({"cpu"})
    dist_backend = "gloo"
