"""The vendor-free core: hook contract, plugin loading, interfaces, configuration, engine,
executor and server. Nothing here imports a vendor SDK, `portaserve.platforms` or
`portaserve.models` (ci/check_imports.py enforces it)."""
