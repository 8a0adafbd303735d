"""Communicator checks: every collective of the interface against values computed locally.

Each rank's inputs are a known function of its rank, so every rank can compute what
every collective must return without communicating. `check_collectives` runs them on a
built communicator and returns the failures; `run_world` starts `world_size` processes
(spawned, as portaserve's executors start workers) that each build the platform's
default communicator through the plugin registry and run the checks.

Communicator classes are built as ``cls(rank, world_size, device, init_method=URL)``,
the convention of `TorchDistributedCommunicator`; the rendezvous is a ``file://`` store
in a temporary directory, so no port is needed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from collections.abc import Callable

import torch


def rank_tensor(rank: int, shape: tuple[int, ...], device: torch.device, dtype=torch.float32) -> torch.Tensor:
    """A tensor whose values identify the rank and the element: rank * 100 + index + 1."""
    numel = 1
    for s in shape:
        numel *= s
    return (torch.arange(numel, dtype=torch.float64).reshape(shape) + 1 + 100 * rank).to(dtype).to(device)


def _close(name: str, got: torch.Tensor, want: torch.Tensor, failures: list[str]) -> None:
    got = got.detach().to("cpu", torch.float64)
    want = want.to(torch.float64)
    if got.shape != want.shape:
        failures.append(f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    elif not torch.allclose(got, want, rtol=1e-6, atol=1e-6):
        worst = (got - want).abs().max().item()
        failures.append(f"{name}: values differ from the reference by up to {worst:g}")


def check_collectives(comm, rank: int, world_size: int, device: torch.device) -> list[str]:
    """Run every collective of `comm` (this rank's side); returns what was wrong."""
    failures: list[str] = []
    shape = (4, 6)
    ranks = [rank_tensor(r, shape, torch.device("cpu"), torch.float64) for r in range(world_size)]
    stacked = torch.stack(ranks)

    def attempt(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:
            failures.append(f"{name} raised {type(exc).__name__}: {exc}")

    def all_reduce(op: str, want: torch.Tensor) -> None:
        x = rank_tensor(rank, shape, device)
        out = comm.all_reduce(x, op=op)
        _close(f"all_reduce({op})", out, want, failures)

    attempt("all_reduce(sum)", lambda: all_reduce("sum", stacked.sum(0)))
    attempt("all_reduce(max)", lambda: all_reduce("max", stacked.max(0).values))
    attempt("all_reduce(min)", lambda: all_reduce("min", stacked.min(0).values))
    attempt("all_reduce(product)", lambda: all_reduce("product", stacked.prod(0)))

    def all_gather(dim: int) -> None:
        out = comm.all_gather(rank_tensor(rank, shape, device), dim=dim)
        _close(f"all_gather(dim={dim})", out, torch.cat(ranks, dim=dim), failures)

    attempt("all_gather(dim=0)", lambda: all_gather(0))
    attempt("all_gather(dim=-1)", lambda: all_gather(-1))

    def reduce_scatter(dim: int) -> None:
        big = (2 * world_size, 3 * world_size)
        x = rank_tensor(rank, big, device)
        full = torch.stack([rank_tensor(r, big, torch.device("cpu"), torch.float64) for r in range(world_size)]).sum(0)
        want = full.chunk(world_size, dim=dim)[rank]
        _close(f"reduce_scatter(dim={dim})", comm.reduce_scatter(x, dim=dim), want, failures)

    attempt("reduce_scatter(dim=0)", lambda: reduce_scatter(0))
    attempt("reduce_scatter(dim=1)", lambda: reduce_scatter(1))

    def broadcast(src: int) -> None:
        x = rank_tensor(rank, shape, device)
        out = comm.broadcast(x, src=src)
        _close(f"broadcast(src={src})", out, ranks[src], failures)
        _close(f"broadcast(src={src}) in place", x, ranks[src], failures)

    for src in range(world_size):
        attempt(f"broadcast(src={src})", lambda src=src: broadcast(src))

    def ring() -> None:
        # Each rank sends to the next and receives from the previous; even ranks send
        # first so that blocking point-to-point calls cannot deadlock.
        nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
        out = torch.zeros(shape, device=device)
        mine = rank_tensor(rank, shape, device)
        if rank % 2 == 0:
            comm.send(mine, nxt)
            comm.recv(out, prev)
        else:
            comm.recv(out, prev)
            comm.send(mine, nxt)
        _close(f"send/recv from rank {prev}", out, ranks[prev], failures)

    if world_size > 1:
        attempt("send/recv", ring)
    attempt("barrier", comm.barrier)

    for name, call in (
        ("all_reduce(op='mean')", lambda: comm.all_reduce(rank_tensor(rank, shape, device), op="mean")),
        ("broadcast(src=world_size)", lambda: comm.broadcast(rank_tensor(rank, shape, device), src=world_size)),
    ):
        try:
            call()
            failures.append(f"{name} did not raise ValueError")
        except ValueError:
            pass
        except Exception as exc:
            failures.append(f"{name} raised {type(exc).__name__}, not ValueError")
    return failures


def _rank_main(platform_name: str, rank: int, world_size: int, init_method: str, results) -> None:
    """One rank's process: registry -> platform -> default communicator -> checks."""
    try:
        torch.set_num_threads(1)
        from portaserve.framework.plugins import get_registry
        from portaserve.framework.selection import choose_platform

        registry = get_registry()
        platform = choose_platform(registry, platform_name, strict=False).instantiate()
        platform.init_worker(rank)
        device = platform.torch_device(rank)
        comm_cls = registry.get("communicators", platform.default_communicator())
        comm = comm_cls(rank, world_size, device, init_method=init_method)
        try:
            failures = check_collectives(comm, rank, world_size, device)
        finally:
            comm.destroy()
        results.put((rank, failures))
    except BaseException:
        results.put((rank, [f"rank {rank} crashed:\n{traceback.format_exc()}"]))


def run_world(platform_name: str, world_size: int, timeout_s: float = 180.0) -> dict[int, list[str]]:
    """Run the checks on `world_size` spawned ranks; returns each rank's failures."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="portaserve-kit-") as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_rank_main, args=(platform_name, r, world_size, init_method, results), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, list[str]] = {}
        try:
            for _ in range(world_size):
                rank, failures = results.get(timeout=timeout_s)
                out[rank] = failures
        except Exception:  # queue.Empty: a rank hung or died without reporting
            for r in range(world_size):
                out.setdefault(r, [f"rank {r} reported nothing within {timeout_s:.0f} s (hang or crash)"])
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        return out
