"""A generated job on two Slurm nodes: `hpcbert submit --nodes 2` on the two-namespace cluster of
tests/slurm_cluster.py (slurmd n1 and n2, each in its own network namespace, joined by a veth pair).

The submission runs in node 1's namespace, where slurmctld listens; sbatch exports the submit
environment to the job (--export=ALL), GLOO_SOCKET_IFNAME included; the script's srun starts one
bootstrap per node, whose launcher finds the nodes (n1, n2), its rank and the head from SLURM_* and
runs torchrun with a c10d rendezvous on n1.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from conftest import ROOT
from hpcbert.runfiles import read_metrics, read_summary
from slurm_cluster import slurm_two_nodes  # noqa: F401  (the session fixture)

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.xdist_group("slurm")]  # one cluster at a time

BOOTSTRAP = ROOT / "multinode_communication" / "bootstrap.sh"


def test_sbatch_runs_a_generated_two_node_job(slurm_two_nodes, tmp_path):  # noqa: F811
    cluster = slurm_two_nodes
    if not BOOTSTRAP.exists():
        pytest.skip(f"{BOOTSTRAP} is not there (multinode_communication/)")
    env = dict(cluster.env, PYTHONPATH=str(ROOT / "BERT"), OMP_NUM_THREADS="1", PYTHON=sys.executable,
               GLOO_SOCKET_IFNAME=cluster.ifname)
    for k in ("NCCL_SOCKET_IFNAME", "NODE_RANK", "HPCBERT_BOOTSTRAP", "HPCBERT_WRAPPER"):
        env.pop(k, None)
    run_dir = tmp_path / "run"
    t0 = time.time()
    r = subprocess.run([*cluster.prefix, sys.executable, "-m", "hpcbert.cli", "submit", "--scheduler", "slurm",
                        "--nodes", "2", "--gpus-per-node", "0", "--procs-per-node", "2", "--cpus-per-node", "2",
                        "--walltime", "00:05:00", "--out-script", "job.sbatch", "--",
                        "--model", "bert-tiny", "--task", "synthetic", "--max-steps", "4", "--batch-size", "2",
                        "--threads", "1", "--synthetic-train-size", "64", "--synthetic-dev-size", "16",
                        "--log-every", "1", "--out", str(run_dir)],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()
    assert job_id.isdigit(), r.stdout
    info = cluster.wait(job_id, timeout=80)
    log_file = tmp_path / f"hpcbert-{job_id}.out"
    log = log_file.read_text(errors="replace") if log_file.exists() else "(no job output)"
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-6000:]
    assert info["NumNodes"] == "2" and info["NodeList"] == "n[1-2]"

    # One bootstrap per node, each found its own rank; n1 hosts the rendezvous.
    assert "[hpcbert job] job %s: 2 node(s) x 2 process(es)" % job_id in log
    assert "hpcbert launch: slurm: node 0 of 2 (n1, n2), head n1" in log
    assert "hpcbert launch: slurm: node 1 of 2 (n1, n2), head n1" in log
    assert "launcher exited with status 0" in log
    s = read_summary(run_dir)
    assert (s["world_size"], s["nodes"], s["steps"], s["stopped_by"]) == (4, 2, 4, "max_steps")
    assert (s["dist_backend"], s["global_batch_size"]) == ("gloo", 8)
    assert s["hardware"]["hostname"] == "n1"  # rank 0 ran in slurmd n1's UTS namespace
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4]
    print(f"2 Slurm nodes x 2 processes: submit -> COMPLETED in {time.time() - t0:.1f} s")
