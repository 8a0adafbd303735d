"""Fails at import time, as a plugin whose vendor library is missing does."""

PORTASERVE_CONTRACT = "1.0"

raise ImportError("libbrokenvendor.so.1: cannot open shared object file (portaserve-broken-plugin is broken on purpose)")
