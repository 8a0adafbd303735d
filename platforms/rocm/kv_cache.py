"""KV cache in AMD GPU memory: torch's HIP build allocates through the same torch.cuda API."""

from portaserve.platforms.cuda.kv_cache import CudaKVCacheAllocator


class RocmKVCacheAllocator(CudaKVCacheAllocator):
    name = "rocm"
    platforms = frozenset({"rocm"})
