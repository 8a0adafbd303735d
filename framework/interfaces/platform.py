"""The `Platform` interface: what a hardware plugin must provide.

A platform is a class, not an instance, until it is chosen: `probe()` must be cheap and
free of side effects (no device context, no environment writes, vendor SDKs imported
inside the probe only), so `portaserve platforms` can ask every installed plugin.
Once chosen, the engine instantiates it with the `DeviceInfo` its probe returned.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from .graph_capture import GraphCapture

# Scores used by the in-tree platforms; a plugin may pick any integer. The highest
# available score wins `--device auto`; equal top scores are an error.
SCORE_CPU = 0
SCORE_ACCELERATOR = 100


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """What a successful probe found."""

    platform: str
    device_name: str
    device_count: int
    total_memory_bytes: int  # per device
    score: int
    reason: str
    capability: str | None = None  # "9.0" (CUDA), "gfx942" (ROCm), "v5e" (TPU), ...
    extra: Mapping[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        gib = self.total_memory_bytes / 2**30
        cap = f", capability {self.capability}" if self.capability else ""
        return f"{self.device_count} x {self.device_name} ({gib:.1f} GiB{cap})"


@dataclass(frozen=True, slots=True)
class Unavailable:
    """A probe's negative answer; `reason` must say what is missing in a user's words."""

    platform: str
    reason: str


ProbeResult = DeviceInfo | Unavailable


@dataclass(frozen=True, slots=True)
class PlatformCapabilities:
    """What a platform can run, consulted when the ExecutionPlan is resolved.

    `features` are free-form capability names that components require, e.g.
    "fp8_matmul", "int8_matmul", "triton". Components declare what they need; the core
    never compares vendor names or SM numbers.
    """

    dtypes: frozenset[torch.dtype]
    kv_cache_dtypes: frozenset[str]
    features: frozenset[str] = frozenset()
    #: compilation mode ("default", "max") -> the backend that implements it ("inductor", ...)
    compile_backends: Mapping[str, str] = field(default_factory=dict)
    #: The mode used when the user asks for none: whatever was measured faster here.
    default_compilation_mode: str = "none"
    #: The `compile_backends` values that are graph recorders (`Platform.graph_capture`
    #: returns one for them), not torch.compile backends: nothing is traced under them,
    #: so the plan keeps components that cannot be traced (contract 1.3).
    graph_backends: frozenset[str] = frozenset()
    #: The scheduler's cap on prompt tokens in a step that also carries decodes, used by
    #: `portaserve serve` (max_prefill_tokens_with_decodes="auto"): where prefill is slow
    #: per token, a large prompt chunk stalls every stream that is decoding. Set it from a
    #: `bench serve` measurement on the device; None: no cap (prefill is cheap here).
    serving_prefill_cap: int | None = None
    #: KV-cache block sizes (tokens per block) this platform serves. `--block-size` must be
    #: one of them; the plan also needs an attention backend that supports the size.
    block_sizes: frozenset[int] = frozenset({16})
    #: The block size used when the user sets none (a member of `block_sizes`).
    default_block_size: int = 16
    #: Dtypes in this platform's order of preference: `--dtype auto` takes the checkpoint's
    #: dtype when the platform supports it, else the first of these. Empty: bfloat16,
    #: float16, float32, whichever `dtypes` has first.
    preferred_dtypes: tuple[torch.dtype, ...] = ()

    def __post_init__(self) -> None:
        if self.default_block_size not in self.block_sizes:
            raise ValueError(
                f"default_block_size {self.default_block_size} is not one of block_sizes {sorted(self.block_sizes)}"
            )
        stray = [d for d in self.preferred_dtypes if d not in self.dtypes]
        if stray:
            raise ValueError(f"preferred_dtypes {stray} are not in dtypes")


class Platform(ABC):
    """A kind of device: identity, probe, device queries and component preferences."""

    #: Registry name, used by `--device NAME`.
    name: ClassVar[str]
    #: torch device type string: "cpu", "cuda", "xpu", "xla", ...
    device_type: ClassVar[str]
    #: torch.distributed backend name: "gloo", "nccl", "xccl", ...
    dist_backend: ClassVar[str]
    #: True when several ranks may compute on one device (a host CPU): tensor parallelism
    #: then needs no more devices than one, and the conformance kit runs its 2-process
    #: collectives on this machine's single device. False: one device per local rank.
    ranks_share_device: ClassVar[bool] = False
    #: The Ray resource one tensor-parallel rank reserves under
    #: `--distributed-executor-backend ray` (a name Ray schedules by: "GPU", "TPU", ...;
    #: Ray then shows the rank's actor only the device it was given). None: a "CPU".
    ray_resource: ClassVar[str | None] = None

    def __init__(self, info: DeviceInfo) -> None:
        if info.platform != self.name:
            raise ValueError(f"DeviceInfo is for {info.platform!r}, not {self.name!r}")
        self.info = info

    # ----- detection -------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def probe(cls) -> ProbeResult:
        """Report whether this platform's device is usable here, without side effects.

        :returns: `DeviceInfo` (with a score and the reason it is usable) or
            `Unavailable` with the reason it is not. Must not raise for an ordinary
            absence (missing SDK, no device); raising is reported as a plugin error.
        """

    # ----- capabilities ----------------------------------------------------------------

    @abstractmethod
    def capabilities(self) -> PlatformCapabilities:
        """Dtypes, KV-cache dtypes, feature names and compile backends this device supports."""

    def preferred_attention_backends(self) -> tuple[str, ...]:
        """Attention backend names in order of preference; unlisted candidates come after."""
        return ()

    def default_communicator(self) -> str:
        """Name of the communicator used for tensor parallelism on this platform."""
        return self.dist_backend

    def default_kv_cache_allocator(self) -> str:
        """Name of the KV-cache allocator used on this platform."""
        return self.name

    def graph_capture(self, compile_backend: str, local_rank: int = 0) -> GraphCapture | None:
        """The graph recorder that `compile_backend` (one of `capabilities().compile_backends`'
        values) names on this platform, or None when it names a torch.compile backend.

        A device that can record a step's kernels and replay them without Python (CUDA
        graphs) declares a backend name for that in `compile_backends` and returns its
        recorder for that name here; the engine then replays pure-decode steps from
        recordings (`GraphCapture`) and runs every other step eagerly. The default: None,
        every compile backend is handed to `torch.compile`.
        """
        return None

    # ----- device queries --------------------------------------------------------------

    def device_count(self) -> int:
        """Number of devices of this kind visible to the process."""
        return self.info.device_count

    def torch_device(self, local_rank: int = 0) -> torch.device:
        """The torch device a worker with this local rank computes on."""
        self._check_rank(local_rank)
        return self._torch_device(local_rank)

    def memory_info(self, local_rank: int = 0) -> tuple[int, int]:
        """(free bytes, total bytes) of the device used by this local rank."""
        self._check_rank(local_rank)
        return self._memory_info(local_rank)

    def init_worker(self, local_rank: int) -> None:
        """Prepare the current process to compute on `local_rank`'s device (set device, threads)."""
        self._check_rank(local_rank)
        self._init_worker(local_rank)

    def synchronize(self, local_rank: int = 0) -> None:
        """Wait for queued work on the device to finish (a no-op on synchronous devices)."""

    def compute_units(self, local_rank: int = 0) -> int | None:
        """How many compute units (SMs, CUs, Xe-cores) the device of `local_rank` has, by
        which kernels size their grids (`framework.device_properties`); None (the
        default) when the device has no such notion."""
        return None

    def kv_cache_budget_bytes(self, requested_gib: float | None, local_rank: int = 0) -> int:
        """Bytes to give the KV cache: the request if given, else the platform's default.

        :param requested_gib: the user's `--kv-cache-memory`, or None.
        """
        if requested_gib is not None:
            if requested_gib <= 0:
                from portaserve.framework.errors import invalid

                raise invalid("kv_cache_memory", f"must be > 0 GiB, got {requested_gib}")
            return int(requested_gib * 2**30)
        return self._default_kv_cache_bytes(local_rank)

    # ----- what implementations override ----------------------------------------------

    @abstractmethod
    def _torch_device(self, local_rank: int) -> torch.device: ...

    @abstractmethod
    def _memory_info(self, local_rank: int) -> tuple[int, int]: ...

    def _init_worker(self, local_rank: int) -> None:
        pass

    def _default_kv_cache_bytes(self, local_rank: int) -> int:
        free, _total = self._memory_info(local_rank)
        return int(free * 0.5)

    def _check_rank(self, local_rank: int) -> None:
        if self.ranks_share_device:
            if local_rank < 0:
                raise ValueError(f"local_rank must be >= 0, got {local_rank}")
            return
        if not 0 <= local_rank < max(1, self.device_count()):
            raise ValueError(
                f"local_rank {local_rank} is out of range for {self.device_count()} "
                f"{self.name} device(s)"
            )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.info.describe()}>"
