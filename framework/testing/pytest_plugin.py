"""The pytest plugin (entry point group ``pytest11``) that gives the conformance kit its option.

It is loaded in every pytest session where portaserve is installed, so it only adds the
option: no import of torch or of portaserve's plugins happens here. Disable it with
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
