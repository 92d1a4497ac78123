"""Multi-node start-up: one call per node derives the node count, this node's rank, the head host
and the job id from the scheduler or a host list, then execs torchrun with c10d rendezvous.

    python -m hpcbert.launch [--nproc-per-node N] [--hosts h1,h2 | --hostfile F] [--node-rank R]
                             [--job-id ID] [--port P] [--ifname IF] [--dry-run] -- [hpcbert train options]

Where the inputs come from (the first that applies):
  --hosts / --hostfile   a host list (one per line or comma-separated); node rank from --node-rank,
                         $NODE_RANK, or the entry that is this machine (its hostname or a local IP)
  Slurm                  `scontrol show hostnames $SLURM_JOB_NODELIST`, $SLURM_NODEID, $SLURM_JOB_ID
  PBS                    $PBS_NODEFILE (one line per slot: deduplicated, order kept), this host's
                         position in it (or $NODE_RANK), $PBS_JOBID
  nothing                one node
Start it once per node: `srun --ntasks-per-node=1`, `mpiexec -n NNODES --ppn 1`, or by hand.
The job id is the rendezvous id (never reused across jobs) and, unless --port is given, picks the
rendezvous port, so two jobs sharing a head node do not collide; should another job hold that
port all the same (two ids can land on one port), the head takes the next free port of that range
instead and, on several nodes, hands it to the others through the node check-in (at the derived
port + 1). Derived ports are even, so one job's check-in port (odd) is never another job's
rendezvous port. The range lies below the kernel's ephemeral ports (Linux: 32768-60999), which
any outgoing connection may be given between the head's check and torchrun's bind.
The workers use the rendezvous store (torchrun's default) unless --max-restarts is given; then
they get a store of their own on a port torch picks (a shared store breaks restarts in torch 2.13,
pytorch/pytorch#135712), which another process can take before rank 0 binds it.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shlex
import socket
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Nodes:
    hosts: list[str]     # one entry per node, head first
    node_rank: int
    job_id: str
    source: str          # hosts, slurm, pbs or single

    @property
    def nnodes(self) -> int:
        return len(self.hosts)

    @property
    def head(self) -> str:
        return self.hosts[0]


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _is_local_ip(host: str) -> bool:
    """True when `host` is an address of this machine (binding to it succeeds only then)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


def _this_node(hosts: list[str], what: str) -> int:
    names = {socket.gethostname(), socket.gethostname().split(".")[0], socket.getfqdn()}
    for i, h in enumerate(hosts):
        if h in names or h.split(".")[0] in names or (is_ip(h) and _is_local_ip(h)):
            return i
    raise ValueError(f"node rank: this machine ({socket.gethostname()}) is not in {what} ({', '.join(hosts)}); "
                     f"pass --node-rank or set NODE_RANK")


def _dedupe(lines: list[str]) -> list[str]:
    seen: dict[str, None] = {}
    for line in lines:
        if line.strip():
            seen.setdefault(line.strip(), None)
    return list(seen)


def _int(env: dict, name: str) -> int:
    try:
        return int(env[name])
    except ValueError as e:
        raise ValueError(f"environment: {name}={env[name]!r} is not an integer") from e


def discover(env: dict[str, str], hosts: list[str] | None = None, node_rank: int | None = None,
             job_id: str | None = None, scontrol: str = "scontrol") -> Nodes:
    """The nodes of this job, from a host list, Slurm, PBS or nothing (one node)."""
    if node_rank is None and env.get("NODE_RANK"):
        node_rank = _int(env, "NODE_RANK")
    if hosts:
        source, hosts = "hosts", _dedupe(hosts)
        job_id = job_id or env.get("HPCBERT_JOB_ID")
        if not job_id:
            raise ValueError("job id: a host list needs --job-id (or HPCBERT_JOB_ID), the same on every node and "
                             "new for every job: it is the rendezvous id")
        rank = node_rank if node_rank is not None else _this_node(hosts, "--hosts")
    elif env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"):
        source = "slurm"
        nodelist = env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"]
        out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        hosts = _dedupe(out.stdout.splitlines())
        job_id = job_id or env.get("SLURM_JOB_ID") or env["SLURM_JOBID"]
        rank = node_rank if node_rank is not None else (_int(env, "SLURM_NODEID") if "SLURM_NODEID" in env
                                                        else _this_node(hosts, "SLURM_JOB_NODELIST"))
    elif env.get("PBS_NODEFILE"):
        source = "pbs"
        hosts = _dedupe(Path(env["PBS_NODEFILE"]).read_text().splitlines())
        job_id = job_id or env.get("PBS_JOBID") or "pbs"
        rank = node_rank if node_rank is not None else _this_node(hosts, "PBS_NODEFILE")
    else:
        source, hosts, rank = "single", ["127.0.0.1"], 0
        job_id = job_id or env.get("HPCBERT_JOB_ID") or f"single-{os.getpid()}"
    if not 0 <= rank < len(hosts):
        raise ValueError(f"node rank {rank} is outside the {len(hosts)} node(s) {', '.join(hosts)}")
    return Nodes(hosts, rank, job_id, source)


