"""The Triton fused ops as `OpImpl`s, for GPU platforms to return from `portaserve_custom_ops`.

Each is named by a "module:function" string, so listing them imports no triton; the
plan imports one only when it binds it. Signatures: `framework.interfaces.ops`.
"""

from __future__ import annotations

from portaserve.framework.interfaces.ops import OpImpl

_FUNCTIONS = {
    "rms_norm": "portaserve.kernels.rms_norm:rms_norm",
    "fused_add_rms_norm": "portaserve.kernels.rms_norm:fused_add_rms_norm",
    "silu_and_mul": "portaserve.kernels.activation:silu_and_mul",
    "rotary_embedding": "portaserve.kernels.rotary:rotary_embedding",
    "apply_token_bitmask": "portaserve.kernels.token_bitmask:apply_token_bitmask",
    "lora_linear": "portaserve.kernels.lora:lora_linear",
}


def triton_ops(platforms: frozenset[str], priority: int = 0) -> list[OpImpl]:
    """One OpImpl ("triton", needing the "triton" feature) per fused op.

    :param platforms: the platforms to declare them for: a platform plugin with the
        "triton" feature passes its own name.
    """
    return [
        OpImpl(op=op, name="triton", platforms=frozenset(platforms), fn=fn, required_features=frozenset({"triton"}), priority=priority)
        for op, fn in _FUNCTIONS.items()
    ]
