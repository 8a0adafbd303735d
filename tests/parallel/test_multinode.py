"""The multi-host launch without Ray, on one machine: "node 0" (this test process: the
engine and its local ranks) and "node 1" (a separate process tree started like a
headless node on another host) over 127.0.0.1, giving the same greedy tokens as TP=1;
a rank dying on the other node fails the engine promptly with its rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from portaserve import LLM
from portaserve.framework.errors import EngineDeadError

from .util import ENGINE_KW, free_port_pair, generate_ids, greedy, prompts_of

# Multi-process runs: the full suite only.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ARCH = "LlamaForCausalLM"
PROMPTS = prompts_of([6, 35], seed=17)


def _start_node(node_rank: int, nnodes: int, tp: int, port: int, cli: bool = False) -> subprocess.Popen:
    """`python -m portaserve.framework.executor.multinode ...`, or (cli) `portaserve serve --headless ...`."""
    entry = ["portaserve.framework.cli.serve", "--headless"] if cli else ["portaserve.framework.executor.multinode"]
    cmd = [sys.executable, "-m", *entry, "--nnodes", str(nnodes), "--node-rank",
           str(node_rank), "--tensor-parallel-size", str(tp), "--master-addr", "127.0.0.1", "--master-port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PORTASERVE_CLUSTER_KEY": "test-cluster-secret-0123456789"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture()
def cluster_key(monkeypatch):
    monkeypatch.setenv("PORTASERVE_CLUSTER_KEY", "test-cluster-secret-0123456789")


def _stop(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


def test_two_nodes_two_ranks_each_match_tp1(cluster_key, checkpoint, reference_ids):
    port = free_port_pair()
    node1 = _start_node(1, 2, 4, port)  # before node 0, as a real launch may be: it waits
    try:
        llm = LLM(checkpoint(ARCH), tensor_parallel_size=4, nnodes=2, node_rank=0, master_addr="127.0.0.1",
                  master_port=port, **ENGINE_KW)
        try:
            info = llm.llm_engine.core.executor.call_workers("weights_info")
            assert [r["rank"] for r in info] == [0, 1, 2, 3]
            local = set(llm.llm_engine.core.executor.pids)
            assert len(local) == 2 and not local & {r["pid"] for r in info[2:]}  # ranks 2, 3 live on node 1
            assert generate_ids(llm, PROMPTS, 8) == reference_ids(PROMPTS, 8, ARCH)
            llm.update_weights(checkpoint(ARCH, 1))  # every node reads the folder itself
            assert generate_ids(llm, PROMPTS, 8) == reference_ids(PROMPTS, 8, ARCH, 1)
        finally:
            llm.shutdown()
        assert node1.wait(30) == 0, _stop(node1)  # node 1's ranks exit with the engine
    finally:
        if node1.poll() is None:
            node1.kill()


def test_rank_dying_on_another_node_fails_the_engine(cluster_key, checkpoint):
    port = free_port_pair()
    llm_box: dict = {}
    node1 = None

    def start_engine():
        try:
            llm_box["llm"] = LLM(checkpoint(ARCH), tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1",
                                 master_port=port, **ENGINE_KW)
        except BaseException as exc:
            llm_box["error"] = exc

    starter = threading.Thread(target=start_engine, daemon=True)
    starter.start()  # node 0 first this time: it waits for node 1
    time.sleep(1.0)
    node1 = _start_node(1, 2, 2, port, cli=True)
    starter.join(120)
    assert "llm" in llm_box, llm_box.get("error")
    llm = llm_box["llm"]
    try:
        remote_pid = llm.llm_engine.core.executor.call_workers("weights_info")[1]["pid"]
        result: dict = {}

        def run():
            try:
                llm.generate(PROMPTS, greedy(400), use_tqdm=False)
            except BaseException as exc:
                result["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        time.sleep(1.0)
        os.kill(remote_pid, signal.SIGKILL)
        thread.join(15)
        assert not thread.is_alive(), "generate hung after a remote rank died"
        assert isinstance(result.get("error"), EngineDeadError) and "rank 1" in str(result["error"]), result
    finally:
        llm.shutdown()
        node1.kill()
        _stop(node1)


def test_headless_and_node_rank_checks():
    from portaserve.framework.config import EngineConfig
    from portaserve.framework.executor.multinode import node_ranks, run_headless

    config = EngineConfig.create(nnodes=2, node_rank=1, tensor_parallel_size=4, headless=True)
    assert node_ranks(config) == [2, 3] and node_ranks(config, 0) == [0, 1]
    with pytest.raises(ValueError, match="multiple of nnodes"):
        EngineConfig.create(nnodes=2, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="node_rank"):
        run_headless(EngineConfig.create(nnodes=1))


def test_the_control_port_refuses_strangers_and_runs_no_pickle(cluster_key, monkeypatch, tmp_path):
    """Node 0's control listener: a peer without the secret is dropped at the handshake;
    one with it that sends a pickle instead of a Hello gets a malformed message, not code."""
    import pickle
    from multiprocessing.connection import Client

    from portaserve.framework.config import EngineConfig
    from portaserve.framework.executor import multinode
    from portaserve.framework.wire import WireError, handshake

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    port = free_port_pair()
    config = EngineConfig.create(tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=port)
    monkeypatch.setattr(multinode, "CONNECT_TIMEOUT_S", 3.0)
    ranks = multinode.RemoteRanks(config)
    address = multinode.control_address(config)
    stranger = Client(address)
    stranger.send_bytes(pickle.dumps(Exploit()))  # no handshake at all
    with pytest.raises(WireError):
        handshake(Client(address), b"wrong-secret-0123456789", initiator=True, timeout=5)
    insider = Client(address)
    handshake(insider, os.environ["PORTASERVE_CLUSTER_KEY"].encode(), initiator=True, timeout=5)
    insider.send_bytes(pickle.dumps(Exploit()))  # instead of a Hello
    with pytest.raises(EngineDeadError, match="did not connect"):
        ranks.connect(spec=None, init_method="tcp://127.0.0.1:1", local_alive=lambda: None)
    assert not (tmp_path / "pwned").exists()


def test_a_node_with_the_wrong_secret_is_refused(checkpoint, monkeypatch):
    port = free_port_pair()
    monkeypatch.setenv("PORTASERVE_CLUSTER_KEY", "node-zero-secret-0123456789")
    from portaserve.framework.executor import multinode

    monkeypatch.setattr(multinode, "CONNECT_TIMEOUT_S", 8.0)
    cmd = [sys.executable, "-m", "portaserve.framework.executor.multinode", "--nnodes", "2", "--node-rank", "1",
           "--tensor-parallel-size", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PORTASERVE_CLUSTER_KEY": "another-secret-0123456789",
           "PORTASERVE_NODE_CONNECT_TIMEOUT": "8"}
    node1 = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with pytest.raises(EngineDeadError, match="did not connect"):
            LLM(checkpoint(ARCH), tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=port,
                **ENGINE_KW)
        out = _stop(node1)
        assert "does not know the shared secret" in out, out
    finally:
        if node1.poll() is None:
            node1.kill()
