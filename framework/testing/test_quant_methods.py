"""Conformance: every quant method the plan could choose on the platform under test
computes the linear layer it stands for (:mod:`.quant_checks`).

Checked: each registered `QuantMethod` that runs on the platform, that is whose
`platforms` is None (the framework's generic methods, or another plugin's) or names the
platform (its own variants, like a repacked-weight "none"), in every dtype the
platform and the method both accept. The generic ones are included on purpose: what
they compute on a device depends on what the platform declares (features that pick a
kernel), so the platform answers for it. A method whose `unsupported_reason` rejects
the platform's features or a dtype gets one skipped test with the reasons; a
pre-quantized checkpoint format without `conformance_weights` skips with that reason.
"""

from __future__ import annotations

import pytest

from portaserve.framework.testing.attention_grid import DTYPE_ORDER
from portaserve.framework.testing.platform_under_test import resolve
from portaserve.framework.testing.quant_checks import check_quant_method


def _params(put) -> list:
    caps = put.capabilities()
    if caps is None:
        return [pytest.param(None, None, id="platform-unavailable")]
    params = []
    features = frozenset(caps.features)
    for name, cls in sorted(put.registry.load_all("quant_methods").items()):
        if cls.platforms is not None and put.name not in cls.platforms:
            continue
        unusable = []
        for dtype in DTYPE_ORDER:
            if dtype not in caps.dtypes:
                continue
            dname = str(dtype).removeprefix("torch.")
            why = cls.unsupported_reason(features, dtype, {})
            if why is None:
                params.append(pytest.param(name, dtype, id=f"{name}-{dname}"))
            else:
                unusable.append(f"{dname}: {why}")
        if unusable:
            params.append(pytest.param(name, "; ".join(unusable), id=f"{name}-unsupported"))
    return params or [pytest.param(None, "no quant method runs here", id="no-quant-method")]


def pytest_generate_tests(metafunc):
    if "quant_method" in metafunc.fixturenames:
        metafunc.parametrize(("quant_method", "act_dtype"), _params(resolve(metafunc.config)))


def test_quant_method_matches_float_linear(quant_method, act_dtype, registry, platform, device):
    if isinstance(act_dtype, str):
        pytest.skip(f"{quant_method}: not run in {act_dtype}" if quant_method else act_dtype)
    cls = registry.get("quant_methods", quant_method)
    not_checkable = check_quant_method(cls, device, act_dtype, frozenset(platform.capabilities().features))
    if not_checkable:
        pytest.skip(not_checkable)
