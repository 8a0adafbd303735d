"""Model architectures (one file per family), their layers, and test-checkpoint writers.

Registered through the `portaserve.plugins` entry point like any plugin's architectures.
"""

PORTASERVE_CONTRACT = "1.0"
