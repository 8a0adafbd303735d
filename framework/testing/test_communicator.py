"""Conformance: the platform's default communicator computes every collective correctly,
in one process (world size 1) and across two spawned processes (world size 2)."""

from __future__ import annotations

import pytest

from portaserve.framework.interfaces import Communicator
from portaserve.framework.testing.collectives import check_collectives, run_world


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


def test_world_size_2(comm_cls, platform, platform_name):
    try:
        platform.torch_device(1)
    except ValueError:
        pytest.skip(f"world size 2 needs 2 {platform_name} devices; this machine has {platform.device_count()}")
    results = run_world(platform_name, 2)
    problems = [f"rank {r}: {f}" for r, fails in sorted(results.items()) for f in fails]
    assert not problems, "\n".join(problems)