PORTS = range(29400, 29900, 2)  # the derived rendezvous ports: even, below the ephemeral range


def default_port(job_id: str) -> int:
    """A rendezvous port derived from the job id: the same on every node, even, 29400-29898. Even so
    that the node check-in on port + 1 never lands on another job's derived rendezvous port."""
    return PORTS[zlib.crc32(job_id.encode()) % len(PORTS)]


def _can_listen(port: int) -> bool:
    # as torchrun's TCPStore binds: every address, SO_REUSEADDR, so a closed job's TIME_WAIT is free
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


def port_or_free(port: int) -> int:
    """`port` if this machine can listen on it now, else the next port of PORTS after it that it can
    (wrapping round), else one the OS picks. PORTS lie below the ephemeral range, so no outgoing
    connection is given the choice before torchrun binds it."""
    if _can_listen(port):
        return port
    start = PORTS.index(port) + 1 if port in PORTS else 0
    for candidate in (*PORTS[start:], *PORTS[:start]):
        if candidate != port and _can_listen(candidate):
            return candidate
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def torchrun_command(nodes: Nodes, nproc_per_node: int | str, port: int, train_args: list[str], *,
                     local_addr: str | None = None, max_restarts: int = 0, join_timeout: int = 600,
                     python: str = sys.executable) -> list[str]:
    # is_host is always explicit: torch decides who hosts the rendezvous store by comparing the
    # endpoint with this machine's hostname and the addresses it resolves to, which misses IP
    # endpoints and secondary-NIC names (hpc-lab NOTES section 3.2): then nobody hosts it.
    conf = f"is_host={1 if nodes.node_rank == 0 else 0},join_timeout={join_timeout}"
    cmd = [python, "-m", "torch.distributed.run", f"--nnodes={nodes.nnodes}", f"--nproc-per-node={nproc_per_node}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint={nodes.head}:{port}", f"--rdzv-id={nodes.job_id}",
           f"--rdzv-conf={conf}", f"--max-restarts={max_restarts}"]
    if local_addr:
        cmd.append(f"--local-addr={local_addr}")
    return [*cmd, "-m", "hpcbert.cli", "train", *train_args]


