"""Two torchrun agents (`--nnodes 2`, c10d rendezvous) run one user script and its plans with the
results of one machine: on 127.0.0.1, and on two network namespaces joined by a veth pair,
each agent behind its own address as on two hosts (skipped where the machine refuses them)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
import torch

import meshsplit as ms

from multinode_job import PLANS, main, summary
from reference import ATOL, RTOL

SCRIPT = Path(__file__).with_name("multinode_job.py")
AGENT_TIMEOUT_S = 120
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
TORCHRUN += ["--nproc-per-node", "2", "--rdzv-backend", "c10d"]
BOUNDED = "join_timeout=60,read_timeout=60"  # an agent whose peer never comes gives up


@pytest.fixture(scope="module")
def one_machine() -> dict:
    return summary(ms.launch(main, nprocs=4, timeout_s=60))


@pytest.mark.timeout(200)
def test_two_agents_on_127_0_0_1_match_one_machine(one_machine: dict, tmp_path: Path) -> None:
    out = tmp_path / "two-agents.pt"
    endpoint = f"127.0.0.1:{_free_port()}"
    command = [*TORCHRUN, "--rdzv-endpoint", endpoint, "--rdzv-id", f"loopback-{os.getpid()}"]
    command += ["--rdzv-conf", BOUNDED, str(SCRIPT), str(out)]
    _run_agents([(command, {}), (command, {})], tmp_path)
    two = torch.load(out, weights_only=False)
    assert [place["node"] for place in two["where"]] == [0, 0, 1, 1]  # by rank
    _assert_same_runs(two, one_machine)


@pytest.mark.timeout(200)
def test_two_agents_in_two_network_namespaces_match_one_machine(
    one_machine: dict, tmp_path: Path
) -> None:
    out = tmp_path / "two-hosts.pt"
    with _two_hosts() as hosts:
        # 29400 is free: nothing else listens in a namespace this test has just made
        endpoint = f"{hosts[0].address}:29400"
        agents = []
        for index, host in enumerate(hosts):
            command = ["ip", "netns", "exec", host.namespace, *TORCHRUN]
            command += ["--rdzv-endpoint", endpoint, "--rdzv-id", f"veth-{os.getpid()}"]
            command += ["--rdzv-conf", f"is_host={int(index == 0)},{BOUNDED}"]
            command += ["--local-addr", host.address, str(SCRIPT), str(out)]
            agents.append((command, {"GLOO_SOCKET_IFNAME": host.interface}))
        _run_agents(agents, tmp_path)
    two = torch.load(out, weights_only=False)
    where = two["where"]
    assert [place["node"] for place in where] == [0, 0, 1, 1]  # by rank
    first, second = ({p["net_namespace"] for p in where if p["node"] == node} for node in (0, 1))
    assert len(first) == len(second) == 1 and first != second  # one namespace per agent
    assert os.stat("/proc/self/ns/net").st_ino not in first | second
    _assert_same_runs(two, one_machine)


def _assert_same_runs(two: dict, one: dict) -> None:
    assert [place["rank"] for place in two["where"]] == [0, 1, 2, 3]
    assert list(two["runs"]) == list(one["runs"]) == list(PLANS)
    for name, run in one["runs"].items():
        other = two["runs"][name]
        torch.testing.assert_close(other["losses"], run["losses"], rtol=RTOL, atol=ATOL, msg=name)
        assert list(other["state"]) == list(run["state"])
        for key, value in run["state"].items():
            torch.testing.assert_close(
                other["state"][key], value, rtol=RTOL, atol=ATOL, msg=f"{name}: {key}"
            )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run_agents(agents: list[tuple[list[str], dict[str, str]]], logs: Path) -> None:
    """Start every agent, wait for all of them (bounded), and fail with their logs unless all
    exit 0; whatever is still running at the end is killed, the agents' workers included."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for index, (command, extra) in enumerate(agents):
            log = (logs / f"agent{index}.log").open("wb")
            processes.append(
                subprocess.Popen(
                    command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**env, **extra},
                    start_new_session=True,
                )
            )
            log.close()
        deadline = time.monotonic() + AGENT_TIMEOUT_S
        codes = [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in processes]
    except subprocess.TimeoutExpired:
        codes = [p.poll() for p in processes]
    finally:
        _kill_all(processes)
    if codes != [0] * len(agents):
        tails = [
            (logs / f"agent{i}.log").read_text(errors="replace")[-3000:] for i in range(len(agents))
        ]
        pytest.fail(
            f"agents exited with {codes} (None: still running after "
            f"{AGENT_TIMEOUT_S} s)\n" + "\n---\n".join(tails)
        )


def _kill_all(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL these processes and every descendant (torchrun puts its workers in sessions of
    their own, so the agent's process group does not hold them)."""
    running = [p for p in processes if p.poll() is None]
    for process in running:
        with suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGSTOP)  # no new workers while the tree is read
    tree = [d for p in running for d in _descendants(p.pid)] + [p.pid for p in running]
    for pid in tree:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for process in processes:
        process.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.05)  # the orphaned workers' new parent reaps them


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class _Host:
    def __init__(self, namespace: str, interface: str, address: str) -> None:
        self.namespace, self.interface, self.address = namespace, interface, address


@contextmanager
def _two_hosts() -> Iterator[tuple[_Host, _Host]]:
    """Two network namespaces joined by a veth pair, 10.213.0.1/24 and 10.213.0.2/24 (a
    private range, reachable only from inside them); skip where the machine refuses them.
    Both are deleted on the way out."""
    if not sys.platform.startswith("linux") or shutil.which("ip") is None:
        pytest.skip("needs Linux and the `ip` tool (iproute2) for network namespaces")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_NET_ADMIN)")
    tag = os.getpid()
    hosts = (
        _Host(f"meshsplit-{tag}-a", f"msv{tag}a", "10.213.0.1"),
        _Host(f"meshsplit-{tag}-b", f"msv{tag}b", "10.213.0.2"),
    )
    made: list[str] = []
    try:
        for host in hosts:
            _ip_or_skip("netns", "add", host.namespace)
            made.append(host.namespace)
        a, b = hosts
        _ip_or_skip(
            "link",
            "add",
            a.interface,
            "netns",
            a.namespace,
            "type",
            "veth",
            "peer",
            "name",
            b.interface,
            "netns",
            b.namespace,
        )
        for host in hosts:
            _ip_or_skip(
                "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface
            )
            _ip_or_skip("-n", host.namespace, "link", "set", "lo", "up")
            _ip_or_skip("-n", host.namespace, "link", "set", host.interface, "up")
            _ip_or_skip("netns", "exec", host.namespace, sys.executable, "-c", "")
        yield hosts
    finally:
        for namespace in made:
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, timeout=30)


def _ip_or_skip(*arguments: str) -> None:
    done = subprocess.run(["ip", *arguments], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"this machine refuses `ip {' '.join(arguments)}`: {done.stderr.strip()}")
