"""Conformance: every op implementation (`OpImpl`, hook ``portaserve_custom_ops``) that
declares the platform under test matches its op's torch reference on the spec's sample
inputs, in each dtype the platform runs (:mod:`.op_checks`); and every op the
platform's plugin declares (hook ``portaserve_op_specs``) has a reference that runs on
the device.

An implementation needing features the platform does not declare here gets one skipped
test with the reason (it is never bound on this machine). Ops without an implementation
for the platform run their reference in the engine: nothing to compare.
"""

from __future__ import annotations

import pytest
import torch

from portaserve.framework.testing.attention_grid import DTYPE_ORDER
from portaserve.framework.testing.op_checks import compare_op
from portaserve.framework.testing.platform_under_test import resolve


def _dtypes(caps) -> list[torch.dtype]:
    return [d for d in DTYPE_ORDER if d in caps.dtypes]


def _impl_params(put) -> list:
    caps = put.capabilities()
    if caps is None:
        return [pytest.param(None, None, None, id="platform-unavailable")]
    params = []
    for plugin, impl in put.registry.custom_ops:
        if put.name not in impl.platforms:
            continue
        label = f"{impl.op}-{impl.name}"
        missing = set(impl.required_features) - set(caps.features)
        if missing:
            params.append(pytest.param(plugin, impl, f"needs platform features {sorted(missing)}", id=f"{label}-unusable"))
            continue
        for dtype in _dtypes(caps):
            params.append(pytest.param(plugin, impl, dtype, id=f"{label}-{str(dtype).removeprefix('torch.')}"))
    return params or [pytest.param(None, None, f"no op implementation declares platform {put.name!r}", id="no-op-impl")]


def _spec_params(put) -> list:
    caps = put.capabilities()
    if caps is None:
        return [pytest.param(None, None, id="platform-unavailable")]
    own = put.registry.platform_plugin.get(put.name)
    params = [
        pytest.param(op, dtype, id=f"{op}-{str(dtype).removeprefix('torch.')}")
        for op, (plugin, _spec) in sorted(put.registry.op_specs.items())
        if plugin == own
        for dtype in _dtypes(caps)
    ]
    return params or [pytest.param(None, None, id="no-op-spec")]


def pytest_generate_tests(metafunc):
    put = None
    if "op_impl" in metafunc.fixturenames:
        put = resolve(metafunc.config)
        metafunc.parametrize(("op_plugin", "op_impl", "op_dtype"), _impl_params(put))
    if "declared_op" in metafunc.fixturenames:
        put = put or resolve(metafunc.config)
        metafunc.parametrize(("declared_op", "op_dtype"), _spec_params(put))


def test_op_impl_matches_reference(op_plugin, op_impl, op_dtype, registry, platform, device):
    if not isinstance(op_dtype, torch.dtype):
        pytest.skip(f"{op_impl.op}:{op_impl.name}: {op_dtype}" if op_impl is not None else op_dtype)
    _plugin, spec = registry.op_specs[op_impl.op]
    fn = op_impl.load()
    problems = compare_op(fn, spec, device, op_dtype)
    assert not problems, f"{op_impl.op}:{op_impl.name} ({op_plugin}) on {device}, {op_dtype}:\n" + "\n".join(problems)


def test_declared_op_reference_runs_on_the_device(declared_op, op_dtype, registry, platform, device):
    if declared_op is None:
        pytest.skip(f"the plugin of {platform.name} declares no op")
    _plugin, spec = registry.op_specs[declared_op]
    reference = spec.load_reference()
    samples = spec.samples(device, op_dtype, torch.Generator().manual_seed(0))
    assert samples, f"{declared_op}: sample_inputs gave no inputs for {op_dtype}"
    for n, args in enumerate(samples):
        out = reference(*args)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for i, t in enumerate(o for o in outs if isinstance(o, torch.Tensor)):
            assert t.device.type == device.type, f"{declared_op} sample {n} output {i} is on {t.device}, not {device}"
            if t.is_floating_point():
                assert bool(torch.isfinite(t).all()), f"{declared_op} sample {n} output {i} is not finite"
