"""nccl collectives between CUDA ranks (one GPU per rank)."""

from portaserve.framework.distributed import TorchDistributedCommunicator


class NcclCommunicator(TorchDistributedCommunicator):
    name = "nccl"
    platforms = frozenset({"cuda"})
    dist_backend = "nccl"
