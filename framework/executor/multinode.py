"""Tensor parallelism across hosts without Ray: the torch.distributed launch.

Every node runs `tensor_parallel_size / nnodes` ranks; node n holds global ranks
`[n * per_node, (n + 1) * per_node)`. Node 0 runs the engine core (scheduler, driver) and
the server, with its ranks as local worker processes; every other node runs only its
ranks, headless (`portaserve serve --headless --node-rank N ...`, or
`python -m portaserve.framework.executor.multinode ...`).

Two channels, both opened at node 0's `--master-addr`:

- the model's collectives: every rank joins the Communicator's process group at
  `tcp://master_addr:master_port` (gloo, nccl, ... — the platform's choice);
- control: each remote rank connects to node 0's driver at `master_port + 1` (an
  authenticated `multiprocessing.connection`), says which rank it is, receives the
  driver's EngineSpec (the ExecutionPlan is never re-resolved on another node) and then
  answers the same (method, args) calls — each step's SchedulerOutput — that local
  workers get over their pipes.

Control goes over sockets rather than a CPU process group because the driver must never
block in a collective: it waits on every rank's connection and every local process at
once, so a rank that dies on any node (its socket closes) fails the engine with the
rank within a poll interval. The connections are authenticated with
`PORTASERVE_CLUSTER_KEY` (set the same value on every node; a fixed default is used when
unset, which only suits trusted networks), and the model folder must exist at the same
path on every node.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from portaserve.framework.errors import EngineDeadError

logger = logging.getLogger("portaserve")

DEFAULT_MASTER_PORT = 29500
#: How long node 0 waits for the other nodes' ranks to connect, and they for node 0 (seconds).
CONNECT_TIMEOUT_S = float(os.environ.get("PORTASERVE_NODE_CONNECT_TIMEOUT", "600"))
_DEFAULT_KEY = b"portaserve-cluster"


def cluster_key() -> bytes:
    """The shared secret the control connections authenticate with."""
    value = os.environ.get("PORTASERVE_CLUSTER_KEY", "")
    return value.encode() if value else _DEFAULT_KEY


def master_port(config: Any) -> int:
    return int(config.master_port or DEFAULT_MASTER_PORT)


def control_address(config: Any) -> tuple[str, int]:
    """Where node 0's driver listens for the other nodes' ranks."""
    return config.master_addr, master_port(config) + 1


def ranks_per_node(config: Any) -> int:
    return config.tensor_parallel_size // config.nnodes


def node_ranks(config: Any, node_rank: int | None = None) -> list[int]:
    """The global ranks node `node_rank` (default: this node) runs."""
    per_node = ranks_per_node(config)
    node = config.node_rank if node_rank is None else node_rank
    return list(range(node * per_node, (node + 1) * per_node))


# ----- node 0: the driver's side -------------------------------------------------------------


class RemoteRanks:
    """Node 0's listener for the ranks of the other nodes."""

    def __init__(self, config: Any) -> None:
        self.config = config
        host, port = control_address(config)
        self.listener = Listener((host, port), authkey=cluster_key())
        self.expected = [r for node in range(1, config.nnodes) for r in node_ranks(config, node)]
        self._accepted: queue.Queue = queue.Queue()
        threading.Thread(target=self._accept, name="portaserve-node-accept", daemon=True).start()
        logger.info("waiting for ranks %s of %d other node(s) at %s:%d", self.expected, config.nnodes - 1, host, port)

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except OSError:  # closed: every rank has arrived, or startup failed
                return
            except Exception as exc:  # a wrong cluster key, a port scanner: keep listening
                logger.warning("refused a control connection: %s: %s", type(exc).__name__, exc)
                continue
            self._accepted.put(conn)

    def connect(self, spec: Any, init_method: str, local_alive) -> dict[int, Connection]:
        """Wait until every remote rank has connected, and send each its EngineSpec.

        :param local_alive: raises when a local worker has died meanwhile.
        """
        remote: dict[int, Connection] = {}
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        try:
            while len(remote) < len(self.expected):
                local_alive()
                try:
                    conn = self._accepted.get(timeout=1.0)
                except queue.Empty:
                    if time.monotonic() > deadline:
                        missing = [r for r in self.expected if r not in remote]
                        raise EngineDeadError(
                            f"ranks {missing} did not connect within {CONNECT_TIMEOUT_S:.0f}s: start the other nodes "
                            f"with `portaserve serve --headless --nnodes {self.config.nnodes} --node-rank N "
                            f"--tensor-parallel-size {self.config.tensor_parallel_size} --master-addr "
                            f"{self.config.master_addr} --master-port {master_port(self.config)}`"
                        ) from None
                    continue
                if not conn.poll(30):
                    conn.close()
                    continue
                hello = conn.recv()
                rank = hello[1] if isinstance(hello, tuple) and len(hello) == 3 and hello[0] == "hello" else None
                if rank not in self.expected or rank in remote:
                    why = f"rank {rank!r} is not expected (expected {self.expected}, connected {sorted(remote)})"
                    conn.send(("reject", why))
                    conn.close()
                    logger.warning("refused a node: %s", why)
                    continue
                conn.send(("init", spec, self.config.tensor_parallel_size, init_method))
                remote[rank] = conn
                logger.info("rank %d connected from %s", rank, hello[2])
        finally:
            self.listener.close()
        return remote


