"""Two simulated nodes on one Linux host, for multi-node tests and benchmarks (root only).

Two network namespaces joined by a veth pair, modelled on ../shared/hpc-lab/netns_nodes.sh. The
addresses exist only inside the namespaces and there is no route out of them, so nothing leaves
the machine. Always torn down (context manager), also after a failure or an earlier crashed run.

    with two_nodes() as nodes:                     # hpcb-n1 10.211.0.1 <-veth-> hpcb-n2 10.211.0.2
        nodes[0].popen(["python", ...])            # a process "on" node 1
        limit_rate(nodes, "1gbit")                 # tc token-bucket on both ends of the link
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Node:
    ns: str      # network namespace name
    ip: str      # address of its veth end
    ifname: str  # its veth end

    def prefix(self) -> list[str]:
        """Command prefix that runs a program in this node's network namespace only (nsenter keeps
        /sys and the mounts; `ip netns exec` would remount /sys)."""
        return ["nsenter", f"--net=/run/netns/{self.ns}"]

    def run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix(), *cmd], **kw)

    def popen(self, cmd: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen([*self.prefix(), *cmd], **kw)


def unavailable_reason() -> str | None:
    """Why two namespace nodes cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nsenter", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} not installed"
    return None


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


@contextlib.contextmanager
def two_nodes(prefix: str = "hpcb", subnet: str = "10.211.0", ifname: str | None = None):
    """ifname: one interface name for both veth ends, given inside the namespaces (as on a real
    cluster, where every node has its eth0/ib0), so one GLOO_SOCKET_IFNAME fits both nodes; default:
    PREFIX-v1 and PREFIX-v2."""
    n1 = Node(f"{prefix}-n1", f"{subnet}.1", ifname or f"{prefix}-v1")
    n2 = Node(f"{prefix}-n2", f"{subnet}.2", ifname or f"{prefix}-v2")
    created = (f"{prefix}-v1", f"{prefix}-v2")  # names in the root namespace, unique there

    def down() -> None:
        for n in (n1, n2):  # deleting a namespace removes its veth end, and with it the pair
            _ip("netns", "del", n.ns, check=False)

    down()  # left over from a crashed run
    try:
        _ip("netns", "add", n1.ns)
        _ip("netns", "add", n2.ns)
        _ip("link", "add", created[0], "type", "veth", "peer", "name", created[1])
        for n, name in zip((n1, n2), created):
            _ip("link", "set", name, "netns", n.ns)
            if name != n.ifname:
                _ip("-n", n.ns, "link", "set", name, "name", n.ifname)
            _ip("-n", n.ns, "addr", "add", f"{n.ip}/24", "dev", n.ifname)
            _ip("-n", n.ns, "link", "set", "lo", "up")
            _ip("-n", n.ns, "link", "set", n.ifname, "up")
        yield (n1, n2)
    finally:
        down()


def limit_rate(nodes, rate: str | None) -> None:
    """Limit both directions of the link to `rate` ('1gbit', '10gbit') with a token bucket on each
    veth end; None removes the limit."""
    for n in nodes:
        subprocess.run([*n.prefix(), "tc", "qdisc", "del", "dev", n.ifname, "root"], capture_output=True)
        if rate:
            # burst: the bytes one timer tick (4 ms at HZ=250) carries at the rate; a smaller bucket,
            # not the rate, would limit throughput, a much larger one lets bursts exceed it.
            burst = max(64 * 1024, int(rate_bits(rate) / 8 / 250))
            subprocess.run([*n.prefix(), "tc", "qdisc", "add", "dev", n.ifname, "root", "tbf", "rate", rate,
                            "burst", str(burst), "latency", "50ms"], check=True, capture_output=True, text=True)


def rate_bits(rate: str) -> float:
    """'1gbit' -> 1e9, '500mbit' -> 5e8 (tc's decimal units)."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[: -len(u)]) * f
    raise ValueError(f"rate: {rate!r}; accepted: a number with gbit, mbit or kbit")
