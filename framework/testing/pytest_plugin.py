"""The pytest plugin (entry point group ``pytest11``) that gives the conformance kit its options.

It is loaded in every pytest session where portaserve is installed, so it only adds the
options: no import of torch or of portaserve's plugins happens here. Disable it with
``-p no:portaserve``.
"""

from __future__ import annotations


def pytest_addoption(parser) -> None:
    group = parser.getgroup("portaserve", "portaserve conformance kit")
    group.addoption(
        "--platform",
        default=None,
        metavar="NAME",
        help="platform the conformance kit (pytest --pyargs portaserve.framework.testing) checks; "
        "default: PORTASERVE_DEVICE, else the one --device auto selects",
    )
    group.addoption(
        "--allow-unavailable",
        action="store_true",
        default=False,
        help="conformance kit: skip the device checks when the platform's probe says it is unavailable "
        "here (default: they fail, so a CI job on the wrong machine is never green)",
    )
    group.addoption(
        "--allow-single-device",
        action="store_true",
        default=False,
        help="conformance kit: skip the world-size-2 collectives when the platform needs one device "
        "per rank and this machine has one (default: that check fails)",
    )
