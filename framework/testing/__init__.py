"""portaserve's conformance kit: checks any platform plugin can run against itself.

    pytest --pyargs portaserve.framework.testing --platform NAME [--allow-unavailable] [--allow-single-device]

(The options come from the ``pytest11`` plugin :mod:`.pytest_plugin`, registered by
portaserve's distribution; without ``--platform`` the kit tests ``PORTASERVE_DEVICE``,
else the platform ``--device auto`` selects.) What a platform declares is what is
tested: its block sizes, dtypes, KV dtypes and features, and whatever KV layout,
ops and quant methods it contributes. The checks:

- ``test_probe.py``: the probe has no side effects (environment unchanged), answers with
  a `DeviceInfo` / `Unavailable` for this platform, and repeated calls agree;
- ``test_capabilities.py``: declared capabilities are consistent (the default block
  size is served by a preferred attention backend), and the platform's preferred
  attention backends, default communicator and KV-cache allocator resolve in the
  registry for this platform;
- ``test_communicator.py``: the default communicator's collectives at world size 1 and
  2 (two processes, on one device when `Platform.ranks_share_device`; otherwise they
  need 2 devices, and with fewer the check fails unless ``--allow-single-device``), see
  :mod:`.collectives`;
- ``test_kv_cache.py``: the default KV-cache allocator's block budget, and allocation and
  device -> host -> device round trip of the layouts the platform's attention backends
  declare (`kv_cache_shape`, `kv_cache_block_dim`), see :mod:`.kv_cache_checks`;
- ``test_attention_backends.py``: every attention backend declaring the platform, against
  the torch reference (:mod:`.attention_checks`), over the grid :mod:`.attention_grid`
  samples from the platform's block sizes, dtypes and KV dtypes and the backend's head
  sizes; any declared KV layout, checked through :mod:`.kv_layout`;
- ``test_ops.py``: every `OpImpl` declaring the platform against its `OpSpec`'s torch
  reference on the spec's sample inputs, per dtype (:mod:`.op_checks`), and the
  reference of every op the platform's plugin declares, run on the device;
- ``test_quant_methods.py``: every `QuantMethod` the plan could choose on the platform
  (its own and the generic ones) against `F.linear` on the float weight
  (:mod:`.quant_checks`; `QuantMethod.conformance_weights` / `conformance_tolerance`);
- ``test_platform_models.py``: every model implementation the platform brings for itself
  served by the engine on the platform, against the generic implementation on the host
  platform: greedy tokens and prompt-token logprobs on a tiny checkpoint from the
  architecture's checkpoint writer;
- ``test_graph_capture.py``: the platform's graph recorders (``graph_backends``,
  `Platform.graph_capture`): a recording replays new inputs or is refused, and the engine
  decodes the same greedy tokens with graphs as without.

When the platform is unavailable every device check fails with the probe's reason
(skips with ``--allow-unavailable``): a CI job on the wrong machine is never green. The
run ends with a one-page summary (:mod:`.summary`): the plugin, device, declarations,
contributions and the pass / fail / skip count of each module.

Extending the kit: add a ``test_<topic>.py`` module to this package. ``conftest.py`` here
gives every module the fixtures ``platform_name``, ``registry`` (the loaded plugins),
``platform_cls``, ``platform`` (the instance, chosen as ``--device NAME`` would) and
``device`` (its torch device for local rank 0); a module that builds its parameters
from the platform's declarations gets the platform at collection time from
:func:`.platform_under_test.resolve`. Keep checks generic: never test for a vendor name.
The ``check_*`` / ``run_case`` / ``compare_op`` functions are plain functions, so a
plugin's own tests can run them on components built in the test.
"""
