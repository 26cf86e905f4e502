"""One engine's tensor-parallel group over two "nodes": two real `tandem engine` processes on
127.0.0.1, ``--nnodes 2 --tensor-parallel-size 2`` (one rank each), meeting at a TCP store on
``--master-addr:--master-port`` (engine_core/nodes.py). HF's greedy tokens are the oracle (the
same ones TP=1 and single-host TP=2 give in tests/test_tensor_parallel.py); a node lost mid-way
ends the engine, and node 1 does not outlive node 0 by more than --dist-timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import LlamaConfig

from engine_core.config import EngineConfig
from engine_core.parallel import create_store
from protocol.address import EngineAddress, private_ipc_address, remove_ipc_files
from protocol.client import EngineClient
from protocol.messages import SamplingParams
from tests.paged_harness import hf_greedy
from tests.server_fixture import free_port, start_server, stop_server
from tests.test_tensor_parallel import (
    NEW_TOKENS,
    PROMPTS,
    SIZES,
    alive,
    children_running_spawn,
    collect,
    saved_case,
    write_model,
)

# How long node 1 waits for a node 0 that does not come back; it also bounds a spawned rank's
# start (7 s for one, 12 s for three, seen under the full suite's load) and a rejoin after a
# restart (2 s seen), so the restart test uses it too.
DIST_TIMEOUT_S = 20
ENGINE_FLAGS = ["--block-size", "4", "--num-kv-blocks", "96", "--max-model-len", "128",
                "--max-num-batched-tokens", "16", "--max-num-seqs", "16"]  # fmt: skip


def node_command(folder: Path, rank: int, port: int, *extra: str, tp: int = 2) -> list[str]:
    return [sys.executable, "-m", "frontend.cli", "engine", "--model", str(folder),
            "--tensor-parallel-size", str(tp), "--nnodes", "2", "--node-rank", str(rank),
            "--master-addr", "127.0.0.1", "--master-port", str(port),
            "--dist-timeout", str(DIST_TIMEOUT_S), "--log-level", "INFO",
            *ENGINE_FLAGS, *extra]  # fmt: skip


class Node:
    """One node's `tandem engine` process, its log in a file (a pipe nobody reads could fill)."""

    def __init__(self, command: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def two_nodes(
    folder: Path,
    logs: Path,
    node0_extra: tuple[str, ...] = (),
    node1_extra: tuple[str, ...] = (),
    tp: int = 2,
) -> Iterator[tuple[Node, Node, EngineAddress]]:
    """Node 1 first (it waits for node 0, as a pod that starts early does), then node 0."""
    port = free_port()
    address = private_ipc_address()
    node1 = Node(node_command(folder, 1, port, *node1_extra, tp=tp), logs / "node1.log")
    node0 = Node(
        node_command(folder, 0, port, "--address", str(address), *node0_extra, tp=tp),
        logs / "node0.log",
    )
    try:
        yield node0, node1, address
    finally:
        node0.stop()
        node1.stop()
        remove_ipc_files(address)


def wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if alive(p)]}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """The Llama case (tests/test_tensor_parallel.py) saved once for the tests that only read
    it, with HF's greedy tokens for PROMPTS."""
    return saved_case("llama", tmp_path_factory)


@pytest.mark.slow
def test_two_nodes_serve_hf_tokens_and_a_lost_node_ends_the_engine(
    llama: tuple[Path, list[list[int]]], tmp_path: Path
) -> None:
    from engine_core.tp_runner import WORKER_LOST_EXIT_CODE

    folder, reference = llama
    with two_nodes(folder, tmp_path) as (node0, node1, address):
        with EngineClient(address) as client:
            client.connect(timeout=180)
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
            for i, prompt in enumerate(PROMPTS):  # all in flight at once: mixed batches
                client.add_request(f"r{i}", prompt, params)
            got = collect(client, {f"r{i}" for i in range(len(PROMPTS))})
            assert [got[f"r{i}"] for i in range(len(PROMPTS))] == reference
            assert children_running_spawn(node0.proc.pid) == [], "tp 2 over 2 nodes: rank 0 only"
            (rank1,) = children_running_spawn(node1.proc.pid)
            # Mid-serving: requests in flight when node 1's rank dies.
            long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
            for i in range(4):
                client.add_request(f"long{i}", PROMPTS[0], long)
            client.recv(timeout=60)
            os.kill(rank1, signal.SIGKILL)
            assert node0.wait(timeout=60) == WORKER_LOST_EXIT_CODE
        assert "node 1: tensor-parallel worker tandem-tp1 exited with -9" in node0.text()
        # Node 1 waits --dist-timeout for node 0's restart, which does not come, then exits.
        assert node1.wait(timeout=DIST_TIMEOUT_S + 60) == 1
        assert "did not admit this node" in node1.text()


