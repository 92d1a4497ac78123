"""Generated job scripts under a real scheduler: the local Slurm cluster (tests/slurm_cluster.py).

A Slurm script goes in through `sbatch`, a Torque-style one through Slurm's `qsub` wrapper (which
hands the #PBS lines to sbatch), and each trains 2 processes to a complete run directory. A third
job checks the walltime contract: Slurm's USR1 reaches the batch shell and becomes the stop file.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from hpcbert.checkpoint import CheckpointManager
from hpcbert.runfiles import read_metrics, read_summary
from slurm_cluster import slurm_cluster  # noqa: F401  (the session fixture)

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.xdist_group("slurm")]  # one cluster, one worker

BOOTSTRAP = ROOT / "multinode_communication" / "bootstrap.sh"
# The bootstrap's interface, one node only, honouring HPCBERT_WRAPPER (the container prefix) the way
# the job scripts expect bootstrap.sh to: `$HPCBERT_WRAPPER -- torchrun ...`.
WRAPPING_BOOTSTRAP = """#!/usr/bin/env bash
set -euo pipefail
nproc=1
while [ $# -gt 0 ]; do
  case $1 in --nproc-per-node) nproc=$2; shift 2 ;; --) shift; break ;; *) echo "bootstrap: bad option $1" >&2; exit 2 ;; esac
done
exec ${HPCBERT_WRAPPER:+"$HPCBERT_WRAPPER" --} "$HPCBERT_PYTHON" -m torch.distributed.run --standalone \\
  --nnodes=1 --nproc-per-node="$nproc" -m hpcbert.cli train "$@"
