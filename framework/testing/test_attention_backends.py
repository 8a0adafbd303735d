"""Conformance: every attention backend that declares the platform under test passes the
attention checks (`attention_checks.default_cases`) on that platform's device.

Run with the kit: ``pytest --pyargs portaserve.framework.testing --platform NAME``.
Standalone (without the kit's ``--platform`` option) it tests the platform that
``PORTASERVE_DEVICE`` names, else the one ``--device auto`` would choose.
"""

from __future__ import annotations

import pytest
import torch

from portaserve.framework.plugins import get_registry
from portaserve.framework.selection import choose_platform
from portaserve.framework.testing.attention_checks import default_cases, run_case

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _platform_name(config) -> str:
    name = None
    try:
        name = config.getoption("--platform", default=None)
    except (ValueError, AttributeError):
        name = None
    if not name:
        choice = choose_platform(get_registry(), None)
        name = choice.platform_cls.name
    return name


def pytest_generate_tests(metafunc):
    if "attention_case" not in metafunc.fixturenames:
        return
    name = _platform_name(metafunc.config)
    registry = get_registry()
    params = []
    for backend_name, backend_cls in sorted(registry.load_all("attention_backends").items()):
        if name not in backend_cls.platforms:
            continue
        for dtype in DTYPES:
            if dtype not in backend_cls.supported_dtypes:
                continue
            for case in default_cases(backend_cls, dtype):
                params.append(pytest.param(name, backend_name, case, id=f"{backend_name}-{case.name}"))
    if not params:
        params.append(pytest.param(name, None, None, id=f"{name}-no-attention-backend"))
    metafunc.parametrize(("platform_name", "backend_name", "attention_case"), params)


@pytest.fixture(scope="module")
def _platforms():
    return {}


def test_attention_backend(platform_name, backend_name, attention_case, _platforms):
    if backend_name is None:
        pytest.skip(f"no registered attention backend declares platform {platform_name!r}")
    platform = _platforms.get(platform_name)
    if platform is None:
        try:
            platform = choose_platform(get_registry(), platform_name).instantiate()
        except Exception as exc:  # unavailable here: a skip, with the probe's reason
            pytest.skip(f"platform {platform_name!r} unavailable: {exc}")
        _platforms[platform_name] = platform
    backend_cls = get_registry().get("attention_backends", backend_name)
    caps = platform.capabilities()
    if attention_case.dtype not in caps.dtypes:
        pytest.skip(f"platform {platform_name} does not run {attention_case.dtype}")
    missing = set(backend_cls.required_features) - set(caps.features)
    if missing:
        pytest.skip(f"backend {backend_name} needs platform features {sorted(missing)}")
    result = run_case(backend_cls, attention_case, platform.torch_device(0))
    if result.skipped:
        pytest.skip(f"{backend_name}: {result.skipped}")
