"""portaserve's conformance kit: checks any platform plugin can run against itself.

    pytest --pyargs portaserve.framework.testing --platform NAME

(``--platform`` comes from the ``pytest11`` plugin :mod:`.pytest_plugin`, registered by
portaserve's distribution; without it the kit tests ``PORTASERVE_DEVICE``, else the
platform ``--device auto`` selects.) The checks:

- ``test_probe.py``: the probe has no side effects (environment unchanged), answers with
  a `DeviceInfo` / `Unavailable` for this platform, and repeated calls agree;
- ``test_capabilities.py``: declared capabilities are consistent, and the platform's
  preferred attention backends, default communicator and KV-cache allocator resolve in
  the registry for this platform;
- ``test_communicator.py``: the default communicator's collectives at world size 1 and
  2 (two processes; a platform whose devices are not shared by ranks needs 2 devices,
  else the check skips with that reason), see :mod:`.collectives`;
- ``test_kv_cache.py``: the default KV-cache allocator's block budget, allocation shapes
  and dtypes, and the device -> host -> device round trip of blocks;
- ``test_attention_backends.py``: every attention backend declaring the platform, against
  the torch reference (:mod:`.attention_checks`).

Extending the kit: add a ``test_<topic>.py`` module to this package. ``conftest.py`` here
gives every module the fixtures ``platform_name``, ``registry`` (the loaded plugins),
``platform_cls``, ``platform`` (the instance, chosen with ``--device NAME``; tests skip
with the probe's reason when the device is unavailable) and ``device`` (its torch
device for local rank 0). Keep checks generic: never test for a vendor name.
"""
