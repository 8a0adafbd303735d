"""rccl collectives between ROCm ranks: torch's HIP build serves rccl under the "nccl" backend name."""

from portaserve.framework.distributed import TorchDistributedCommunicator


class RcclCommunicator(TorchDistributedCommunicator):
    name = "rccl"
    platforms = frozenset({"rocm"})
    dist_backend = "nccl"
