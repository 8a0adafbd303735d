"""Abstract interfaces a platform plugin implements. See DESIGN.md, "Interfaces"."""

from .attention import AttentionBackend, AttentionBatch, AttentionMetadata, AttentionSpec
from .communicator import Communicator
from .graph_capture import CapturedGraph, GraphCapture, GraphCaptureUnsupported
from .kv_cache import KVCacheAllocator
from .model import ModelArchitecture, ModelBuildContext, ModelStepContext
from .platform import (
    SCORE_ACCELERATOR,
    SCORE_CPU,
    DeviceInfo,
    Platform,
    PlatformCapabilities,
    ProbeResult,
    Unavailable,
)
from .quantization import QuantMethod

__all__ = [
    "AttentionBackend",
    "AttentionBatch",
    "AttentionMetadata",
    "AttentionSpec",
    "CapturedGraph",
    "Communicator",
    "DeviceInfo",
    "GraphCapture",
    "GraphCaptureUnsupported",
    "KVCacheAllocator",
    "ModelArchitecture",
    "ModelBuildContext",
    "ModelStepContext",
    "Platform",
    "PlatformCapabilities",
    "ProbeResult",
    "QuantMethod",
    "SCORE_ACCELERATOR",
    "SCORE_CPU",
    "Unavailable",
]
