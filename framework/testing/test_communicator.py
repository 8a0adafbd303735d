"""Conformance: the platform's default communicator computes every collective correctly,
in one process (world size 1) and across two spawned processes (world size 2: on one
device when the platform's ranks share it, else on two; with one device that check
fails unless --allow-single-device)."""

from __future__ import annotations

import pytest

from portaserve.framework.interfaces import Communicator
from portaserve.framework.testing.collectives import check_collectives, run_world
from portaserve.framework.testing.platform_under_test import option


@pytest.fixture(scope="module")
def comm_cls(registry, platform):
    return registry.get("communicators", platform.default_communicator())


def test_communicator_class(comm_cls, platform):
    assert issubclass(comm_cls, Communicator)
    assert platform.name in comm_cls.platforms


def test_world_size_1(comm_cls, platform, device):
    comm = comm_cls(0, 1, device)
    try:
        failures = check_collectives(comm, 0, 1, device)
    finally:
        comm.destroy()
    assert not failures, "\n".join(failures)


def test_rank_out_of_range_is_rejected(comm_cls, device):
    with pytest.raises(ValueError):
        comm_cls(1, 1, device)


def test_world_size_2(comm_cls, platform, platform_name, request):
    # Ranks sharing one device (Platform.ranks_share_device) run here on any machine;
    # otherwise each rank needs its own device, and a machine with one cannot certify
    # the collectives: that fails unless the vendor opts out explicitly.
    if not platform.ranks_share_device and platform.device_count() < 2:
        message = (f"world size 2 needs 2 {platform_name} devices (one per rank: ranks_share_device is False); "
                   f"this machine has {platform.device_count()}. Run the kit on a machine with 2 devices, or pass "
                   "--allow-single-device to skip this check")
        if option(request.config, "--allow-single-device"):
            pytest.skip(message)
        pytest.fail(message, pytrace=False)
    results = run_world(platform_name, 2)
    problems = [f"rank {r}: {f}" for r, fails in sorted(results.items()) for f in fails]
    assert not problems, "\n".join(problems)