"""
TRAIN = ["--model", "bert-tiny", "--task", "synthetic", "--max-steps", "6", "--batch-size", "4", "--threads", "1",
         "--synthetic-train-size", "64", "--synthetic-dev-size", "16", "--log-every", "2"]
CPU_JOB = ["--nodes", "1", "--gpus-per-node", "0", "--procs-per-node", "2", "--cpus-per-node", "2",
           "--walltime", "00:05:00"]


@pytest.fixture
def job_env(slurm_cluster):  # noqa: F811
    """The environment `hpcbert submit` runs in; sbatch exports it to the job (--export=ALL)."""
    if not BOOTSTRAP.exists():
        pytest.skip(f"{BOOTSTRAP} is not there (multinode_communication/)")
    # PYTHON: the interpreter bootstrap.sh runs hpcbert.launch (and so torchrun) with; the job scripts
    # export the one recorded at render time as HPCBERT_PYTHON.
    return dict(slurm_cluster.env, PYTHONPATH=str(ROOT / "BERT"), OMP_NUM_THREADS="1", PYTHON=sys.executable)


def submit(args, env, cwd) -> str:
    r = subprocess.run([sys.executable, "-m", "hpcbert.cli", "submit", *map(str, args)], env=env, cwd=cwd,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()
    assert job_id.isdigit(), r.stdout
    return job_id


def job_output(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')}" for p in sorted(tmp_path.glob("*.[oe]*"))
                     if p.is_file())


def assert_two_process_run(cluster, job_id, run_dir, tmp_path):
    info = cluster.wait(job_id, timeout=100)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job_output(tmp_path)
    s = read_summary(run_dir)
    assert (s["world_size"], s["steps"], s["stopped_by"]) == (2, 6, "max_steps")
    assert s["global_batch_size"] == 8 and s["sequences"] == 48
    assert not (run_dir / "STOP").exists()
    return info


def test_sbatch_runs_a_generated_slurm_script(slurm_cluster, job_env, tmp_path):  # noqa: F811
    """...with a site's own directive (sbatch takes it: the job's comment) and a set-up line (run by the
    batch shell under Slurm, before the launch)."""
    run_dir = tmp_path / "run"
    job_id = submit(["--scheduler", "slurm", *CPU_JOB, "--directive=--comment=site-directive",
                     "--setup", 'echo "site set-up in job $SLURM_JOB_ID"', "--out-script", "job.sbatch", "--",
                     *TRAIN, "--out", run_dir], job_env, tmp_path)
    info = assert_two_process_run(slurm_cluster, job_id, run_dir, tmp_path)
    assert info["TimeLimit"] == "00:05:00" and info["NumNodes"] == "1"
    assert info["Comment"] == "site-directive"
    log = (tmp_path / f"hpcbert-{job_id}.out").read_text()
    assert f"site set-up in job {job_id}\n" in log
    assert log.index("site set-up in job") < log.index(f"[hpcbert job] job {job_id}:")
    assert f"[hpcbert job] job {job_id}: 1 node(s) x 2 process(es)" in log
    assert "launcher exited with status 0" in log


def test_qsub_runs_a_generated_torque_script(slurm_cluster, job_env, tmp_path):  # noqa: F811
    """Torque flavour through Slurm's qsub wrapper: sbatch reads the #PBS lines, there are no PBS_*
    variables and no pbsdsh, so the script starts the bootstrap with srun."""
    run_dir = tmp_path / "run"
    job_id = submit(["--scheduler", "torque", *CPU_JOB, "--out-script", "job.pbs", "--", *TRAIN, "--out", run_dir],
                    job_env, tmp_path)
    info = assert_two_process_run(slurm_cluster, job_id, run_dir, tmp_path)
    assert info["JobName"] == "hpcbert" and info["NumCPUs"] == "2"
    assert "hpcbert launch: slurm: node 0 of 1" in (tmp_path / f"job.pbs.e{job_id}").read_text()


def test_sbatch_runs_torchrun_inside_the_container_wrapper(slurm_cluster, job_env, tmp_path):  # noqa: F811
    """job script -> srun -> bootstrap -> singularity/exec.sh -> `apptainer exec` -> torchrun, with a
    stand-in `apptainer` that records its arguments and runs the command after the image as
    --cleanenv does: with only the variables passed in (APPTAINERENV_NAME -> NAME), so training runs
    with the checkout's hpcbert and no host PYTHONPATH."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "apptainer").write_text(
        '#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$HPCBERT_TEST_APPTAINER_LOG"\n'
        'inside=(env -i HOME="$HOME" PATH=/usr/bin:/bin)\n'
        'for v in $(compgen -e); do case $v in APPTAINERENV_*) inside+=("${v#APPTAINERENV_}=${!v}") ;; esac; done\n'
        'shift\nwhile [ $# -gt 0 ]; do case $1 in --bind|--env) shift 2 ;; -*) shift ;; *) shift; break ;; esac; done\n'
        'exec "${inside[@]}" "$@"\n')
    (fake_bin / "apptainer").chmod(0o755)
    bootstrap = tmp_path / "bootstrap.sh"
    bootstrap.write_text(WRAPPING_BOOTSTRAP)
    bootstrap.chmod(0o755)
    # HPCBERT_PYTHON: the image's interpreter (the script's default is python3, the image's); here the
    # "image" is this machine.
    env = dict(job_env, PATH=f"{fake_bin}:{job_env['PATH']}", HPCBERT_BOOTSTRAP=str(bootstrap),
               HPCBERT_PYTHON=sys.executable,
               HPCBERT_TEST_APPTAINER_LOG=str(tmp_path / "apptainer.args"))
    run_dir = tmp_path / "run"
    job_id = submit(["--scheduler", "slurm", *CPU_JOB, "--container", "hpcbert.sif", "--bind", f"{tmp_path}:/data",
                     "--out-script", "job.sbatch", "--", *TRAIN, "--out", run_dir], env, tmp_path)
    assert_two_process_run(slurm_cluster, job_id, run_dir, tmp_path)
    args = (tmp_path / "apptainer.args").read_text().split("\n")
    assert args[:8] == ["exec", "--cleanenv", "--bind", f"{tmp_path}:/data", "--env", "PYTHONNOUSERSITE=1",
                        "--bind", str(ROOT)]  # the checkout, at its own path: its hpcbert runs inside
    assert args[8:12] == ["hpcbert.sif", sys.executable, "-m", "torch.distributed.run"]


