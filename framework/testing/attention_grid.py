"""The attention cases the kit runs for one backend on one platform, from what both declare.

What is tested is what the platform will serve: dtypes in `caps.dtypes` ∩ the backend's,
block sizes in `caps.block_sizes` ∩ the backend's `supported_block_sizes`, KV dtypes in
`caps.kv_cache_dtypes` ∩ the backend's, and the backend's declared head sizes (a
representative set when it declares none). A full cross product would grow with every
declared size, so the grid is sampled; for each dtype:

- every scenario of `attention_checks.default_cases` (GQA ratios, ordering, padding,
  sliding windows, soft cap, long decodes, equal prompts, shared prefixes, encoder) at
  the platform's default block size and one primary head size;
- one mixed prefill/decode case per other declared block size, and one per other head
  size, each with a GQA configuration rotated through `HEAD_CONFIGS`;
- per KV dtype other than "auto" (fp8): a mixed case, long decodes and a shared prefix.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from portaserve.framework.interfaces import AttentionBackend, PlatformCapabilities
from portaserve.framework.testing.attention_checks import HEAD_CONFIGS, AttentionCase, mixed_steps, default_cases

#: Head sizes tested for a backend that accepts any (`supported_head_sizes = None`): the
#: common ones (64, 128), one that is not a power of two (80) and a large one (256).
REPRESENTATIVE_HEAD_SIZES = (64, 80, 128, 256)
#: Dtype order when the platform states no preference.
DTYPE_ORDER = (torch.bfloat16, torch.float16, torch.float32)


def tested_dtypes(backend_cls: type[AttentionBackend], caps: PlatformCapabilities) -> list[torch.dtype]:
    """Activation dtypes both declare, the platform's preferred first."""
    order = list(caps.preferred_dtypes) + [d for d in DTYPE_ORDER if d not in caps.preferred_dtypes]
    return [d for d in order if d in caps.dtypes and d in backend_cls.supported_dtypes]


def tested_block_sizes(backend_cls: type[AttentionBackend], caps: PlatformCapabilities) -> list[int]:
    """Block sizes both declare, the platform's default first."""
    common = sorted(set(caps.block_sizes) & set(backend_cls.supported_block_sizes))
    if caps.default_block_size in common:
        common.remove(caps.default_block_size)
        common.insert(0, caps.default_block_size)
    return common


def tested_head_sizes(backend_cls: type[AttentionBackend]) -> list[int]:
    """The declared head sizes (else the representative ones), the primary one first."""
    sizes = sorted(backend_cls.supported_head_sizes) if backend_cls.supported_head_sizes else list(REPRESENTATIVE_HEAD_SIZES)
    primary = next((s for s in (64, 128) if s in sizes), sizes[0])
    return [primary] + [s for s in sizes if s != primary]


def tested_kv_dtypes(backend_cls: type[AttentionBackend], caps: PlatformCapabilities) -> list[str]:
    """KV-cache dtypes both declare, besides "auto"."""
    return sorted((set(caps.kv_cache_dtypes) & set(backend_cls.supported_kv_cache_dtypes)) - {"auto"})


def no_case_reason(backend_cls: type[AttentionBackend], caps: PlatformCapabilities) -> str | None:
    """Why no case can run for this backend on this platform, or None."""
    missing = set(backend_cls.required_features) - set(caps.features)
    if missing:
        return f"backend {backend_cls.name} needs platform features {sorted(missing)}"
    if not tested_dtypes(backend_cls, caps):
        return f"backend {backend_cls.name} supports none of the platform's dtypes"
    if not tested_block_sizes(backend_cls, caps):
        return (f"backend {backend_cls.name} supports none of the platform's block sizes "
                f"{sorted(caps.block_sizes)} (it supports {sorted(backend_cls.supported_block_sizes)})")
    return None


def platform_cases(backend_cls: type[AttentionBackend], caps: PlatformCapabilities) -> list[AttentionCase]:
    """The sampled grid (module docstring); empty when `no_case_reason` says why."""
    if no_case_reason(backend_cls, caps) is not None:
        return []
    block_sizes = tested_block_sizes(backend_cls, caps)
    head_sizes = tested_head_sizes(backend_cls)
    max_ratio = backend_cls.max_gqa_ratio
    configs = [hc for hc in HEAD_CONFIGS if max_ratio is None or hc[0] // hc[1] <= max_ratio] or [(4, 4)]
    bs, hs = block_sizes[0], head_sizes[0]
    cases: list[AttentionCase] = []
    for di, dtype in enumerate(tested_dtypes(backend_cls, caps)):
        dname = str(dtype).removeprefix("torch.")
        cases.extend(default_cases(backend_cls, dtype, head_sizes=(hs,), block_sizes=(bs,)))
        # Rotating the GQA configuration (offset by dtype) covers more pairs at no cost.
        for i, other_bs in enumerate(block_sizes[1:]):
            h, hkv = configs[(i + di) % len(configs)]
            cases.append(AttentionCase(f"block-size{other_bs}-{dname}-d{hs}-h{h}kv{hkv}", h, hkv, hs, other_bs, dtype,
                                       mixed_steps(other_bs), seed=20 + i))
        for i, other_hs in enumerate(head_sizes[1:]):
            h, hkv = configs[(i + di + 1) % len(configs)]
            cases.append(AttentionCase(f"head-size{other_hs}-{dname}-bs{bs}-h{h}kv{hkv}", h, hkv, other_hs, bs, dtype,
                                       mixed_steps(bs), seed=40 + i))
        for kv in tested_kv_dtypes(backend_cls, caps):
            base = AttentionCase(f"kv-{kv}-mixed-{dname}", 8, 2, hs, bs, dtype, mixed_steps(bs), seed=60, kv_cache_dtype=kv)
            cases.append(base)
            cases.append(replace(base, name=f"kv-{kv}-decodes-{dname}", steps=((3 * bs + 1, 40, 1, 2 * bs), (1, 1, 1, 1)),
                                 seed=61))
            cases.append(replace(base, name=f"kv-{kv}-shared-prefix-{dname}", steps=((2 * bs + 3, 3), (1, 1)),
                                 shared_prefix=(1, 0, 2), seed=62))
    return cases
