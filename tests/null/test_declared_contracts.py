"""What used to be vendor tests inside the framework, now declared by platforms: the Ray
resource, the compute units kernels size grids by, graph capture, and the weight-update
group a communicator builds. A platform written against 1.0 (none of these declared)
gets defaults that keep it working."""

from __future__ import annotations

import socket

import torch

from portaserve.framework import device_properties
from portaserve.framework.distributed import StandaloneGroupCommunicator
from portaserve.framework.executor.ray_executor import bundle_for
from portaserve.framework.interfaces import Communicator, DeviceInfo, Platform, PlatformCapabilities


class OldPlatform(Platform):
    """A 1.0 platform: declares nothing of the above."""

    name = "old"
    device_type = "cpu"
    dist_backend = "gloo"

    @classmethod
    def probe(cls):
        return DeviceInfo(cls.name, "fake", 1, 2**30, -5, "always")

    def capabilities(self):
        return PlatformCapabilities(dtypes=frozenset({torch.float32}), kv_cache_dtypes=frozenset({"auto"}))

    def _torch_device(self, local_rank):
        return torch.device("cpu")

    def _memory_info(self, local_rank):
        return 2**30, 2**30


class UnitsPlatform(OldPlatform):
    name = "units"
    ray_resource = "NPU"

    def _torch_device(self, local_rank):
        return torch.device("meta", local_rank)

    def compute_units(self, local_rank=0):
        return 33


def test_a_10_platform_gets_the_defaults():
    platform = OldPlatform(OldPlatform.probe())
    assert platform.graph_capture("inductor") is None
    assert platform.compute_units() is None
    assert bundle_for(OldPlatform) == {"CPU": 1.0}


def test_ray_resources_are_declared_by_the_platforms():
    from portaserve.platforms.cpu.platform import CpuPlatform
    from portaserve.platforms.cuda.platform import CudaPlatform
    from portaserve.platforms.rocm.platform import RocmPlatform
    from portaserve.platforms.tpu.platform import TpuPlatform
    from portaserve.platforms.xpu.platform import XpuPlatform

    assert bundle_for(CpuPlatform) == {"CPU": 1.0}
    assert bundle_for(CudaPlatform) == bundle_for(RocmPlatform) == bundle_for(XpuPlatform) == {"GPU": 1.0}
    assert bundle_for(TpuPlatform) == {"TPU": 1.0}
    assert bundle_for(UnitsPlatform) == {"NPU": 1.0}


def test_kernels_size_grids_by_the_published_compute_units():
    from portaserve.kernels.triton_backend import INTERPRETER_TARGET_PROGRAMS, PROGRAMS_PER_UNIT, target_programs

    platform = UnitsPlatform(DeviceInfo("units", "fake", 2, 2**30, -5, "always"))
    device = platform.torch_device(1)
    assert target_programs(device) == INTERPRETER_TARGET_PROGRAMS  # nothing published yet
    device_properties.publish(platform, 1)
    assert device_properties.compute_units(device) == 33
    assert target_programs(device) == PROGRAMS_PER_UNIT * 33
    # a platform without compute units publishes nothing
    device_properties.publish(OldPlatform(OldPlatform.probe()), 0)
    assert device_properties.compute_units(torch.device("cpu")) is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_default_weight_update_group_is_a_standalone_gloo_group():
    class OldComm(Communicator):
        """A 1.0 communicator: no weight-update group of its own."""

        name = "old_comm"
        platforms = frozenset({"old"})

        def _all_reduce(self, tensor, op): ...
        def _all_gather(self, tensor, dim): ...
        def _reduce_scatter(self, tensor, dim): ...
        def _broadcast(self, tensor, src): ...
        def _send(self, tensor, dst): ...
        def _recv(self, tensor, src): ...
        def _barrier(self): ...

    port = _free_port()
    for _ in range(2):  # destroy() releases the group's name: the same address works again
        comm = OldComm.weight_update_group(0, 1, torch.device("cpu"), "127.0.0.1", port, timeout_s=30)
        assert isinstance(comm, StandaloneGroupCommunicator) and comm.group is not None
        assert comm.all_reduce(torch.ones(2), op="max").tolist() == [1.0, 1.0]
        comm.destroy()
        assert comm.group is None
