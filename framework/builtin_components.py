"""The framework's own components (pure torch), registered like any plugin's."""

from __future__ import annotations

from .hookspecs import hookimpl

PORTASERVE_CONTRACT = "1.0"


@hookimpl
def portaserve_quant_methods():
    return {"none": "portaserve.framework.unquantized:UnquantizedMethod"}
