"""Conformance: every attention backend that declares the platform under test passes the
attention checks (:mod:`.attention_checks`) on that platform's device, over the
platform's own declared block sizes, dtypes and KV dtypes and the backend's head sizes
(:mod:`.attention_grid`), whatever KV layout the backend declares.

Run with the kit: ``pytest --pyargs portaserve.framework.testing --platform NAME``.
One test per (backend, case). A backend that cannot run on the platform at all (missing
features, no common dtype or block size) gets one test: it fails when the platform
prefers that backend, and skips with the reason otherwise. Combinations a backend
declares unsupported (sliding window, encoder, GQA ratio) skip with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from portaserve.framework.testing.attention_checks import AttentionCase, run_case
from portaserve.framework.testing.attention_grid import no_case_reason, platform_cases
from portaserve.framework.testing.platform_under_test import resolve


@dataclass(frozen=True, slots=True)
class NoCase:
    """A placeholder parameter: why there is nothing to run, and whether that is a failure."""

    reason: str
    fail: bool = False


def pytest_generate_tests(metafunc):
    if "attention_case" not in metafunc.fixturenames:
        return
    put = resolve(metafunc.config)
    caps = put.capabilities()
    params = []
    if caps is None:
        # The `platform` fixture reports why (and fails, or skips with --allow-unavailable).
        params.append(pytest.param(None, NoCase("platform unavailable"), id="platform-unavailable"))
    else:
        preferred = put.instance.preferred_attention_backends()
        for backend_name, backend_cls in sorted(put.registry.load_all("attention_backends").items()):
            if not backend_cls.runs_on(put.name):
                continue
            why = no_case_reason(backend_cls, caps)
            if why is not None:
                params.append(pytest.param(backend_name, NoCase(why, fail=backend_name in preferred), id=f"{backend_name}-unusable"))
                continue
            for case in platform_cases(backend_cls, caps):
                params.append(pytest.param(backend_name, case, id=f"{backend_name}-{case.name}"))
        if not params:
            params.append(pytest.param(None, NoCase(f"no registered attention backend declares platform {put.name!r}"),
                                       id="no-attention-backend"))
    metafunc.parametrize(("backend_name", "attention_case"), params)


def test_attention_backend(backend_name, attention_case: AttentionCase | NoCase, platform_name, registry, platform, device):
    if isinstance(attention_case, NoCase):
        if attention_case.fail:
            pytest.fail(f"{attention_case.reason}, yet {platform_name} prefers it", pytrace=False)
        pytest.skip(attention_case.reason)
    backend_cls = registry.get("attention_backends", backend_name)
    result = run_case(backend_cls, attention_case, device)
    if result.skipped:
        pytest.skip(f"{backend_name}: {result.skipped}")
