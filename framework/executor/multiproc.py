"""`MultiprocExecutor`: one spawned worker process per tensor-parallel rank.

The driver (the engine core) sends each step's SchedulerOutput to every worker over a
pipe, as a typed message (worker_messages.py; never pickle), and waits for all of them
(rank 0's reply carries the output); ranks talk to each other only through the
platform's Communicator. A worker that dies, or raises, fails the
engine with its rank and error within one poll interval; nothing hangs.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

from portaserve.framework.engine.startup import EngineSpec
from portaserve.framework.errors import EngineDeadError
from portaserve.framework.wire import WireError

from .executor import MultiRankExecutor
from .worker_messages import call_bytes, error_bytes, read_call, read_reply, recv, reply_bytes

logger = logging.getLogger("portaserve")

# How often a waiting driver checks that every worker is still alive (seconds).
POLL_INTERVAL_S = 1.0
# After a first failure, how long the other ranks get to report theirs (seconds).
FAILURE_GRACE_S = 2.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _worker_main(spec: EngineSpec, rank: int, world_size: int, local_rank: int, init_method: str, conn: Connection) -> None:
    """Worker process: build the Worker, then answer typed calls (worker_messages.py)
    until told to stop. A malformed call gets an error reply; nothing else runs."""
    from .worker import Worker, WorkerRank

    try:
        worker = Worker(spec, WorkerRank(rank, world_size, local_rank, init_method))
        worker.load_model()
        conn.send_bytes(reply_bytes(None))
    except BaseException as exc:
        conn.send_bytes(error_bytes(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    while True:
        try:
            data = recv(conn)
        except EOFError:
            break
        try:
            method, args = read_call(data)
        except WireError as exc:
            conn.send_bytes(error_bytes(f"refused a call: {exc}"))
            continue
        if method == "shutdown":
            worker.shutdown()
            conn.send_bytes(reply_bytes(None))
            break
        try:
            conn.send_bytes(reply_bytes(getattr(worker, method)(*args)))
        except BaseException as exc:
            conn.send_bytes(error_bytes(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class MultiprocExecutor(MultiRankExecutor):
    """Tensor parallelism over `tensor_parallel_size` local worker processes."""

    def __init__(self, spec: EngineSpec, master_addr: str = "127.0.0.1", master_port: int | None = None) -> None:
        super().__init__(spec)
        config = spec.config
        self.world_size = config.tensor_parallel_size
        remote = None
        num_local = self.world_size
        if config.nnodes > 1:
            # Ranks on other hosts (see multinode.py): they connect to this driver and
            # are served like local workers, with no local process (procs[r] is None).
            from .multinode import RemoteRanks, master_port as cluster_port, ranks_per_node

            master_addr, master_port = config.master_addr, cluster_port(config)
            num_local = ranks_per_node(config)
            remote = RemoteRanks(config)
        init_method = f"tcp://{master_addr}:{master_port or free_port(master_addr)}"
        ctx = multiprocessing.get_context("spawn")
        self.procs: list[multiprocessing.process.BaseProcess | None] = []
        self.conns: list[Connection] = []
        self._dead: str | None = None
        for rank in range(num_local):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(spec, rank, self.world_size, rank, init_method, child),
                name=f"portaserve-worker-{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        try:
            if remote is not None:
                conns = remote.connect(spec, init_method, self.check_health)
                for rank in range(num_local, self.world_size):
                    self.procs.append(None)
                    self.conns.append(conns[rank])
            self._collect("load_model")  # every worker built its model
        except BaseException:
            self.shutdown()
            raise

    def _collect(self, method: str) -> list[Any]:
        """Wait for one reply per worker, failing fast if any worker dies or errors.

        When a rank dies, its peers usually fail too (their collective loses a member),
        and their error may arrive first; so after the first failure the others get a
        short grace period, and a rank that died is reported as the cause before ranks
        that merely raised.
        """
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        died: dict[int, str] = {}
        raised: dict[int, str] = {}
        deadline: float | None = None
        while pending:
            if died or (deadline is not None and time.monotonic() >= deadline):
                break
            timeout = POLL_INTERVAL_S if deadline is None else max(0.0, deadline - time.monotonic())
            sentinels = [self.procs[r].sentinel for r in pending if self.procs[r] is not None]
            ready = wait([self.conns[r] for r in pending] + sentinels, timeout)
            for r in list(pending):
                conn, proc = self.conns[r], self.procs[r]
                if conn in ready or conn.poll():
                    pending.discard(r)
                    try:
                        ok, value = read_reply(recv(conn), method)
                    except WireError as exc:
                        raised[r] = f"an unreadable reply: {exc}"
                        continue
                    except (EOFError, OSError):
                        if proc is None:
                            died[r] = "the connection to this rank on another node closed (the worker died?)"
                        else:
                            proc.join(0.5)
                            died[r] = f"worker exited (code {proc.exitcode})"
                        continue
                    if not ok:
                        raised[r] = value
                    else:
                        results[r] = value
                elif proc is not None and (proc.sentinel in ready or not proc.is_alive()):
                    pending.discard(r)
                    proc.join(0.5)  # the exit code is known once the process is reaped
                    died[r] = f"worker process died (exit code {proc.exitcode})"
            if (died or raised) and deadline is None:
                deadline = time.monotonic() + FAILURE_GRACE_S
        if died or raised:
            rank, why = min(died.items()) if died else min(raised.items())
            others = sorted((set(died) | set(raised)) - {rank})
            if others:
                why = f"{why} (ranks {others} failed too)"
            self._fail(rank, why)
        return results

    def _fail(self, rank: int, why: str) -> None:
        self._dead = f"tensor-parallel rank {rank} failed: {why}"
        logger.error("%s", self._dead)
        raise EngineDeadError(self._dead)

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        data = call_bytes(method, args)  # encoded once for every rank
        for r, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, OSError):
                proc = self.procs[r]
                self._fail(r, f"worker is gone (exit code {proc.exitcode if proc is not None else 'unknown, remote'})")
        return self._collect(method)

    def check_health(self) -> None:
        for r, proc in enumerate(self.procs):
            if proc is not None and not proc.is_alive():
                self._fail(r, f"worker process died (exit code {proc.exitcode})")

    def shutdown(self) -> None:
        goodbye = call_bytes("shutdown", ())
        for conn, proc in zip(self.conns, self.procs):
            if proc is None or proc.is_alive():
                try:
                    conn.send_bytes(goodbye)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self.procs:
            if proc is None:
                continue
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        for conn in self.conns:
            conn.close()
        self.conns = []
        self.procs = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None and p.pid is not None] or [os.getpid()]
