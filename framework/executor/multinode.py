"""Tensor parallelism across hosts without Ray: the torch.distributed launch.

Every node runs `tensor_parallel_size / nnodes` ranks; node n holds global ranks
`[n * per_node, (n + 1) * per_node)`. Node 0 runs the engine core (scheduler, driver) and
the server, with its ranks as local worker processes; every other node runs only its
ranks, headless (`portaserve serve --headless --node-rank N ...`, or
`python -m portaserve.framework.executor.multinode ...`).

Two channels, both opened at node 0's `--master-addr`:

- the model's collectives: every rank joins the Communicator's process group at
  `tcp://master_addr:master_port` (gloo, nccl, ... — the platform's choice);
- control: each remote rank connects to node 0's driver at `master_port + 1`; both
  sides prove they know `PORTASERVE_CLUSTER_KEY` (an HMAC-SHA256 challenge each way,
  wire.handshake) before either reads a message; the rank says which it is, receives the
  driver's EngineSpec (the ExecutionPlan is never re-resolved on another node) and then
  answers the same typed calls (worker_messages.py: each step's SchedulerOutput) that
  local workers get over their pipes. Messages are msgspec, never pickle: a forged one
  is at most a malformed message.

Control goes over sockets rather than a CPU process group because the driver must never
block in a collective: it waits on every rank's connection and every local process at
once, so a rank that dies on any node (its socket closes) fails the engine with the
rank within a poll interval. `PORTASERVE_CLUSTER_KEY` must be set, to the same secret,
on every node: without it neither side starts. The listener binds `--master-addr` only.
torch.distributed's own ports (the collectives) are not authenticated: keep the nodes
on a private network. The model folder must exist at the same path on every node.
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
from portaserve.framework.wire import WireError, decode, encode, handshake

from .worker_messages import Handshake, Hello, Init, Reject, recv

logger = logging.getLogger("portaserve")

DEFAULT_MASTER_PORT = 29500
#: How long node 0 waits for the other nodes' ranks to connect, and they for node 0 (seconds).
CONNECT_TIMEOUT_S = float(os.environ.get("PORTASERVE_NODE_CONNECT_TIMEOUT", "600"))
#: Shortest shared secret accepted (bytes).
MIN_KEY_BYTES = 16


def cluster_key() -> bytes:
    """The shared secret the control connections authenticate with (PORTASERVE_CLUSTER_KEY).

    :raises InvalidParameterError: it is unset or too short: there is no default.
    """
    from portaserve.framework.errors import invalid

    value = os.environ.get("PORTASERVE_CLUSTER_KEY", "").encode()
    if len(value) < MIN_KEY_BYTES:
        raise invalid(
            "PORTASERVE_CLUSTER_KEY",
            f"multi-node runs need a shared secret of at least {MIN_KEY_BYTES} bytes in PORTASERVE_CLUSTER_KEY, the same "
            f"on every node ({'unset' if not value else f'got {len(value)} bytes'}); for example "
            "`export PORTASERVE_CLUSTER_KEY=$(python -c 'import secrets; print(secrets.token_hex(32))')`",
        )
    return value


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
        self.key = cluster_key()
        self.listener = Listener((host, port))  # authenticated by wire.handshake, per connection
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
            # each connection proves the key in its own thread: a silent or slow peer
            # (a port scanner) cannot hold up the ranks behind it
            threading.Thread(target=self._authenticate, args=(conn,), daemon=True).start()

    def _authenticate(self, conn: Connection) -> None:
        try:
            handshake(conn, self.key, initiator=False)
        except (WireError, OSError, EOFError) as exc:
            logger.warning("refused a control connection: %s", exc)
            conn.close()
            return
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
                try:
                    hello = decode(recv(conn), Hello)
                except (WireError, OSError, EOFError) as exc:
                    logger.warning("refused a node: %s", exc)
                    conn.close()
                    continue
                if hello.rank not in self.expected or hello.rank in remote:
                    why = f"rank {hello.rank!r} is not expected (expected {self.expected}, connected {sorted(remote)})"
                    conn.send_bytes(encode(Reject(why)))
                    conn.close()
                    logger.warning("refused a node: %s", why)
                    continue
                conn.send_bytes(encode(Init(spec, self.config.tensor_parallel_size, init_method)))
                remote[hello.rank] = conn
                logger.info("rank %d connected from %s", hello.rank, hello.host)
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
            conn = Client(address)
            break
        except (ConnectionRefusedError, ConnectionResetError, OSError):
            if time.monotonic() > deadline:
                raise SystemExit(f"rank {rank}: node 0's driver at {address[0]}:{address[1]} did not answer "
                                 f"within {CONNECT_TIMEOUT_S:.0f}s")
            time.sleep(0.5)
    try:
        handshake(conn, key, initiator=True)
        conn.send_bytes(encode(Hello(rank, socket.gethostname())))
        msg = decode(recv(conn), Handshake)
    except (WireError, OSError, EOFError) as exc:
        raise SystemExit(f"rank {rank}: could not join node 0's driver at {address[0]}:{address[1]}: {exc}") from None
    if isinstance(msg, Reject):
        raise SystemExit(f"rank {rank}: node 0 refused this rank: {msg.reason}")
    if not isinstance(msg, Init):
        raise SystemExit(f"rank {rank}: node 0 sent {type(msg).__name__} instead of Init")
    _worker_main(msg.spec, rank, msg.world_size, local_rank, msg.init_method, conn)


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