def test_pbs_pro_script_is_accepted_by_sbatch(slurm_cluster, job_env, tmp_path):  # noqa: F811
    """Slurm's sbatch reads #PBS lines: select=...:mpiprocs=1 with place=scatter (or, for a whole
    CPU node, scatter:excl) on its own line parses."""
    i = CPU_JOB.index("--cpus-per-node")
    whole_node = CPU_JOB[:i] + CPU_JOB[i + 2:]
    for n, job in enumerate((CPU_JOB, whole_node)):
        script = tmp_path / f"job{n}.pbs"
        r = subprocess.run([sys.executable, "-m", "hpcbert.cli", "submit", "--scheduler", "pbs", *job, "--queue",
                            "debug", "--directive", "-m n", "--dry-run", "--out-script", script, "--", *TRAIN],
                           env=job_env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert ("place=scatter:excl" in script.read_text()) == (job is whole_node)
        t = slurm_cluster.run("sbatch", "--test-only", script, cwd=tmp_path)
        assert t.returncode == 0 and "to start at" in t.stderr, t.stderr


def test_usr1_before_the_walltime_becomes_the_stop_file(slurm_cluster, job_env, tmp_path):  # noqa: F811
    """`--signal=B:USR1@T` reaches the batch shell (sent here at once with scancel --batch); the shell
    touches $HPCBERT_STOP_FILE, keeps waiting, and the 'training' (a stand-in that polls the stop
    file, as the training loop will) ends cleanly. The deadline is exported too."""
    waiter = tmp_path / "waiter.sh"
    waiter.write_text(f"""#!/usr/bin/env bash
echo "$HPCBERT_JOB_DEADLINE $HPCBERT_STOP_FILE $OMP_NUM_THREADS $(date +%s)" > {tmp_path}/started
for _ in $(seq 600); do [ -e "$HPCBERT_STOP_FILE" ] && {{ echo stopped > {tmp_path}/stopped; exit 0; }}; sleep 0.1; done
exit 3
""")
    waiter.chmod(0o755)
    env = dict(job_env, HPCBERT_BOOTSTRAP=str(waiter))
    job_id = submit(["--scheduler", "slurm", *CPU_JOB, "--stop-margin", "90", "--out-script", "job.sbatch", "--",
                     *TRAIN, "--out", tmp_path / "run"], env, tmp_path)
    for _ in range(200):
        if (tmp_path / "started").exists():
            break
        time.sleep(0.1)
    deadline, stop_file, threads, now = (tmp_path / "started").read_text().split()
    assert stop_file == str(tmp_path / "run" / "STOP") and threads == "1"
    assert 0 <= int(now) + 300 - 90 - int(deadline) <= 5
    assert slurm_cluster.run("scancel", "--signal=USR1", "--batch", job_id).returncode == 0
    info = slurm_cluster.wait(job_id, timeout=30)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job_output(tmp_path)
    assert (tmp_path / "stopped").exists() and (tmp_path / "run" / "STOP").exists()
    assert "USR1" in (tmp_path / f"hpcbert-{job_id}.out").read_text()
    assert "#SBATCH --signal=B:USR1@90\n" in (tmp_path / "job.sbatch").read_text()


def test_the_same_script_submitted_again_without_out_continues_the_run(slurm_cluster, job_env, tmp_path):  # noqa: F811
    """No --out: the run directory is runs/JOB_NAME, not one per job id. The first job stops at its
    deadline with a checkpoint; `sbatch` of the same script again resumes from that checkpoint, in
    the same directory (and is stopped, to keep the test short, with the stop file once it has
    trained a few steps). The job is CPU-only without --cpus-per-node: it gets the whole node
    (--exclusive), and its one worker every core of it."""
    train = ["--model", "bert-tiny", "--task", "synthetic", "--max-steps", "100000", "--batch-size", "32",
             "--log-every", "5", "--checkpoint-steps", "1000", "--no-do-eval"]
    # Deadline 20 s after the job starts (start-up takes about 5 s on a quiet 2-core machine, 10 s
    # beside the other test worker), as in the walltime test below.
    first = submit(["--scheduler", "slurm", "--nodes", "1", "--gpus-per-node", "0", "--walltime", "00:01:00",
                    "--stop-margin", "40", "--job-name", "resume-me", "--out-script", "job.sbatch", "--", *train],
                   job_env, tmp_path)
    info = slurm_cluster.wait(first, timeout=120)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job_output(tmp_path)
    run_dir = tmp_path / "runs" / "resume-me"
    s = read_summary(run_dir)
    assert s["stopped_by"] == "job_deadline" and s["steps"] > 0 and s["resumed_from_step"] is None
    assert CheckpointManager(run_dir / "checkpoints").latest().step == s["steps"]
    node = dict(re.findall(r"(\w+)=(\S*)", slurm_cluster.run("scontrol", "show", "node", "-o").stdout))
    assert info["NumCPUs"] == node["CPUTot"], (info["NumCPUs"], node["CPUTot"])  # the whole node
    log = (tmp_path / f"resume-me-{first}.out").read_text()
    assert f"1 node(s) x 1 process(es) x {node['CPUTot']} thread(s)" in log and f"run directory {run_dir}" in log

    r = slurm_cluster.run("sbatch", "--parsable", "job.sbatch", cwd=tmp_path, env=job_env)  # the same script
    assert r.returncode == 0, r.stderr
    second = r.stdout.strip().split(";")[0]
    for _ in range(600):  # until the second job logs a step past the first one's last
        if slurm_cluster.job(second).get("JobState") not in ("PENDING", "RUNNING"):
            break
        try:
            if read_metrics(run_dir)[-1]["step"] > s["steps"]:
                (run_dir / "STOP").touch()
                break
        except (ValueError, IndexError):  # a line being written; nothing yet
            pass
        time.sleep(0.2)
    info = slurm_cluster.wait(second, timeout=120)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job_output(tmp_path)
    resumed = read_summary(run_dir)
    assert resumed["resumed_from_step"] == s["steps"] and resumed["steps"] > s["steps"], resumed
    assert f"run directory {run_dir}" in (tmp_path / f"resume-me-{second}.out").read_text()
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["resume-me"]


def test_walltime_stop_then_resubmit_finishes_equal_to_an_uninterrupted_run(slurm_cluster, job_env, tmp_path):  # noqa: F811
    """A 1-minute walltime job that needs longer stops itself at the job deadline (walltime - margin)
    with a complete checkpoint and exit 0; submitting the same command again resumes and finishes; the
    result equals an uninterrupted run of the same options (every loss, the final parameters)."""
    # Enough steps that one job cannot finish them before its deadline (about 13 s of training: ~210
    # steps at the fastest 0.06 s/step seen, an AVX-512 host; 93 at 0.14 s/step on an older one). A slow
    # host needs more jobs; the loop below allows as many as the first job's pace asks for.
    n_steps = 400
    train = ["--model", "bert-tiny", "--task", "synthetic", "--max-steps", str(n_steps), "--batch-size", "32",
             "--threads", "1", "--log-every", "1", "--checkpoint-steps", "25", "--no-do-eval", "--precision", "fp32"]
    run_dir = tmp_path / "run"
    cmd = ["--scheduler", "slurm", "--nodes", "1", "--gpus-per-node", "0", "--procs-per-node", "2",
           "--cpus-per-node", "2", "--walltime", "00:01:00", "--stop-margin", "40", "--out-script", "job.sbatch",
           "--", *train, "--out", run_dir]
    first = submit(cmd, job_env, tmp_path)
    info = slurm_cluster.wait(first, timeout=120)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job_output(tmp_path)
    s = read_summary(run_dir)
    assert s["stopped_by"] == "job_deadline" and 0 < s["steps"] < n_steps, s["stopped_by"]
    assert CheckpointManager(run_dir / "checkpoints").latest().step == s["steps"]

    # The same command again, until the run is done: as many jobs as the first one's pace asks for,
    # twice over (a resumed job also loads a checkpoint); the bound only keeps a stuck run from looping.
    # A job whose start-up outlasts its 20-s window (a busy AVX2 host in CI: torch's import, the
    # checkpoint's load) stops at the deadline before its first step, as it must, leaving the run as
    # it found it; the next job goes on.
    for _ in range(2 * math.ceil((n_steps - s["steps"]) / s["steps"]) + 1):
        previous = s["steps"]
        job = submit(cmd, job_env, tmp_path)
        info = slurm_cluster.wait(job, timeout=120)
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job_output(tmp_path)
        s = read_summary(run_dir)
        assert s["resumed_from_step"] == previous and s["steps"] >= previous
        if s["steps"] == previous:
            assert s["stopped_by"] == "job_deadline", s["stopped_by"]
            assert CheckpointManager(run_dir / "checkpoints").latest().step == previous
        if s["stopped_by"] == "max_steps":
            break
    assert (s["stopped_by"], s["steps"]) == ("max_steps", n_steps)

    straight = tmp_path / "straight"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "hpcbert.cli", "train", *train, "--out", str(straight)],
                       env=dict(job_env), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    def losses(d):
        return [(m["step"], m["loss"]) for m in read_metrics(d)]
    assert losses(run_dir) == losses(straight)
    a = torch.load(run_dir / "checkpoints" / f"step-{n_steps:08d}" / "shared.pt", weights_only=False)["model"]
    b = torch.load(straight / "checkpoints" / f"step-{n_steps:08d}" / "shared.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
