"""Conformance: every registered structured-outputs backend (contract 1.5) constrains
tokens correctly on a real vocabulary (see structured_checks.py). A backend whose
library is not installed is skipped with its reason."""

from __future__ import annotations

import pytest

from portaserve.framework.testing.structured_checks import CASES, INVALID, check_invalid, check_walk


def _backends(registry):
    return [(name, registry.get("structured_output_backends", name)) for name in registry.names("structured_output_backends")]


@pytest.mark.timeout(300)
def test_structured_output_backends(registry):
    backends = _backends(registry)
    if not backends:
        pytest.skip("no structured-outputs backend is registered")
    unavailable = []
    for name, cls in backends:
        reason = cls.unavailable_reason()
        if reason is not None:
            unavailable.append(f"{name}: {reason}")
            continue
        for constraint, text, refused in CASES:
            check_walk(cls, constraint, text, refused)
        for constraint in INVALID:
            check_invalid(cls, constraint)
    if len(unavailable) == len(backends):
        pytest.skip("; ".join(unavailable))