def launch_env(env: dict[str, str], ifname: str | None, max_restarts: int = 0) -> dict[str, str]:
    out = dict(env)
    # torch 2.13: a TCPStore shared between rendezvous and workers makes restarts hang (hpc-lab NOTES
    # 3.2, pytorch/pytorch#135712), so with restarts the workers get their own. Without, they share
    # it: an own store's port is torch's get_free_port(), closed and handed to rank 0 to bind seconds
    # later; CI saw another process take it in between (EADDRINUSE on an ephemeral port).
    if max_restarts > 0:
        out["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if ifname:  # gloo otherwise binds the address the hostname resolves to (often 127.0.0.1)
        out.setdefault("GLOO_SOCKET_IFNAME", ifname)
        out.setdefault("NCCL_SOCKET_IFNAME", ifname)
    return out


def wait_for_nodes(nodes: Nodes, port: int, timeout_s: float, rdzv_port: int) -> int | None:
    """Every node's launcher checks in at head:port+1 (`port`: the derived rendezvous port) and waits
    for the others; returns torchrun's rendezvous port as the head chose it (`rdzv_port` there), or
    None (after printing which nodes never came, by rank and host) when some did not within
    timeout_s. torchrun's own rendezvous would only report a timeout, after --join-timeout, without
    naming anyone. The head's choice can still be taken between its check and torchrun's bind (a
    window of the check-in's length): torchrun then fails with EADDRINUSE and names the port."""
    try:
        from .dist import Rendezvous, StartupError, check_in
    except ImportError as e:  # torch only inside the container (HPCBERT_WRAPPER): torchrun waits alone
        print(f"hpcbert launch: no node check-in here ({e}); torchrun waits --join-timeout", file=sys.stderr)
        return port  # nothing to hand a fallback port over with: every node keeps the derived one
    shared = {"rdzv_port": str(rdzv_port)}
    try:
        rv = Rendezvous(nodes.head, port + 1, f"hpcbert-launch/{nodes.job_id}", host_store=nodes.node_rank == 0,
                        who="node", option="--join-timeout", store_host=f"the launcher on the head node {nodes.head}",
                        busy_hint=f"give --port P with ports P and P+1 free on the head node {nodes.head}")
        store = check_in(nodes.node_rank, nodes.nnodes, timeout_s, rv, shared)
    except StartupError as e:
        hosts = ", ".join(f"node {i} = {nodes.hosts[i]}" for i in e.missing)
        print(f"hpcbert launch: error: {e}" + (f" Not started: {hosts}." if hosts else ""), file=sys.stderr)
        return None
    del store  # closes the check-in store before torchrun starts
    return int(shared["rdzv_port"])


def _default_nproc(env: dict[str, str]) -> int:
    for name in ("NPROC_PER_NODE", "SLURM_GPUS_ON_NODE"):
        if env.get(name, "").isdigit():
            return int(env[name])
    import torch
    return torch.cuda.device_count() or 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m hpcbert.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc-per-node", default=None, help="processes per node (default: $NPROC_PER_NODE, "
                   "$SLURM_GPUS_ON_NODE, the visible GPUs, or 1 on CPU)")
    p.add_argument("--hosts", help="comma-separated host list, head first (instead of the scheduler's)")
    p.add_argument("--hostfile", help="file with one host per line, head first")
    p.add_argument("--node-rank", type=int, help="this node's index in the host list")
    p.add_argument("--job-id", help="rendezvous id (default: the scheduler's job id)")
    p.add_argument("--port", type=int, help="rendezvous port on the head (default: derived from the job id); "
                   "the nodes check in on port + 1 first")
    p.add_argument("--local-addr", help="this node's address for workers to reach (default: its host-list entry "
                   "when that is an IP)")
    p.add_argument("--ifname", help="network interface for gloo/NCCL (sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME "
                   "unless already set)")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts of the workers after a failure "
                   "(default 0: the job fails, its last checkpoint is there to resume from)")
    p.add_argument("--join-timeout", type=int, default=600, help="seconds to wait for every node to join; the "
                   "error names the nodes that did not")
    p.add_argument("--dry-run", action="store_true", help="print the environment changes and command, do not run")
    ns = p.parse_args(ours)
    env = dict(os.environ)
    hosts = None
    if ns.hosts:
        hosts = ns.hosts.split(",")
    elif ns.hostfile:
        hosts = Path(ns.hostfile).read_text().split()
    try:
        nodes = discover(env, hosts, ns.node_rank, ns.job_id)
    except (ValueError, OSError, subprocess.CalledProcessError) as e:
        print(f"hpcbert launch: error: {e}", file=sys.stderr)
        return 2
    local = nodes.hosts[nodes.node_rank]
    local_addr = ns.local_addr or (local if is_ip(local) and nodes.source != "single" else None)
    port = ns.port or default_port(nodes.job_id)
    nproc = ns.nproc_per_node or _default_nproc(env)
    python = env.get("HPCBERT_PYTHON") or sys.executable
    new_env = launch_env(env, ns.ifname, ns.max_restarts)
    changes = {k: v for k, v in new_env.items() if env.get(k) != v}
    print(f"hpcbert launch: {nodes.source}: node {nodes.node_rank} of {nodes.nnodes} ({', '.join(nodes.hosts)}), "
          f"head {nodes.head}, job {nodes.job_id}", file=sys.stderr, flush=True)
    if not ns.dry_run:
        rdzv_port = port
        if nodes.node_rank == 0 and not ns.port:  # an explicit --port is the user's to keep free
            rdzv_port = port_or_free(port)
            if rdzv_port != port:
                print(f"hpcbert launch: port {port} (from job id {nodes.job_id}) is taken on {socket.gethostname()}; "
                      f"the rendezvous uses port {rdzv_port}" + (", handed to the other nodes at check-in"
                                                                 if nodes.nnodes > 1 else ""),
                      file=sys.stderr, flush=True)
        if nodes.nnodes > 1:
            rdzv_port = wait_for_nodes(nodes, port, ns.join_timeout, rdzv_port)
            if rdzv_port is None:
                return 1
        port = rdzv_port
    cmd = torchrun_command(nodes, nproc, port, train_args, local_addr=local_addr, max_restarts=ns.max_restarts,
                           join_timeout=ns.join_timeout, python=python)
    if env.get("HPCBERT_WRAPPER"):  # a container prefix (singularity/exec.sh): WRAPPER -- torchrun ...
        cmd = [env["HPCBERT_WRAPPER"], "--", *cmd]
    print(" ".join(f"{k}={shlex.quote(v)}" for k, v in changes.items()), shlex.join(cmd), file=sys.stderr, flush=True)
    if ns.dry_run:
        return 0
    os.execvpe(cmd[0], cmd, new_env)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