@pytest.mark.slow
def test_two_ranks_on_each_of_two_nodes_serve_hf_tokens(tmp_path: Path) -> None:
    """TP=4 over 2 nodes: node 0 is ranks 0-1 (rank 1 its spawned worker), node 1 ranks 2-3.
    4 KV heads, so each rank holds one."""
    config = LlamaConfig(**(SIZES | {"num_key_value_heads": 4}), tie_word_embeddings=False)
    hf_model = write_model("", tmp_path, config)
    reference = [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in PROMPTS]
    with two_nodes(tmp_path, tmp_path, tp=4) as (node0, node1, address):
        with EngineClient(address) as client:
            client.connect(timeout=240)
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
            for i, prompt in enumerate(PROMPTS):
                client.add_request(f"r{i}", prompt, params)
            got = collect(client, {f"r{i}" for i in range(len(PROMPTS))})
            assert [got[f"r{i}"] for i in range(len(PROMPTS))] == reference
            assert len(children_running_spawn(node0.proc.pid)) == 1
            ranks = children_running_spawn(node1.proc.pid)
            assert len(ranks) == 2
        assert "running ranks [2, 3]" in node1.text()
        # A user's SIGTERM to node 0 stops it for good: node 1 and its ranks exit with it
        # (without the word, node 1 would wait --dist-timeout for a restart).
        node0.proc.terminate()
        assert node0.wait(timeout=60) == 0
        assert node1.wait(timeout=DIST_TIMEOUT_S / 2) == 0
        wait_gone(ranks, timeout=10)
        assert "node 0 stopped its engine for good: node 1 exits" in node1.text()


@pytest.mark.slow
def test_expert_parallel_over_two_nodes_serves_hf_tokens(tmp_path: Path) -> None:
    """--enable-expert-parallel across the nodes: each node's rank holds half the experts."""
    hf_model = write_model("qwen3_moe", tmp_path)
    reference = [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in PROMPTS]
    ep = ("--enable-expert-parallel",)
    with two_nodes(tmp_path, tmp_path, ep, ep) as (_, _, address), EngineClient(address) as client:
        client.connect(timeout=180)
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            client.add_request(f"r{i}", prompt, params)
        got = collect(client, {f"r{i}" for i in range(len(PROMPTS))})
        assert [got[f"r{i}"] for i in range(len(PROMPTS))] == reference


@pytest.mark.slow
def test_a_pipeline_stage_on_each_of_two_nodes_serves_hf_tokens(tmp_path: Path) -> None:
    """--pipeline-parallel-size 2 over 2 nodes, one rank each: node 0 runs stage 0 (layers 0-2
    of 5, the embedding), node 1 stage 1 (layers 3-4, the norm and the head)."""
    config = LlamaConfig(**(SIZES | {"num_hidden_layers": 5}), tie_word_embeddings=False)
    hf_model = write_model("", tmp_path, config)
    reference = [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in PROMPTS]
    pp = ("--pipeline-parallel-size", "2")
    with two_nodes(tmp_path, tmp_path, pp, pp, tp=1) as (node0, node1, address):
        with EngineClient(address) as client:
            client.connect(timeout=180)
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
            for i, prompt in enumerate(PROMPTS):
                client.add_request(f"r{i}", prompt, params)
            got = collect(client, {f"r{i}" for i in range(len(PROMPTS))})
            assert [got[f"r{i}"] for i in range(len(PROMPTS))] == reference
            assert children_running_spawn(node0.proc.pid) == []
        assert "running ranks [1]" in node1.text()


@pytest.mark.slow
def test_node_one_and_its_ranks_exit_when_node_zero_dies(
    llama: tuple[Path, list[list[int]]], tmp_path: Path
) -> None:
    with two_nodes(llama[0], tmp_path) as (node0, node1, address):
        with EngineClient(address) as client:
            client.connect(timeout=180)
            (rank1,) = children_running_spawn(node1.proc.pid)
            node0.proc.kill()
            node0.proc.wait()
        wait_gone([rank1], timeout=30)
        assert node1.wait(timeout=DIST_TIMEOUT_S + 60) == 1


