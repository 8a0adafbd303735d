"""The rocm platform (placeholder until its probe lands)."""

PORTASERVE_CONTRACT = "1.0"
