"""A real Slurm cluster on this host for tests: munged + slurmctld + slurmd under a temporary BASE.

It follows ../shared/hpc-lab/local_slurm.sh (Slurm 22.05 from Debian's slurm-wlm, slurm-wlm-torque
for qsub, munge): a private munged socket (nothing touches /run/munge), no cgroups
(proctrack/linuxproc, task/none), no accounting, one node named after `hostname -s`, and free TCP
ports so it can run beside another cluster. Every client the tests start gets SLURM_CONF through
`cluster.env`. KillWait is 10 s instead of Slurm's 30 s to keep walltime tests short: a job
that ignores SIGTERM is killed 10 s after it.

Needs root (slurmd starts jobs as their owner) and the packages
    apt-get install -y --no-install-recommends slurm-wlm slurm-wlm-torque munge slurmctld slurmd slurm-client
and is skipped, with the reason, without them. The daemons are stopped by their PID files at the
end of the session, whatever happened.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

KILL_WAIT_S = 10
COMMANDS = ("munged", "mungekey", "munge", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel",
            "sinfo", "qsub")


def unavailable() -> str | None:
    """Why no cluster can start here, or None."""
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (slurmd starts jobs as their owner)"
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        return (f"not installed: {', '.join(missing)}; apt-get install -y --no-install-recommends slurm-wlm "
                f"slurm-wlm-torque munge slurmctld slurmd slurm-client")
    return None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def slurm_conf(cluster: str, ctld_host: str, b: Path, ctld_port: int, d_port: int, nodes: str) -> str:
    """slurm.conf for a private test cluster under `b` (munge socket, state, spool, logs, PID files),
    without cgroups or accounting (NOTES §2.2), KillWait shortened; `nodes` = NodeName/Partition lines.
    Job ids start at a random number: a job's rendezvous port derives from its id (launch.default_port),
    so two test clusters on one machine (two checkouts' suites) would otherwise both give job 1 port 29566."""
    m = b / "munge"
    return f"""\
ClusterName={cluster}
SlurmctldHost={ctld_host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={m}/munge.socket.2
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={b}/state
SlurmdSpoolDir={b}/spool/%n
SlurmctldPidFile={b}/run/slurmctld.pid
SlurmdPidFile={b}/run/slurmd-%n.pid
SlurmctldLogFile={b}/log/slurmctld.log
SlurmdLogFile={b}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait={KILL_WAIT_S}
OverTimeLimit=0
MinJobAge=300
FirstJobId={random.randrange(1000, 1_000_000)}
InactiveLimit=0
SlurmdTimeout=60
{nodes}
"""


@dataclass
class SlurmCluster:
    base: Path
    host: str
    env: dict

    # --- life cycle ---
    @classmethod
    def start(cls, base: Path) -> "SlurmCluster":
        host = socket.gethostname().split(".")[0]
        for d in ("etc", "state", f"spool/{host}", "log", "run", "munge", "tmp"):
            (base / d).mkdir(parents=True, exist_ok=True)
        base.chmod(0o755)
        m = base / "munge"
        m.chmod(0o755)  # munged refuses a socket directory without o+x
        env = dict(os.environ, SLURM_CONF=str(base / "etc" / "slurm.conf"), TMPDIR=str(base / "tmp"))
        cluster = cls(base, host, env)
        subprocess.run(["mungekey", "-c", "-k", m / "munge.key", "-b", "1024"], check=True)
        subprocess.run(["munged", f"--key-file={m / 'munge.key'}", f"--socket={m / 'munge.socket.2'}",
                        f"--pid-file={m / 'munged.pid'}", f"--log-file={m / 'munged.log'}",
                        f"--seed-file={m / 'munged.seed'}"], check=True)
        try:
            cred = subprocess.run(["munge", "-S", m / "munge.socket.2", "-n"], check=True, capture_output=True)
            subprocess.run(["unmunge", "-S", m / "munge.socket.2"], input=cred.stdout, check=True,
                           capture_output=True)
            cluster._write_conf()
            subprocess.run(["slurmctld"], env=env, check=True)
            subprocess.run(["slurmd"], env=env, check=True)
            deadline = time.time() + 30
            while cluster.run("sinfo", "-h", "-N", "-o", "%t").stdout.strip() != "idle":
                if time.time() > deadline:
                    raise RuntimeError(f"the local Slurm node did not become idle in 30 s:\n{cluster.logs()}")
                time.sleep(0.3)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _write_conf(self) -> None:
        b = self.base
        node = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
        node = re.sub(r"^NodeName=\S+", f"NodeName={self.host}", node)
        node = re.sub(r"RealMemory=\d+", "RealMemory=2000", node)
        ctld_port, d_port = _free_ports(2)
        (b / "etc" / "slurm.conf").write_text(slurm_conf(
            "hpcberttest", self.host, b, ctld_port, d_port,
            f"{node} State=UNKNOWN\nPartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP"))

    def _pidfiles(self) -> list[Path]:
        """The daemons' PID files."""
        return [self.base / "run" / f"slurmd-{self.host}.pid", self.base / "run" / "slurmctld.pid",
                self.base / "munge" / "munged.pid"]

    def stop(self) -> None:
        """Cancel what still runs, then stop the daemons this cluster started (by their PID files):
        all at once (each takes 1.5-2 s to go after SIGTERM; one by one that was 6-8 s), SIGKILL for
        any still there 4 s later."""
        if (self.base / "run" / "slurmctld.pid").exists():
            self.run("scancel", "--user", "root", timeout=10)
        pids = []
        for pidfile in self._pidfiles():
            try:
                pid = int(pidfile.read_text().strip())
                os.kill(pid, signal.SIGTERM)
            except (FileNotFoundError, ValueError, ProcessLookupError):
                continue
            pids.append(pid)
        deadline = time.time() + 4
        for pid in pids:
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                if time.time() > deadline:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:  # it ended after the last check
                        pass
                    break
                time.sleep(0.1)

    # --- clients ---
    def run(self, *cmd, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("env", self.env)
        return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as a dict (JobState, ExitCode, StdOut, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: str, timeout: float = 90, states: tuple = ("COMPLETED", "FAILED", "CANCELLED",
                                                                        "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")) -> dict:
        deadline = time.time() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.time() > deadline:
                self.run("scancel", job_id)
                raise TimeoutError(f"job {job_id} not in {states} after {timeout} s: {info}\n{self.logs()}")
            time.sleep(0.3)

    def logs(self, lines: int = 30) -> str:
        out = []
        for f in sorted((self.base / "log").glob("*.log")):
            out.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)


@pytest.fixture(scope="session")
def slurm_cluster():
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    # Not pytest's tmp dirs: munged wants its socket directory reachable (o+x) through every parent.
    base = Path(tempfile.mkdtemp(prefix="hpcbert-slurm-"))
    cluster = None
    try:
        cluster = SlurmCluster.start(base)
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(base, ignore_errors=True)


# --- two nodes: one slurmd in each of two network namespaces ---------------------------------------

# Names and addresses of its own (tests/netns.py's other users take hpcb-n1/2 and 10.211.0.x), so
# tests cannot collide. Both veth ends are called IFNAME inside their namespace, as a real cluster's
# nodes all have their eth0/ib0: one GLOO_SOCKET_IFNAME exported with the job fits both nodes.
TWO_NODE_NET = dict(prefix="hpcb-s", subnet="10.211.2", ifname="hpcb-eth0")
TWO_NODE_NAMES = ("n1", "n2")


@dataclass
class TwoNodeSlurmCluster(SlurmCluster):
    """slurmctld + slurmd `n1` in namespace 1, slurmd `n2` in namespace 2, one munged (a pathname unix
    socket is reachable from every network namespace). Each slurmd runs as in hpc-lab NOTES 3.3: in
    its own UTS namespace (hostname n1/n2, how slurmd finds its NodeName) and a private mount
    namespace where BASE/etc/hosts (n1, n2 -> their addresses) is bound on /etc/hosts, so the job's
    processes, which slurmd starts, resolve the node names; the host's /etc/hosts is untouched.
    Clients must run in namespace 1 (slurmctld listens there): `run` does that, `prefix` is the
    nsenter command for other programs (`hpcbert submit`)."""

    nodes: tuple = ()

    @property
    def prefix(self) -> list[str]:
        return self.nodes[0].prefix()

    @property
    def ifname(self) -> str:
        return self.nodes[0].ifname

    @classmethod
    def start(cls, base: Path, nodes) -> "TwoNodeSlurmCluster":
        host = socket.gethostname().split(".")[0]  # slurmctld runs in the host's UTS namespace
        for d in ("etc", "state", "log", "run", "munge", "tmp", *(f"spool/{n}" for n in TWO_NODE_NAMES)):
            (base / d).mkdir(parents=True, exist_ok=True)
        base.chmod(0o755)
        m = base / "munge"
        m.chmod(0o755)
        env = dict(os.environ, SLURM_CONF=str(base / "etc" / "slurm.conf"), TMPDIR=str(base / "tmp"))
        cluster = cls(base, host, env, tuple(nodes))
        try:
            subprocess.run(["mungekey", "-c", "-k", m / "munge.key", "-b", "1024"], check=True)
            subprocess.run(["munged", f"--key-file={m / 'munge.key'}", f"--socket={m / 'munge.socket.2'}",
                            f"--pid-file={m / 'munged.pid'}", f"--log-file={m / 'munged.log'}",
                            f"--seed-file={m / 'munged.seed'}"], check=True)
            cluster._write_conf()
            hosts = base / "etc" / "hosts"
            hosts.write_text("127.0.0.1 localhost\n" +
                             "".join(f"{n.ip} {name}\n" for n, name in zip(cluster.nodes, TWO_NODE_NAMES)))
            # nsenter --net only: `ip netns exec` remounts /sys and slurmd's cgroup set-up then fails.
            subprocess.run([*cluster.prefix, "slurmctld"], env=env, check=True, capture_output=True, text=True)
            for n, name in zip(cluster.nodes, TWO_NODE_NAMES):
                subprocess.run([*n.prefix(), "unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c",
                                f'mount --bind "$1" /etc/hosts && hostname {name} && exec slurmd', "sh", str(hosts)],
                               env=env, check=True, capture_output=True, text=True)
            deadline = time.time() + 30
            while sorted(cluster.run("sinfo", "-h", "-N", "-o", "%N %t").stdout.split("\n")) != \
                    ["", *(f"{name} idle" for name in TWO_NODE_NAMES)]:
                if time.time() > deadline:
                    sinfo = cluster.run("sinfo", "-N").stdout
                    raise RuntimeError(f"the two Slurm nodes did not both become idle in 30 s:\n{sinfo}\n"
                                       f"{cluster.logs()}")
                time.sleep(0.3)
        except subprocess.CalledProcessError as e:
            cluster.stop()
            raise RuntimeError(f"starting the two-node cluster: {e}\n{e.stderr or ''}\n{cluster.logs()}") from e
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _write_conf(self) -> None:
        b = self.base
        node_lines = "\n".join(f"NodeName={name} NodeAddr={n.ip} NodeHostname={name} CPUs=2 RealMemory=1000 "
                               f"State=UNKNOWN" for n, name in zip(self.nodes, TWO_NODE_NAMES))
        (b / "etc" / "slurm.conf").write_text(slurm_conf(
            "hpcberttest2", f"{self.host}({self.nodes[0].ip})", b, 6817, 6818,
            f"{node_lines}\nPartitionName=two Nodes={','.join(TWO_NODE_NAMES)} Default=YES MaxTime=INFINITE State=UP"))

    def _pidfiles(self) -> list[Path]:
        return [*(self.base / "run" / f"slurmd-{name}.pid" for name in TWO_NODE_NAMES),
                self.base / "run" / "slurmctld.pid", self.base / "munge" / "munged.pid"]

    def stop(self) -> None:
        """Cancel the jobs and let them end (KillWait) before the daemons go: with proctrack/linuxproc a
        job step outlives its slurmd. Then whatever still runs in the namespaces (only what this cluster
        started runs there) is killed by PID, so the namespaces can really go."""
        if (self.base / "run" / "slurmctld.pid").exists():
            try:
                self.run("scancel", "--user", "root", timeout=10)
                deadline = time.time() + KILL_WAIT_S + 5
                while self.run("squeue", "-h", "-t", "PD,R,CG,S", timeout=10).stdout.strip() \
                        and time.time() < deadline:
                    time.sleep(0.3)
            except subprocess.TimeoutExpired:
                pass
        try:
            super().stop()
        finally:
            for n in self.nodes:
                pids = subprocess.run(["ip", "netns", "pids", n.ns], capture_output=True, text=True).stdout.split()
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ValueError, ProcessLookupError):
                        pass

    def run(self, *cmd, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("env", self.env)
        return subprocess.run([*self.prefix, *(str(c) for c in cmd)], capture_output=True, text=True,
                              timeout=timeout, **kw)


def two_node_unavailable() -> str | None:
    from netns import unavailable_reason
    reason = unavailable() or unavailable_reason()
    if reason is None and shutil.which("unshare") is None:
        reason = "unshare (util-linux) not installed"
    return reason


@pytest.fixture(scope="session")
def slurm_two_nodes():
    """A two-node Slurm cluster (n1, n2) in two network namespaces; see TwoNodeSlurmCluster."""
    reason = two_node_unavailable()
    if reason:
        pytest.skip(reason)
    from netns import two_nodes
    base = Path(tempfile.mkdtemp(prefix="hpcbert-slurm2-"))
    cluster = None
    try:
        with two_nodes(**TWO_NODE_NET) as nodes:  # deleted on the way out, whatever happened
            try:
                cluster = TwoNodeSlurmCluster.start(base, nodes)
                yield cluster
            finally:
                if cluster is not None:
                    cluster.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)
