"""Conformance: every attention backend that declares the platform under test passes the
attention checks (`attention_checks.default_cases`) on that platform's device.

Run with the kit: ``pytest --pyargs portaserve.framework.testing --platform NAME``.
One test per (backend, case); combinations a backend or the platform does not declare
(dtype, head size, block size, sliding window, encoder, GQA ratio, required features)
are skipped with the reason.
"""

from __future__ import annotations

import pytest
import torch

from portaserve.framework.plugins import get_registry
from portaserve.framework.testing.attention_checks import default_cases, run_case
from portaserve.framework.testing.conftest import selected_platform_name

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def pytest_generate_tests(metafunc):
    if "attention_case" not in metafunc.fixturenames:
        return
    name = selected_platform_name(metafunc.config)
    params = []
    for backend_name, backend_cls in sorted(get_registry().load_all("attention_backends").items()):
        if name not in backend_cls.platforms:
            continue
        for dtype in DTYPES:
            if dtype not in backend_cls.supported_dtypes:
                continue
            for case in default_cases(backend_cls, dtype):
                params.append(pytest.param(backend_name, case, id=f"{backend_name}-{case.name}"))
    if not params:
        params.append(pytest.param(None, None, id="no-attention-backend"))
    metafunc.parametrize(("backend_name", "attention_case"), params)


def test_attention_backend(backend_name, attention_case, platform_name, registry, platform, device):
    if backend_name is None:
        pytest.skip(f"no registered attention backend declares platform {platform_name!r}")
    backend_cls = registry.get("attention_backends", backend_name)
    caps = platform.capabilities()
    if attention_case.dtype not in caps.dtypes:
        pytest.skip(f"platform {platform_name} does not run {attention_case.dtype}")
    missing = set(backend_cls.required_features) - set(caps.features)
    if missing:
        pytest.skip(f"backend {backend_name} needs platform features {sorted(missing)}")
    result = run_case(backend_cls, attention_case, device)
    if result.skipped:
        pytest.skip(f"{backend_name}: {result.skipped}")