def write_secret(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.mark.slow
def test_a_node_with_another_secret_is_refused_before_any_step(
    llama: tuple[Path, list[list[int]]], tmp_path: Path
) -> None:
    ours = write_secret(tmp_path / "a.secret", "a" * 32)
    theirs = write_secret(tmp_path / "b.secret", "b" * 32)
    with two_nodes(
        llama[0],
        tmp_path,
        ("--dist-secret-file", str(ours)),
        ("--dist-secret-file", str(theirs)),
    ) as (node0, node1, _):
        assert node1.wait(timeout=120) == 2
        assert node0.wait(timeout=60) == 2
        assert "node 1 refused: it does not prove node 0's --dist-secret-file" in node0.text()
        assert "node 0 refused node 1" in node1.text()
        assert "tensor parallel over" not in node0.text(), "no group was formed"


@pytest.mark.slow
def test_nodes_with_different_engine_flags_are_refused(
    llama: tuple[Path, list[list[int]]], tmp_path: Path
) -> None:
    with two_nodes(llama[0], tmp_path, node1_extra=("--max-num-seqs", "8")) as (node0, node1, _):
        assert node1.wait(timeout=120) == 2
        assert node0.wait(timeout=60) == 2
        assert "--max-num-seqs (node 0: 16, node 1: 8)" in node0.text()


@pytest.mark.slow
def test_a_node_rank_given_twice_admits_one_process(
    llama: tuple[Path, list[list[int]]], tmp_path: Path
) -> None:
    """Two processes both say --node-rank 1: node 0 admits one, the other is told why and
    exits, and the engine serves with the one admitted."""
    with two_nodes(llama[0], tmp_path) as (node0, node1, address):
        port = int(node_arg(node1.proc.args, "--master-port"))
        twin = Node(node_command(llama[0], 1, port), tmp_path / "twin.log")
        try:
            with EngineClient(address) as client:
                client.connect(timeout=180)
                params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
                client.add_request("r", PROMPTS[0], params)
                assert len(collect(client, {"r"})["r"]) == 4
            deadline = time.monotonic() + 60
            while all(n.proc.poll() is None for n in (node1, twin)):
                assert time.monotonic() < deadline, "neither twin was refused"
                time.sleep(0.2)
            loser = next(n for n in (node1, twin) if n.proc.poll() is not None)
            assert loser.wait(timeout=1) == 2
            assert "is --node-rank 1 given to two nodes?" in loser.text()
        finally:
            twin.stop()


def node_arg(command: Any, flag: str) -> str:
    command = list(command)
    return command[command.index(flag) + 1]


def test_engine_socket_flags_are_refused_on_a_worker_node(tmp_path: Path) -> None:
    command = node_command(tmp_path, 1, free_port(), "--address", "ipc:///tmp/x/engine")
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--address: node 1 runs no engine sockets" in done.stderr


def test_a_node_that_never_joins_ends_the_start_within_the_timeout(
    llama: tuple[Path, list[list[int]]],
) -> None:
    """Node 0 alone: its engine start fails after --dist-timeout, naming the missing node."""
    address = private_ipc_address()
    command = node_command(llama[0], 0, free_port(), "--address", str(address))
    command[command.index("--dist-timeout") + 1] = "3"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    finally:
        remove_ipc_files(address)
    assert done.returncode == 1
    assert "node(s) [1] of --nnodes 2 did not join within --dist-timeout 3 s" in done.stderr


def test_a_secret_file_others_may_read_is_refused(tmp_path: Path) -> None:
    secret = write_secret(tmp_path / "s", "x" * 32, mode=0o640)
    command = node_command(tmp_path, 1, free_port(), "--dist-secret-file", str(secret))
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--dist-secret-file" in done.stderr and "chmod 600" in done.stderr


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"nnodes": 2, "tensor_parallel_size": 3, "master_addr": "127.0.0.1"},
         "--tensor-parallel-size 3 must be a multiple of --nnodes 2"),
        ({"nnodes": 2, "tensor_parallel_size": 2}, "--nnodes 2 needs --master-addr"),
        ({"nnodes": 2, "tensor_parallel_size": 2, "node_rank": 2, "master_addr": "127.0.0.1"},
         "--node-rank 2 must be in"),
        ({"master_addr": "10.0.0.1"}, "--master-addr: for an engine over several nodes"),
        ({"nnodes": 2, "tensor_parallel_size": 2, "master_addr": "10.0.0.1"},
         "--master-addr 10.0.0.1 is not a loopback address.*--dist-secret-file"),
        ({"nnodes": 2, "tensor_parallel_size": 2, "master_addr": "10.0.0.1",
          "data_parallel_size": 2}, "--data-parallel-size > 1 with --nnodes > 1"),
        ({"nnodes": 2, "tensor_parallel_size": 2, "master_addr": "::1", "master_port": 70000},
         "--master-port 70000"),
    ],
)  # fmt: skip
def test_multi_node_flags_that_do_not_fit_are_refused(fields: dict[str, object], said: str) -> None:
    with pytest.raises(ValueError, match=said):
        EngineConfig(**fields)  # type: ignore[arg-type]


