"""Multi-node start-up: how the launcher derives nodes from a scheduler or a host list (no
cluster needed), and a real 2-node run in two network namespaces (root only)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, run_env
from hpcbert import launch
from hpcbert.runfiles import read_metrics, read_summary
from netns import limit_rate, rate_bits, two_nodes, unavailable_reason


# --- derivation: environment -> torchrun command --------------------------------------------------

def fake_scontrol(tmp_path, hosts):
    script = tmp_path / "scontrol"
    script.write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] || exit 3\n" +
                      "".join(f"echo {h}\n" for h in hosts))
    script.chmod(0o755)
    return str(script)


def test_slurm_nodes_head_rank_and_job_id(tmp_path):
    env = {"SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NODEID": "1", "SLURM_JOB_ID": "4242"}
    nodes = launch.discover(env, scontrol=fake_scontrol(tmp_path, ["gpu07", "gpu08"]))
    assert (nodes.hosts, nodes.node_rank, nodes.job_id, nodes.source) == (["gpu07", "gpu08"], 1, "4242", "slurm")
    cmd = launch.torchrun_command(nodes, 4, 29500, ["--model", "bert-base"], python="python")
    assert cmd[:3] == ["python", "-m", "torch.distributed.run"]
    assert {"--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=gpu07:29500",
            "--rdzv-id=4242", "--rdzv-conf=is_host=0,join_timeout=600"} <= set(cmd)
    assert cmd[-5:] == ["-m", "hpcbert.cli", "train", "--model", "bert-base"]
    head = launch.discover({**env, "SLURM_NODEID": "0"}, scontrol=fake_scontrol(tmp_path, ["gpu07", "gpu08"]))
    assert "--rdzv-conf=is_host=1,join_timeout=600" in launch.torchrun_command(head, 4, 29500, [])


def test_pbs_nodefile_is_deduplicated_and_this_host_found(tmp_path, monkeypatch):
    f = tmp_path / "nodefile"
    f.write_text("cn01\ncn01\ncn01\ncn01\ncn02\ncn02\ncn02\ncn02\n")  # one line per slot
    monkeypatch.setattr(launch.socket, "gethostname", lambda: "cn02.cluster.local")
    nodes = launch.discover({"PBS_NODEFILE": str(f), "PBS_JOBID": "77.pbs01"})
    assert (nodes.hosts, nodes.node_rank, nodes.job_id, nodes.head) == (["cn01", "cn02"], 1, "77.pbs01", "cn01")
    assert launch.discover({"PBS_NODEFILE": str(f), "PBS_JOBID": "7", "NODE_RANK": "0"}).node_rank == 0
    monkeypatch.setattr(launch.socket, "gethostname", lambda: "login1")
    with pytest.raises(ValueError, match="not in PBS_NODEFILE"):
        launch.discover({"PBS_NODEFILE": str(f), "PBS_JOBID": "7"})


def test_host_list_needs_a_job_id_and_finds_this_node_by_local_address():
    with pytest.raises(ValueError, match="--job-id"):
        launch.discover({}, hosts=["10.9.9.1", "127.0.0.1"])
    nodes = launch.discover({}, hosts=["10.9.9.1", "127.0.0.1"], job_id="run1")  # 127.0.0.1 is local here
    assert nodes.node_rank == 1 and nodes.head == "10.9.9.1"


def test_default_port_is_the_same_in_every_process_and_spreads_over_job_ids():
    # Every node derives the port on its own, so it must not depend on anything that differs between
    # interpreters (str hashes are salted per process: PYTHONHASHSEED). Ask fresh interpreters.
    jobs = ["run1", "4242", "77.pbs01"]
    here = [launch.default_port(j) for j in jobs]
    code = f"from hpcbert import launch; print([launch.default_port(j) for j in {jobs!r}])"
    for seed in ("0", "1", "random"):
        r = subprocess.run([sys.executable, "-c", code], env={**run_env(), "PYTHONHASHSEED": seed},
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == str(here), f"PYTHONHASHSEED={seed}"
    # Inside the documented range, even (a job's check-in on port + 1 is never another job's rendezvous
    # port), and two jobs sharing a head node rarely collide.
    ports = [launch.default_port(f"job-{i}") for i in range(200)]
    assert all(29400 <= p <= 29898 and p % 2 == 0 for p in ports)
    assert len(set(ports)) > 120  # 200 draws from 250 ports: 250 * (1 - (249/250)**200) = ~138 distinct if even


def test_dry_run_prints_the_environment_and_command():
    r = subprocess.run([sys.executable, "-m", "hpcbert.launch", "--hosts", "10.0.0.1,10.0.0.2", "--node-rank", "0",
                        "--job-id", "j1", "--port", "29555", "--ifname", "ib0", "--nproc-per-node", "2", "--dry-run",
                        "--", "--model", "bert-tiny"],
                       env={k: v for k, v in run_env().items()
                            if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "hosts: node 0 of 2 (10.0.0.1, 10.0.0.2), head 10.0.0.1, job j1" in r.stderr
    for part in ("GLOO_SOCKET_IFNAME=ib0", "NCCL_SOCKET_IFNAME=ib0",
                 "--rdzv-endpoint=10.0.0.1:29555", "--rdzv-conf=is_host=1", "--local-addr=10.0.0.1",
                 "--max-restarts=0", "-m hpcbert.cli train --model bert-tiny"):
        assert part in r.stderr
    # No restarts: the workers use the rendezvous store, as torchrun does by default (a store of their
    # own is bound on a port torch picked and released earlier, which another process may take).
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in r.stderr


def test_with_restarts_the_workers_get_a_store_of_their_own():
    # torch 2.13: restarts with the shared store fail to reconnect and hang the other node (hpc-lab
    # NOTES 3.2, pytorch/pytorch#135712).
    r = subprocess.run([sys.executable, "-m", "hpcbert.launch", "--hosts", "10.0.0.1,10.0.0.2", "--node-rank", "1",
                        "--job-id", "j1", "--max-restarts", "2", "--nproc-per-node", "1", "--dry-run", "--",
                        "--model", "bert-tiny"],
                       env={k: v for k, v in run_env().items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in r.stderr and "--max-restarts=2" in r.stderr


@pytest.mark.slow
def test_a_node_that_never_starts_is_named_within_the_join_timeout(tmp_path):
    # Node 1 (127.0.0.2, also this machine's loopback) is never started; node 0 must not hang.
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "hpcbert.launch", "--hosts", "127.0.0.1,127.0.0.2", "--node-rank", "0",
                        "--job-id", f"absent-{os.getpid()}", "--join-timeout", "3", "--nproc-per-node", "1", "--",
                        "--model", "bert-tiny"], env=run_env(), cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and time.time() - t0 < 3 + 20
    assert "node(s) 1 never arrived" in r.stderr and "Not started: node 1 = 127.0.0.2." in r.stderr


def _free_run_of_ports(n: int) -> list[int]:
    """n consecutive derived ports (step 2) that this machine can listen on now."""
    import socket
    for start in range(29400, 29900 - 2 * n, 2 * n):
        ports = list(range(start, start + 2 * n, 2))
        try:
            for port in ports:
                with socket.socket() as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind(("", port))
            return ports
        except OSError:
            continue
    pytest.skip("no free run of ports in 29400-29898 on this machine")


def test_a_taken_port_is_replaced_by_the_next_free_derived_port(monkeypatch):
    # The replacement lies below the ephemeral range (32768-60999 on Linux), so no outgoing connection
    # is given it between this check and torchrun's bind: CI saw EADDRINUSE on port 60511, one the OS
    # had handed out as free.
    import socket
    a, b, c = _free_run_of_ports(3)
    with socket.socket() as held:
        held.bind(("", a))
        held.listen()
        assert launch.port_or_free(a) == b
        with socket.socket() as held_too:
            held_too.bind(("", b))
            held_too.listen()
            assert launch.port_or_free(a) == c
            # with every derived port taken, the OS picks one
            monkeypatch.setattr(launch, "PORTS", range(a, c, 2))
            other = launch.port_or_free(b)
            assert other not in (a, b)
            with socket.socket() as s:  # the OS's choice can be listened on
                s.bind(("", other))
                s.listen()
        assert launch.port_or_free(b) == b  # free again once its holder closed
    monkeypatch.setattr(launch, "PORTS", range(a, c + 2, 2))
    with socket.socket() as held:
        held.bind(("", c))
        held.listen()
        assert launch.port_or_free(c) == a  # after the last, the first


def test_a_taken_check_in_port_on_the_head_is_named_with_what_to_do(tmp_path):
    # The head cannot fall back for the check-in port (the other nodes find the head there), so it
    # must say which port another process holds and how to choose one, not that the head is missing.
    import socket
    job = f"busy-{os.getpid()}"
    check_in_port = launch.default_port(job) + 1
    with socket.socket() as held:
        held.bind(("", check_in_port))
        held.listen()
        r = subprocess.run([sys.executable, "-m", "hpcbert.launch", "--hosts", "127.0.0.1,127.0.0.2", "--node-rank", "0",
                            "--job-id", job, "--join-timeout", "30", "--nproc-per-node", "1", "--", "--model",
                            "bert-tiny"], env=run_env(), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert f"node 0 hosts the rendezvous store but cannot listen on port {check_in_port}" in r.stderr, r.stderr
    assert "give --port P with ports P and P+1 free on the head node 127.0.0.1" in r.stderr
    assert "never started" not in r.stderr and "Not started" not in r.stderr


@pytest.mark.slow
def test_the_head_hands_a_replacement_port_to_the_other_nodes_when_the_job_port_is_taken(tmp_path):
    # Two jobs whose ids land on one port (CI saw EADDRINUSE on a job's derived port): the head takes
    # a free port and node 1, which cannot see the head's ports, learns it at check-in.
    import socket
    job = f"taken-{os.getpid()}"
    derived = launch.default_port(job)
    env = {**run_env(), "OMP_NUM_THREADS": "1"}
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("", derived))
        held.listen()
        procs = [subprocess.Popen([sys.executable, "-m", "hpcbert.launch", "--hosts", "127.0.0.1,127.0.0.2",
                                   "--node-rank", str(r), "--job-id", job, "--join-timeout", "60",
                                   "--nproc-per-node", "1", "--", "--model", "bert-tiny", "--task", "synthetic",
                                   "--threads", "1", "--max-steps", "2", "--batch-size", "4",
                                   "--synthetic-train-size", "16", "--synthetic-dev-size", "4", "--dist-timeout", "60",
                                   "--out", str(tmp_path / "run")],
                                  env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in (0, 1)]
        try:
            logs = [p.communicate(timeout=150)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    assert f"port {derived} (from job id {job}) is taken" in logs[0]
    endpoints = [[w for w in log.split() if w.startswith("--rdzv-endpoint=")] for log in logs]
    assert endpoints[0] and endpoints[0][0] != f"--rdzv-endpoint=127.0.0.1:{derived}"
    assert endpoints[0] == endpoints[1]  # node 1 uses the head's replacement
    assert read_summary(tmp_path / "run")["world_size"] == 2


def test_container_wrapper_and_interpreter_come_from_the_job_environment():
    env = {k: v for k, v in run_env().items() if not k.startswith(("SLURM_", "PBS_"))}
    env.update(HPCBERT_WRAPPER="/kit/singularity/exec.sh", HPCBERT_PYTHON="/opt/py/bin/python3")
    r = subprocess.run([sys.executable, "-m", "hpcbert.launch", "--nproc-per-node", "1", "--dry-run", "--",
                        "--max-steps", "2"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "/kit/singularity/exec.sh -- /opt/py/bin/python3 -m torch.distributed.run --nnodes=1" in r.stderr


def test_tc_rates_are_read_in_decimal_units():
    assert rate_bits("1gbit") == 1e9 and rate_bits("10gbit") == 1e10 and rate_bits("500mbit") == 5e8


# --- two nodes for real ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
def test_train_across_two_namespace_nodes_with_c10d_rendezvous(tmp_path):
    job = f"hpcb-test-{os.getpid()}"
    out = tmp_path / "run"
    env = run_env()
    env.update(TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")
    for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NODE_RANK"):
        env.pop(k, None)
    with two_nodes() as nodes:
        limit_rate(nodes, "10gbit")
        hosts = ",".join(n.ip for n in nodes)
        procs = []
        t0 = time.time()
        for n in nodes:  # no --node-rank: each node finds itself in the host list by its address
            cmd = [str(ROOT / "multinode_communication" / "bootstrap.sh"), "--hosts", hosts, "--job-id", job,
                   "--ifname", n.ifname, "--nproc-per-node", "2", "--join-timeout", "60", "--",
                   "--model", "bert-tiny", "--task", "synthetic", "--threads", "1", "--max-steps", "4",
                   "--batch-size", "4", "--log-every", "1", "--synthetic-train-size", "64",
                   "--synthetic-dev-size", "9", "--dist-timeout", "60", "--out", str(out)]
            procs.append(n.popen(cmd, env={**env, "PYTHON": sys.executable}, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, cwd=tmp_path))
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=150)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                pytest.fail("2-node run did not finish in 150 s")
        wall = time.time() - t0
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    assert "node 0 of 2 (10.211.0.1, 10.211.0.2), head 10.211.0.1" in logs[0]
    assert "node 1 of 2 (10.211.0.1, 10.211.0.2), head 10.211.0.1" in logs[1]
    s = read_summary(out)
    assert (s["world_size"], s["nodes"], s["gpus_per_node"], s["dist_backend"]) == (4, 2, 2, "gloo")
    assert (s["global_batch_size"], s["steps"], s["sequences"]) == (16, 4, 64)
    assert len(s["per_rank_step_time_s"]["per_rank"]) == 4
    assert s["eval"]["dev"]["accuracy"] * 9 == pytest.approx(round(s["eval"]["dev"]["accuracy"] * 9))
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]
    print(f"2 nodes x 2 processes: {wall:.1f} s wall")
