"""Fixtures of the conformance kit, shared by every check module in this package, and the
one-page summary printed at the end of a kit run (:mod:`.summary`)."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from portaserve.framework.testing.platform_under_test import option, resolve, resolved

#: module file name -> outcome -> count, filled as reports arrive (one kit run per process)
_OUTCOMES: dict[str, Counter] = defaultdict(Counter)


def pytest_runtest_logreport(report) -> None:
    module = report.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    if report.when == "call" or (report.when == "setup" and not report.passed):
        outcome = "error" if report.when == "setup" and report.failed else report.outcome
        _OUTCOMES[module][outcome] += 1
    elif report.when == "teardown" and report.failed:
        _OUTCOMES[module]["error"] += 1


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    put = resolved(config)
    if put is None:  # no kit module ran (a run that only collected elsewhere)
        return
    from portaserve.framework.testing.summary import summary_lines

    terminalreporter.write_sep("=", "portaserve conformance kit")
    for line in summary_lines(put, _OUTCOMES, allow_unavailable=bool(option(config, "--allow-unavailable"))):
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def platform_name(request) -> str:
    return resolve(request.config).name


@pytest.fixture(scope="session")
def registry(request):
    """The process-wide plugin registry (lenient: other plugins' failures are not this one's)."""
    return resolve(request.config).registry


@pytest.fixture(scope="session")
def platform_cls(request):
    put = resolve(request.config)
    if put.cls is None:
        pytest.fail(put.problem, pytrace=False)
    return put.cls


@pytest.fixture(scope="session")
def platform(request, platform_cls):
    """The platform instance, chosen as `--device NAME` would.

    Where the device is unavailable the test fails (skips with --allow-unavailable).
    """
    return resolve(request.config).require(request.config)


@pytest.fixture(scope="session")
def device(platform):
    """The torch device of local rank 0."""
    return platform.torch_device(0)