def test_a_non_loopback_address_with_a_secret_is_accepted() -> None:
    config = EngineConfig(
        nnodes=2, tensor_parallel_size=4, master_addr="10.0.0.1", dist_secret_file="/s"
    )
    assert config.nnodes == 2


def test_the_node_flags_are_refused_on_the_command_line_naming_them(tmp_path: Path) -> None:
    command = node_command(tmp_path, 0, free_port())
    command[command.index("--tensor-parallel-size") + 1] = "3"
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--tensor-parallel-size 3 must be a multiple of --nnodes 2" in done.stderr


def listening_addresses(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* write them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if int(hex_port, 16) == port and state == "0A":  # LISTEN
                    found.append(address)
    return found


def test_the_store_listens_on_its_address_only() -> None:
    """TCPStore given a host still listens on every interface; ours is bound to the host."""
    store = create_store(1, "127.0.0.1")
    assert listening_addresses(store.port) == ["0100007F"]  # 127.0.0.1, and nothing else


@pytest.mark.slow
def test_serve_restarts_an_engine_that_lost_a_node_and_the_request_resumes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`tandem serve` on both nodes: node 1's rank is killed mid-stream; node 0's engine core
    exits, the server starts a new one, node 1 rejoins it, and the stream goes on to the same
    text as an undisturbed run (the official client sees one uninterrupted stream)."""
    import openai

    from tests.test_resume import wait_restarted

    port = free_port()
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(port), "--dist-timeout", str(DIST_TIMEOUT_S),
             "--max-model-len", "512",
             "--num-kv-blocks", "128", "--max-num-seqs", "4"]  # fmt: skip
    node1 = Node(
        [sys.executable, "-m", "frontend.cli", "serve", "--model", str(tiny_model_dir),
         "--node-rank", "1", "--log-level", "INFO", *flags],
        tmp_path / "node1.log",
    )  # fmt: skip
    try:
        srv = start_server(tmp_path, model=str(tiny_model_dir), args=[*flags, "--node-rank", "0"])
        try:
            client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused")
            request = {"model": str(tiny_model_dir), "prompt": "Once upon a time",
                       "max_tokens": 120, "temperature": 0,
                       "extra_body": {"ignore_eos": True}}  # fmt: skip
            reference = client.completions.create(**request).choices[0].text
            (rank1,) = children_running_spawn(node1.proc.pid)
            text = ""
            for i, chunk in enumerate(client.completions.create(**request, stream=True)):
                text += chunk.choices[0].text if chunk.choices else ""
                if i == 10:
                    os.kill(rank1, signal.SIGKILL)
            assert text == reference
            wait_restarted(srv, srv.engine_pid)
            assert "node 1: tensor-parallel worker tandem-tp1 exited with -9" in srv.log_tail(10**6)
            assert children_running_spawn(node1.proc.pid) != [rank1], "node 1 rejoined"
            assert client.completions.create(**request).choices[0].text == reference
        finally:
            stop_server(srv)
        # Node 0 stopped for good and said so: node 1 exits with it, well before --dist-timeout.
        assert node1.wait(timeout=DIST_TIMEOUT_S / 2) == 0
        assert "node 0 stopped its engine for good: node 1 exits" in node1.text()
    finally:
        node1.stop()


# ---- two network namespaces: two hosts joined by a veth link ----------------------------------

SUBNET = "10.231.{}.{}"


def can_make_namespaces() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"tandem{os.getpid()}probe"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return made


@contextlib.contextmanager
def two_hosts() -> Iterator[list[tuple[str, str, str]]]:
    """Two network namespaces, each with one end of a veth pair: [(namespace, interface,
    address)] for host 0 and host 1. Neither sees the other's loopback."""
    tag = os.getpid() % 250 + 1
    hosts = [(f"tandem{os.getpid()}h{i}", f"td{os.getpid()}h{i}", SUBNET.format(tag, i + 1))
             for i in range(2)]  # fmt: skip
    commands = [["ip", "link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1]]]
    for namespace, link, address in hosts:
        commands = [["ip", "netns", "add", namespace], *commands]
        commands += [["ip", "link", "set", link, "netns", namespace],
                     ["ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", link],
                     ["ip", "-n", namespace, "link", "set", link, "up"],
                     ["ip", "-n", namespace, "link", "set", "lo", "up"]]  # fmt: skip
    try:
        for command in commands:
            subprocess.run(command, check=True, capture_output=True)
        yield hosts
    finally:
        for namespace, _, _ in hosts:  # the veth pair goes with them
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


@pytest.mark.slow
@pytest.mark.skipif(not can_make_namespaces(), reason="needs root and `ip netns`")
def test_two_hosts_in_network_namespaces_meet_over_a_secret(
    llama: tuple[Path, list[list[int]]], tmp_path: Path
) -> None:
    """Node 0 and node 1 in two network namespaces (two hosts as far as the network goes),
    meeting at node 0's veth address: not loopback, so the secret is required; gloo is told
    each host's interface, as on real hosts whose name does not resolve to it."""
    folder, reference = llama
    secret = write_secret(tmp_path / "dist.secret", "s" * 32)
    address = private_ipc_address()  # a path: reachable from every network namespace
    port = free_port()
    with two_hosts() as hosts:
        master = hosts[0][2]
        nodes = []
        for rank, (namespace, link, _) in reversed(list(enumerate(hosts))):
            command = node_command(folder, rank, port, "--dist-secret-file", str(secret))
            command[command.index("--master-addr") + 1] = master
            if rank == 0:
                command += ["--address", str(address)]
            env = {**os.environ, "GLOO_SOCKET_IFNAME": link}
            log = tmp_path / f"node{rank}.log"
            nodes.append(Node(["ip", "netns", "exec", namespace, *command], log, env))
        node1, node0 = nodes
        try:
            with EngineClient(address) as client:
                client.connect(timeout=180)
                params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
                for i, prompt in enumerate(PROMPTS):
                    client.add_request(f"r{i}", prompt, params)
                got = collect(client, {f"r{i}" for i in range(len(PROMPTS))})
                assert [got[f"r{i}"] for i in range(len(PROMPTS))] == reference
            # The store listens on the veth address only, inside host 0.
            tables = subprocess.run(
                ["ip", "netns", "exec", hosts[0][0], "cat", "/proc/net/tcp"],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            listening = [
                line.split()[1] for line in tables.splitlines()[1:] if line.split()[3] == "0A"
            ]
            hex_master = "".join(f"{int(b):02X}" for b in reversed(master.split(".")))
            assert f"{hex_master}:{port:04X}" in listening
            assert f"00000000:{port:04X}" not in listening
        finally:
            node0.stop()
            node1.stop()
            remove_ipc_files(address)


SIGNALS_SCRIPT = """
import json, os, signal, time, types
from common.processes import STOP_FOR_GOOD
import engine_core.server as server
server.SUPERVISED_SIGTERM_DELAY_S = 0.3
seen = {}
for supervised in (False, True):
    for sig in (signal.SIGTERM, signal.SIGINT, STOP_FOR_GOOD):
        proc = types.SimpleNamespace(running=True, stopped_for_good=False)
        server.stop_on_signals(proc, supervised)
        os.kill(os.getpid(), sig)
        seen[f"{supervised} {sig.name}"] = [proc.running, proc.stopped_for_good]
# The delay's timer is the process's own (SIGALRM): one engine, signalled once more.
proc = types.SimpleNamespace(running=True, stopped_for_good=False)
server.stop_on_signals(proc, True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(1.0)
seen["True SIGTERM, after the delay"] = [proc.running, proc.stopped_for_good]
print(json.dumps(seen))
"""


def test_only_a_stop_no_restart_follows_is_for_good() -> None:
    """`tandem serve` restarts its engine after any exit, so a supervised engine tells its other
    nodes it stops for good only on serve's own STOP_FOR_GOOD; a standalone engine on any stop.
    A supervised engine's SIGTERM stops it only after a delay (serve's drain, when the signal
    went to the whole group). [running, stopped for good] after each signal (its own
    interpreter: handlers are global)."""
    done = subprocess.run([sys.executable, "-c", SIGNALS_SCRIPT], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parents[1])  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "False SIGTERM": [False, True],
        "False SIGINT": [False, True],
        "False SIGUSR1": [False, True],
        "True SIGTERM": [True, False],  # serve's drain first, if it went to the whole group
        "True SIGTERM, after the delay": [False, False],  # an operator's kill: serve restarts it
        "True SIGINT": [True, False],  # Ctrl-C reaches serve too, which stops it for good
        "True SIGUSR1": [False, True],
    }