# ----- the other nodes: headless workers -------------------------------------------------------


def remote_worker_main(address: tuple[str, int], key: bytes, rank: int, local_rank: int) -> None:
    """Process entry point of one rank on a headless node: reach the driver, get the spec,
    then serve calls exactly like a local worker."""
    from .multiproc import _worker_main

    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            conn = Client(address, authkey=key)
            break
        except (ConnectionRefusedError, ConnectionResetError, OSError):
            if time.monotonic() > deadline:
                raise SystemExit(f"rank {rank}: node 0's driver at {address[0]}:{address[1]} did not answer "
                                 f"within {CONNECT_TIMEOUT_S:.0f}s")
            time.sleep(0.5)
    conn.send(("hello", rank, socket.gethostname()))
    msg = conn.recv()
    if msg[0] != "init":
        raise SystemExit(f"rank {rank}: node 0 refused this rank: {msg[1]}")
    _, spec, world_size, init_method = msg
    _worker_main(spec, rank, world_size, local_rank, init_method, conn)


def run_headless(config: Any) -> int:
    """Run this node's ranks until node 0's engine stops; returns the worst exit code."""
    import multiprocessing

    if config.nnodes < 2 or config.node_rank < 1:
        from portaserve.framework.errors import invalid

        raise invalid("node_rank", f"headless workers are for node_rank >= 1 of nnodes >= 2 (got node_rank "
                      f"{config.node_rank} of {config.nnodes})")
    ctx = multiprocessing.get_context("spawn")
    address, key = control_address(config), cluster_key()
    procs = []
    for local_rank, rank in enumerate(node_ranks(config)):
        proc = ctx.Process(target=remote_worker_main, args=(address, key, rank, local_rank),
                           name=f"portaserve-worker-{rank}")
        proc.start()
        procs.append(proc)
    logger.info("node %d of %d: ranks %s, driver at %s:%d", config.node_rank, config.nnodes, node_ranks(config),
                *address)
    try:
        for proc in procs:
            proc.join()
    except KeyboardInterrupt:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.join(10)
        return 130
    codes = [proc.exitcode or 0 for proc in procs]
    return max(codes, key=abs)


def main(argv: list[str] | None = None) -> int:
    """`python -m portaserve.framework.executor.multinode --nnodes 2 --node-rank 1 ...`"""
    import argparse

    from portaserve.framework.config import EngineConfig

    p = argparse.ArgumentParser(description="run one node's tensor-parallel ranks (headless)")
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--node-rank", type=int, required=True)
    p.add_argument("--tensor-parallel-size", type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    config = EngineConfig.create(nnodes=args.nnodes, node_rank=args.node_rank, headless=True,
                                 tensor_parallel_size=args.tensor_parallel_size, master_addr=args.master_addr,
                                 master_port=args.master_port)
    return run_headless(config)


if __name__ == "__main__":
    raise SystemExit(main())
