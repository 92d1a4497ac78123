"""`hpcbert submit` and the job scripts, without a scheduler: directives per flavour, refused
options, quoting, the committed examples, the job-script contract (run with bash and stand-in
launchers), the container wrapper (stand-in apptainer) and the thin scripts in hpcai_scripts/.
The same scripts under a real Slurm are in test_slurm.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest

from conftest import run_env, ROOT
from hpcbert.jobs import submit
from hpcbert.jobs.submit import PRESETS, JobSpec, render

EXEC_SH = ROOT / "singularity" / "exec.sh"
TRAIN = ["--model", "bert-tiny", "--task", "synthetic", "--max-steps", "6"]
# The committed examples and the commands that make them (run from the repository root).
EXAMPLES = {
    f"hpcai_scripts/{preset}.{ext}": ["--scheduler", sched, "--preset", preset, "--container",
                                      "${HPCBERT_IMAGE:-hpcbert.sif}", "--portable", "--dry-run",
                                      "--out-script", f"hpcai_scripts/{preset}.{ext}"]
    for preset in ("baseline", "optimized", "pretrain") for sched, ext in (("pbs", "pbs"), ("slurm", "sbatch"))
}


def spec(scheduler="slurm", **kw) -> JobSpec:
    kw.setdefault("nodes", 2)
    kw.setdefault("gpus_per_node", 4)
    kw.setdefault("walltime", "01:30:00")
    kw.setdefault("train_args", TRAIN)
    return JobSpec(scheduler=scheduler, **kw)


def directive_lines(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


def stub(path: Path, body: str) -> Path:
    path.write_text(body)
    path.chmod(0o755)
    return path


def threads(text: str, **env: str) -> int:
    """OMP_NUM_THREADS as the script's CORES and OMP_NUM_THREADS lines set it, in this environment."""
    lines = [line for line in text.splitlines() if line.startswith(("CORES=", "export OMP_NUM_THREADS="))]
    assert len(lines) == 2, lines
    r = subprocess.run(["bash", "-c", "\n".join([*lines, 'echo "$OMP_NUM_THREADS"'])], capture_output=True,
                       text=True, env=dict(os.environ, **env), check=True)
    return int(r.stdout)


# --- directives -------------------------------------------------------------------------------

def test_slurm_directives_and_threads():
    text = render(spec("slurm", cpus_per_node=32, queue="gpu", account="proj1"), "cmd")
    assert directive_lines(text, "#SBATCH") == [
        "#SBATCH --job-name=hpcbert", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4", "#SBATCH --cpus-per-task=32", "#SBATCH --time=01:30:00",
        "#SBATCH --signal=B:USR1@540", "#SBATCH --partition=gpu", "#SBATCH --account=proj1",
        "#SBATCH --output=%x-%j.out"]
    assert threads(text, SLURM_CPUS_ON_NODE="64") == 8  # 32 cores asked for / 4 processes
    assert "CORES=32  # --cpus-per-node\n" in text
    assert 'srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task="$CORES"' in text
    assert '"$BOOTSTRAP" --nproc-per-node 4 --' in text
    assert "$(( $(date +%s) + 5400 - 540 ))" in text  # deadline: start + walltime - margin


def test_pbs_pro_directives_place_on_its_own_line():
    text = render(spec("pbs", cpus_per_node=20, project="P123", queue="dgx", account="acct"), "cmd")
    assert directive_lines(text, "#PBS") == [
        "#PBS -N hpcbert", "#PBS -l select=2:ncpus=20:ngpus=4:mpiprocs=1", "#PBS -l place=scatter",
        "#PBS -l walltime=01:30:00", "#PBS -P P123", "#PBS -A acct", "#PBS -q dgx", "#PBS -j oe"]
    assert "LAUNCH=(mpiexec -n 2 --ppn 1)" in text
    assert 'cd "${PBS_O_WORKDIR:-${SLURM_SUBMIT_DIR:-$PWD}}"' in text
    assert not directive_lines(text, "#SBATCH")  # and no advance signal in PBS: the deadline does it


def test_torque_directives_and_pbsdsh_once_per_node():
    text = render(spec("torque", cpus_per_node=16, account="acct"), "cmd")
    assert directive_lines(text, "#PBS") == [
        "#PBS -N hpcbert", "#PBS -l nodes=2:ppn=16:gpus=4", "#PBS -l walltime=01:30:00", "#PBS -A acct",
        "#PBS -j oe"]
    assert "LAUNCH=(pbsdsh -u -- /bin/bash" in text
    no_gpu = render(spec("torque", gpus_per_node=0, procs_per_node=2, cpus_per_node=4), "cmd")
    assert "#PBS -l nodes=2:ppn=4\n" in no_gpu


def test_a_cpu_job_gets_whole_nodes_and_threads_from_the_cores_it_was_given(job_sandbox):
    """--gpus-per-node 0 without --cpus-per-node: not one core per process but every core of each
    node (Slurm --exclusive, PBS Pro place=excl), split between the workers when the job starts."""
    tmp_path, env = job_sandbox
    slurm = render(spec("slurm", gpus_per_node=0, procs_per_node=2), "cmd")
    assert directive_lines(slurm, "#SBATCH")[:5] == [
        "#SBATCH --job-name=hpcbert", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive",
        "#SBATCH --time=01:30:00"]
    assert "--cpus-per-task" not in "".join(directive_lines(slurm, "#SBATCH"))
    r, rec = run_script(slurm, tmp_path, dict(env, SLURM_JOB_ID="3", SLURM_CPUS_ON_NODE="48",
                                              SLURM_SUBMIT_DIR=str(tmp_path)))
    assert r.returncode == 0, r.stderr
    assert rec["env"]["OMP_NUM_THREADS"] == "24"  # 48 cores / 2 workers
    assert (tmp_path / "record.json.launcher").read_text().startswith(
        "srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task=48 ")  # the bootstrap gets them all
    assert "2 node(s) x 2 process(es) x 24 thread(s)" in r.stderr

    pbs = render(spec("pbs", gpus_per_node=0, procs_per_node=2), "cmd")
    assert directive_lines(pbs, "#PBS")[1:3] == ["#PBS -l select=2:ncpus=2:mpiprocs=1", "#PBS -l place=scatter:excl"]
    stub(tmp_path / "bin" / "nproc", "#!/bin/sh\necho 36\n")  # the cores PBS lets the job use
    (tmp_path / "record.json.launcher").unlink()
    r, rec = run_script(pbs, tmp_path, dict(env, PBS_JOBID="9.server", PBS_O_WORKDIR=str(tmp_path),
                                            OMP_NUM_THREADS="2"))
    assert r.returncode == 0, r.stderr
    assert rec["env"]["OMP_NUM_THREADS"] == "18"  # PBS's 2 (= ncpus) replaced: 36 cores / 2 workers
    assert threads(pbs, SLURM_CPUS_ON_NODE="1") == 1  # never 0
    assert threads(render(spec("slurm", gpus_per_node=0, procs_per_node=2, cpus_per_node=6), "cmd")) == 3
    # Torque has no whole-node request that Slurm's #PBS reader takes: the cores must be given.
    with pytest.raises(ValueError, match="--cpus-per-node: a CPU-only Torque job needs it"):
        spec("torque", gpus_per_node=0)


@pytest.mark.parametrize("scheduler, option, words", [
    ("torque", ["--project", "P1"], ["--project", "torque", "proxy user"]),
    ("slurm", ["--project", "P1"], ["--project", "slurm", "--account"]),
    ("pbs", ["--launcher", "srun"], ["--launcher srun", "pbs", "mpiexec"]),
    ("torque", ["--launcher", "srun"], ["--launcher srun", "torque"]),
    ("slurm", ["--launcher", "mpiexec"], ["--launcher mpiexec", "slurm", "srun"]),
])
def test_options_a_scheduler_does_not_know_are_refused_with_the_reason(capsys, scheduler, option, words):
    rc = submit.cli(["--scheduler", scheduler, "--nodes", "1", "--gpus-per-node", "1", "--walltime", "00:10:00",
                     *option, "--dry-run", "--", *TRAIN])
    err = capsys.readouterr().err
    assert rc == 2 and all(w in err for w in words), err


@pytest.mark.parametrize("kw, words", [
    (dict(walltime="90m"), ["--walltime", "HH:MM:SS"]),
    (dict(walltime="00:00:00"), ["--walltime"]),
    (dict(binds=["/a:/b"]), ["--bind", "--container"]),
    (dict(container="x.sif", binds=["/a:/b,/c"]), ["--bind", "comma"]),
    (dict(procs_per_node=2), ["--procs-per-node", "one process per GPU"]),
    (dict(gpus_per_node=0, procs_per_node=4, cpus_per_node=2), ["--cpus-per-node", "4 processes"]),
    (dict(stop_margin=5400), ["--stop-margin", "below the walltime"]),
    (dict(train_args=["--batch-size", "many"]), ["batch_size", "'many'", "integer >= 1 or 'auto'"]),
    (dict(train_args=["--bogus", "1"]), ["--bogus", "hpcbert train"]),
    (dict(train_args=["--task", "sst-2", "--data-dir", "/glue", "--regression"]),
     ["regression: an option of classify, not used by --task sst-2"]),
    (dict(train_args=["--poly-power", "0.5"]), ["poly_power", "--lr-decay poly"]),
    (dict(job_name="two words"), ["--job-name"]),
    (dict(queue="a b"), ["--queue"]),
])
def test_impossible_jobs_are_refused_naming_the_option(kw, words):
    with pytest.raises(ValueError) as e:
        spec("slurm", **kw)
    assert all(w in str(e.value) for w in words), str(e.value)


# A site's directives: accepted where hpcbert does not write the option, refused (naming the option that
# sets it) where it does, long options under any abbreviation sbatch accepts (getopt_long).
@pytest.mark.parametrize("scheduler, directive, words", [
    ("slurm", "--time=02:00:00", ["--directive", "--time", "--walltime"]),
    ("slurm", "--part=gpu", ["--partition", "--queue"]),
    ("slurm", "-N 4", ["--nodes", "--nodes"]),
    ("slurm", "#SBATCH -c 8", ["--cpus-per-task", "--cpus-per-node"]),
    ("slurm", "--gres=gpu:a100:4", ["--gres", "--gpus-per-node"]),
    ("slurm", "--exclusive", ["--exclusive", "--cpus-per-node"]),
    ("slurm", "#PBS -l mem=1GB", ["#PBS line", "#SBATCH"]),
    ("slurm", "qos=high", ["not a scheduler option", "--qos=high"]),
    ("slurm", "--qos=high\n#SBATCH --time=09:00:00", ["line break"]),
    ("pbs", "-l walltime=02:00:00", ["-l walltime", "--walltime"]),
    ("pbs", "-l mem=64GB,ngpus=2", ["-l ngpus", "--gpus-per-node"]),
    ("pbs", "#PBS -l select=1:ncpus=48", ["-l select"]),
    ("pbs", "-q express", ["-q", "--queue"]),
    ("torque", "-l nodes=1:ppn=4", ["-l nodes", "--nodes"]),
    ("torque", "#SBATCH --qos=high", ["#SBATCH line", "#PBS"]),
])
def test_a_site_directive_hpcbert_writes_itself_is_refused_naming_the_option(scheduler, directive, words):
    with pytest.raises(ValueError) as e:
        spec(scheduler, cpus_per_node=4, extra_directives=[directive])
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("setup", ["", "  ", "module load a\nmodule load b"])
def test_a_setup_line_is_one_line(setup):
    with pytest.raises(ValueError, match="--setup: .* one shell line per --setup"):
        spec("slurm", setup=[setup])


def test_site_directives_follow_hpcberts_own_before_the_first_command(capsys):
    base = ["--nodes", "2", "--gpus-per-node", "4", "--walltime", "01:30:00", "--cpus-per-node", "8", "--dry-run"]
    accepted = {"slurm": ["--directive=--qos=high", "--directive", "#SBATCH -C a100", "--directive=--mem=0",
                          "--directive=--gpu-bind=closest", "--directive=--nodelist=n[1-2]",
                          "--directive=--gres=lscratch:100"],
                "pbs": ["--directive", "-l mem=64GB,jobfs=100GB", "--directive",
                        "#PBS -l storage=gdata/ab12+scratch/ab12", "--directive", "-W group_list=ai",
                        "--directive", "-m abe"]}
    expected = {"slurm": ["#SBATCH --qos=high", "#SBATCH -C a100", "#SBATCH --mem=0", "#SBATCH --gpu-bind=closest",
                          "#SBATCH --nodelist=n[1-2]", "#SBATCH --gres=lscratch:100"],
                "pbs": ["#PBS -l mem=64GB,jobfs=100GB", "#PBS -l storage=gdata/ab12+scratch/ab12",
                        "#PBS -W group_list=ai", "#PBS -m abe"]}
    for scheduler, prefix in (("slurm", "#SBATCH"), ("pbs", "#PBS")):
        plain = render(spec(scheduler, cpus_per_node=8), "cmd")
        assert submit.cli(["--scheduler", scheduler, *base, *accepted[scheduler], "--", *TRAIN]) == 0
        text = capsys.readouterr().out
        lines = text.splitlines()
        assert directive_lines(text, prefix) == directive_lines(plain, prefix) + expected[scheduler]
        # sbatch and qsub read directives only up to the first command
        assert lines.index(expected[scheduler][-1]) < lines.index("set -euo pipefail")


def test_setup_lines_run_in_order_before_the_launch_and_a_failure_stops_the_job(job_sandbox):
    tmp_path, env = job_sandbox
    env = dict(env, SLURM_SUBMIT_DIR=str(tmp_path))
    ok = render(spec("slurm", gpus_per_node=0, procs_per_node=2, cpus_per_node=2, setup=[
        "export SITE_SETUP=$(( 6 * 7 ))", "export SITE_SETUP=${SITE_SETUP}:${NOT_SET_ANYWHERE}x  # read unset"]),
        "cmd")
    r, rec = run_script(ok, tmp_path, env)
    assert r.returncode == 0, r.stderr
    assert rec["env"]["SITE_SETUP"] == "42:x"  # both, in order, under set +u, and exported to the bootstrap
    for setup, failed, status in ((["export A=1", "no_such_site_command --flag", "export SITE_SETUP=late"],
                                   "no_such_site_command --flag", 127),
                                  (["module() { false; echo loaded; }", "module load apptainer"], "false", 1)):
        text = render(spec("slurm", gpus_per_node=0, procs_per_node=2, cpus_per_node=2, setup=setup), "cmd")
        (tmp_path / "record.json").unlink(missing_ok=True)
        r, rec = run_script(text, tmp_path, env)
        assert r.returncode == status and rec == {}, r.stderr  # nothing launched
        assert f"hpcbert job: --setup failed (status {status}): {failed}" in r.stderr
        assert "loaded" not in r.stdout
    # set -u is back after the set-up: the script's own unset variables are still errors
    assert "set +E -u\ntrap - ERR\n" in text and "set -E +u" in text


def test_a_preset_under_another_task_leaves_out_what_that_task_does_not_read():
    ns = submit.parser().parse_args(["--scheduler", "slurm", "--preset", "baseline"])
    s = submit.spec_from_args(ns, ["--task", "synthetic"])
    assert "--data-dir" not in s.train_args and s.train_args[-2:] == ["--task", "synthetic"]
    assert submit.check_train_args(s.train_args).task == "synthetic"
    kept = submit.spec_from_args(ns, ["--task", "sst-2"]).train_args  # a GLUE task reads the kit's --data-dir
    assert kept[kept.index("--data-dir") + 1] == "${GLUE_DIR:?set GLUE_DIR to the GLUE directory}"
    with pytest.raises(ValueError, match="^data_dir: an option of GLUE tasks and mlm, not used by --task synthetic"):
        submit.check_train_args(submit.spec_from_args(ns, ["--task", "synthetic", "--data-dir", "d"]).train_args)


def test_presets_are_resources_plus_train_options_and_user_options_win():
    ns = submit.parser().parse_args(["--scheduler", "pbs", "--preset", "optimized"])
    s = submit.spec_from_args(ns, [])
    assert (s.nodes, s.gpus_per_node, s.procs_per_node, s.cpus_per_node) == (2, 4, 4, 20)
    cfg = submit.check_train_args(s.train_args)
    assert (cfg.batch_size, cfg.grad_ckpt, cfg.task, cfg.optimizer) == (48, "alternate", "mnli", "lamb")
    ns = submit.parser().parse_args(["--scheduler", "pbs", "--preset", "baseline", "--gpus-per-node", "2"])
    s = submit.spec_from_args(ns, ["--batch-size", "32"])
    assert (s.nodes, s.gpus_per_node) == (1, 2)
    cfg = submit.check_train_args(s.train_args)
    assert (cfg.batch_size, cfg.grad_ckpt) == (32, "none")
    assert PRESETS["baseline"].resources["gpus_per_node"] == 1 and PRESETS["baseline"].train["batch_size"] == 24


def test_missing_resources_name_the_options(capsys):
    assert submit.cli(["--scheduler", "slurm", "--nodes", "1", "--dry-run"]) == 2
    assert "--gpus-per-node, --walltime" in capsys.readouterr().err


# --- rendering ----------------------------------------------------------------------------------

def test_rendering_is_deterministic_and_portable_mode_holds_no_machine_paths():
    for sched in ("pbs", "torque", "slurm"):
        s = spec(sched, container="${HPCBERT_IMAGE:-hpcbert.sif}", binds=["/scratch:/scratch"])
        a, b = render(s, "cmd"), render(s, "cmd")
        assert a == b
        for local in (str(ROOT), sys.executable, os.path.expanduser("~"), "/tmp/", str(Path.cwd())):
            assert local not in a, local
        assert not re.search(r"\d{4}-\d\d-\d\d", a)  # no render-time date
    recorded = render(spec("slurm"), "cmd", workdir="/some/dir", python="/opt/py/bin/python3", kit="/kit")
    assert 'cd "${SLURM_SUBMIT_DIR:-/some/dir}"' in recorded
    assert 'HPCBERT_PYTHON="${HPCBERT_PYTHON:-/opt/py/bin/python3}"' in recorded
    assert 'HPCBERT_KIT="${HPCBERT_KIT:-/kit}"' in recorded


def test_committed_example_scripts_are_what_the_generator_makes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for name, argv in EXAMPLES.items():
        assert submit.cli(argv) == 0, capsys.readouterr().err
        made = (tmp_path / name).read_text()
        committed = (ROOT / name).read_text() if (ROOT / name).exists() else ""
        regen = f"cd {ROOT} && PYTHONPATH=BERT {Path(sys.executable).name} -m hpcbert.cli submit {shlex.join(argv)}"
        assert committed == made, f"{name} differs from what `hpcbert submit` makes; regenerate it:\n  {regen}"
        assert os.access(ROOT / name, os.X_OK), f"{name} is not executable"
        assert subprocess.run(["bash", "-n", ROOT / name]).returncode == 0
        assert f"#   hpcbert submit {shlex.join(argv)}" in made  # the script says how it was made


# --- the job script's contract, run with bash and stand-in launchers -----------------------------

RECORDER = """#!{python}
# stand-in bootstrap: records its arguments, working directory and the job's environment
import json, os, sys
names = ["OMP_NUM_THREADS", "HPCBERT_JOB_DEADLINE", "HPCBERT_STOP_FILE", "HPCBERT_PYTHON", "HPCBERT_KIT",
         "HPCBERT_WRAPPER", "HPCBERT_IMAGE", "HPCBERT_BINDS", "HPCBERT_NV", "GLUE_DIR", "NCCL_SOCKET_IFNAME",
         "PYTORCH_CUDA_ALLOC_CONF", "UNRELATED", "SITE_SETUP", "SITE_CHANGED", "SITE_LOCAL"]
json.dump({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": {{k: os.environ.get(k) for k in names}},
           "stop_file_existed": os.path.exists(os.environ["HPCBERT_STOP_FILE"])}},
          open(os.environ["HPCBERT_TEST_LOG"], "w"))
"""
# A launcher stand-in: records its own arguments, then runs the command after its options.
LAUNCHER = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$HPCBERT_TEST_LOG.launcher"
while [ $# -gt 0 ]; do case $1 in --) shift; break ;; -n|--ppn) shift 2 ;; -*) shift ;; *) break ;; esac; done
exec "$@"
"""


@pytest.fixture
def job_sandbox(tmp_path):
    """Stand-in bootstrap and launchers (srun, mpiexec, pbsdsh) on PATH, and a clean job environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub(bin_dir / "bootstrap.sh", RECORDER.format(python=sys.executable))
    for tool in ("srun", "mpiexec", "pbsdsh"):
        stub(bin_dir / tool, LAUNCHER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_", "HPCBERT_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", HPCBERT_BOOTSTRAP=str(bin_dir / "bootstrap.sh"),
               HPCBERT_TEST_LOG=str(tmp_path / "record.json"))
    return tmp_path, env


def run_script(text: str, tmp_path: Path, env: dict, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    script = stub(tmp_path / "job.sh", text)
    r = subprocess.run(["bash", str(script), *args], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    rec = tmp_path / "record.json"
    return r, (json.loads(rec.read_text()) if rec.exists() else {})


def test_train_options_reach_the_bootstrap_word_for_word(job_sandbox):
    tmp_path, env = job_sandbox
    odd = ["--tokenizer", "a dir/with 'quotes' and \"double\" $HOME `x` ; rm -rf /", "--seed", "7",
           "--cache-dir", "line1\nline2", "--task", "mrpc", "--data-dir", "${GLUE_DIR:?set GLUE_DIR}"]
    s = spec("slurm", nodes=1, gpus_per_node=0, procs_per_node=2, cpus_per_node=2, walltime="00:10:00",
             train_args=[*TRAIN, *odd, "--out", "my runs/run 1"])
    text = render(s, "cmd")
    submit_dir = tmp_path / "submit dir"
    submit_dir.mkdir()
    (submit_dir / "my runs" / "run 1").mkdir(parents=True)
    (submit_dir / "my runs" / "run 1" / "STOP").touch()  # a stale stop request from an earlier job
    env.update(SLURM_SUBMIT_DIR=str(submit_dir), GLUE_DIR="/data/glue")
    t0 = time.time()
    r, rec = run_script(text, tmp_path, env, "--lr", "1e-4")
    assert r.returncode == 0, r.stderr
    expected = [*TRAIN, *odd[:-1], "/data/glue", "--out", "my runs/run 1", "--lr", "1e-4"]
    assert rec["argv"] == ["--nproc-per-node", "2", "--", *expected]
    assert rec["cwd"] == str(submit_dir)
    run_dir = submit_dir / "my runs" / "run 1"
    assert rec["env"]["HPCBERT_STOP_FILE"] == str(run_dir / "STOP") and not rec["stop_file_existed"]
    assert rec["env"]["OMP_NUM_THREADS"] == "1"
    assert abs(int(rec["env"]["HPCBERT_JOB_DEADLINE"]) - (t0 + 600 - 60)) < 5
    launcher = (tmp_path / "record.json.launcher").read_text()
    assert launcher.startswith("srun --nodes=1 --ntasks=1 --ntasks-per-node=1 --cpus-per-task=2")
    assert "launcher exited with status 0" in r.stderr
    # An unset ${GLUE_DIR:?...} stops the job before anything starts, with the message.
    del env["GLUE_DIR"]
    (tmp_path / "record.json").unlink()
    r, rec = run_script(text, tmp_path, env)
    assert r.returncode != 0 and "set GLUE_DIR" in r.stderr and rec == {}


def test_default_run_directory_is_named_after_the_job_so_a_resubmitted_job_continues_it(job_sandbox):
    """Without --out every job of the same name trains in runs/NAME (not a new directory per job id),
    so training's default `--resume auto` under a scheduler finds the previous job's checkpoint."""
    tmp_path, env = job_sandbox
    text = render(spec("slurm", job_name="mrpc"), "cmd")
    assert "# Run directory: runs/mrpc (named after the job, not the job id).\n" in text
    run_dir = tmp_path / "runs" / "mrpc"
    for job_id in ("4242", "4243"):
        r, rec = run_script(text, tmp_path, dict(env, SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_ID=job_id))
        assert r.returncode == 0, r.stderr
        assert rec["argv"][-2:] == ["--out", str(run_dir)]
        assert rec["env"]["HPCBERT_STOP_FILE"] == str(run_dir / "STOP")
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["mrpc"]
    given = render(spec("slurm", job_name="mrpc", train_args=[*TRAIN, "--out", "elsewhere"]), "cmd")
    assert "# Run directory: elsewhere (--out).\n" in given


def test_a_second_job_in_a_run_directory_in_use_is_refused(job_sandbox):
    """Jobs of one name share a run directory: while one holds it, another stops before starting."""
    import fcntl
    tmp_path, env = job_sandbox
    text = render(spec("slurm", job_name="mrpc"), "cmd")
    run_dir = tmp_path / "runs" / "mrpc"
    run_dir.mkdir(parents=True)
    with open(run_dir / "job.lock", "w") as held:
        held.write("4242\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # job 4242 is running
        r, rec = run_script(text, tmp_path, dict(env, SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_ID="4243"))
    assert r.returncode == 2 and rec == {}, r.stderr
    assert f"{run_dir} is in use by job 4242" in r.stderr and "--job-name" in r.stderr
    r, rec = run_script(text, tmp_path, dict(env, SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_ID="4244"))
    assert r.returncode == 0 and rec["argv"][-2:] == ["--out", str(run_dir)], r.stderr  # released: it runs
    assert (run_dir / "job.lock").read_text() == "4244\n"


def test_pbs_script_uses_mpiexec_under_pbs_and_srun_under_slurms_qsub(job_sandbox):
    tmp_path, env = job_sandbox
    text = render(spec("pbs", cpus_per_node=8), "cmd")
    pbs_env = dict(env, PBS_JOBID="77.server", PBS_O_WORKDIR=str(tmp_path), OMP_NUM_THREADS="64")
    r, rec = run_script(text, tmp_path, pbs_env)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "record.json.launcher").read_text() == f"mpiexec -n 2 --ppn 1 {env['HPCBERT_BOOTSTRAP']} " \
        f"--nproc-per-node 4 -- {' '.join(TRAIN)} --out {tmp_path}/runs/hpcbert\n"
    assert rec["env"]["OMP_NUM_THREADS"] == "2"  # PBS's 64 (= ncpus) replaced: 8 cores / 4 workers
    (tmp_path / "record.json.launcher").unlink()
    r, rec = run_script(text, tmp_path, dict(env, SLURM_JOB_ID="5", SLURM_SUBMIT_DIR=str(tmp_path)))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "record.json.launcher").read_text().startswith("srun --nodes=2 --ntasks=2")


def test_pbsdsh_gets_the_directory_and_environment_back(job_sandbox):
    """pbsdsh starts tasks in $HOME with a bare environment (the stand-in runs `env -i`)."""
    tmp_path, env = job_sandbox
    stub(tmp_path / "bin" / "pbsdsh", LAUNCHER.replace('exec "$@"', 'cd / && exec env -i "$@"'))
    text = render(spec("pbs", launcher="pbsdsh", gpus_per_node=0, procs_per_node=3, cpus_per_node=6), "cmd")
    r, rec = run_script(text, tmp_path, dict(env, PBS_JOBID="8", PBS_O_WORKDIR=str(tmp_path), NCCL_SOCKET_IFNAME="ib0",
                                             PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False", UNRELATED="no"))
    assert r.returncode == 0, r.stderr
    assert rec["cwd"] == str(tmp_path) and rec["env"]["OMP_NUM_THREADS"] == "2"
    # the user's communication and allocator settings reach every node; what a run does not read stays out
    assert rec["env"]["NCCL_SOCKET_IFNAME"] == "ib0" and rec["env"]["UNRELATED"] is None
    assert rec["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
    assert rec["env"]["HPCBERT_STOP_FILE"] == str(tmp_path / "runs" / "hpcbert" / "STOP")
    assert (tmp_path / "record.json.launcher").read_text().startswith("pbsdsh -- /bin/bash -c")


# ssh stand-in: `ssh -o BatchMode=yes HOST COMMAND` runs COMMAND in a bare login shell, in /
SSH = """#!/usr/bin/env bash
echo "ssh $*" >> "$HPCBERT_TEST_LOG.launcher"
shift 2; shift
cd / && exec env -i HPCBERT_TEST_LOG="$HPCBERT_TEST_LOG" /bin/bash -c "$*"
"""


@pytest.mark.parametrize("launcher", ["pbsdsh", "ssh"])
def test_pbsdsh_and_ssh_pass_on_what_the_setup_lines_set_or_changed(job_sandbox, launcher):
    """They start each node with a bare environment and pass on the variables they name: with them,
    every variable the --setup lines exported or changed (module load sets variables of its own:
    CUDA_HOME, MODULEPATH, a library's); what the job had before and the set-up left alone stays out,
    and so does a variable the set-up did not export."""
    tmp_path, env = job_sandbox
    stub(tmp_path / "bin" / "pbsdsh", LAUNCHER.replace('exec "$@"', 'cd / && exec env -i "$@"'))
    stub(tmp_path / "bin" / "ssh", SSH)
    (tmp_path / "nodes").write_text("n1\nn1\n")
    setup = ["export SITE_SETUP='a b'", "export SITE_CHANGED=after", "SITE_LOCAL=1", "export UNRELATED=no"]
    text = render(spec("pbs", launcher=launcher, nodes=1, gpus_per_node=0, procs_per_node=1, cpus_per_node=2,
                       setup=setup), "cmd")
    r, rec = run_script(text, tmp_path, dict(env, PBS_JOBID="8", PBS_O_WORKDIR=str(tmp_path),
                                             PBS_NODEFILE=str(tmp_path / "nodes"), UNRELATED="no",
                                             SITE_CHANGED="before"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "record.json.launcher").read_text().startswith(launcher)
    assert rec["cwd"] == str(tmp_path)
    assert rec["env"]["SITE_SETUP"] == "a b" and rec["env"]["SITE_CHANGED"] == "after"
    assert rec["env"]["UNRELATED"] is None and rec["env"]["SITE_LOCAL"] is None
    # without set-up lines nothing more is passed on than before
    text = render(spec("pbs", launcher=launcher, nodes=1, gpus_per_node=0, procs_per_node=1, cpus_per_node=2), "cmd")
    r, rec = run_script(text, tmp_path, dict(env, PBS_JOBID="9", PBS_O_WORKDIR=str(tmp_path),
                                             PBS_NODEFILE=str(tmp_path / "nodes"), SITE_SETUP="x", SITE_CHANGED="y"))
    assert r.returncode == 0, r.stderr
    assert rec["env"]["SITE_SETUP"] is None and rec["env"]["SITE_CHANGED"] is None


def test_container_settings_are_exported_for_the_bootstrap(job_sandbox):
    tmp_path, env = job_sandbox
    text = render(spec("slurm", container="${HPCBERT_IMAGE:-hpcbert.sif}", binds=["/scratch:/scratch", "/d:/d:ro"]),
                  "cmd", workdir=str(tmp_path), python="/host/python", kit="/kit")
    r, rec = run_script(text, tmp_path, env)
    assert r.returncode == 0, r.stderr
    assert rec["env"]["HPCBERT_WRAPPER"] == "/kit/singularity/exec.sh"
    assert rec["env"]["HPCBERT_IMAGE"] == "hpcbert.sif" and rec["env"]["HPCBERT_BINDS"] == "/scratch:/scratch,/d:/d:ro"
    assert rec["env"]["HPCBERT_NV"] == "1"
    assert rec["env"]["HPCBERT_PYTHON"] == "python3"  # the image's interpreter, not this machine's


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_a_signal_to_the_batch_shell_becomes_the_stop_file_and_the_job_waits(job_sandbox, sig):
    """Slurm's --signal=B:USR1 and the walltime's SIGTERM reach the batch shell: it touches
    $HPCBERT_STOP_FILE and keeps waiting while training (here a stand-in that polls the file, as the
    training loop will) finishes."""
    tmp_path, env = job_sandbox
    stub(tmp_path / "bin" / "bootstrap.sh", """#!/usr/bin/env bash
trap '' TERM   # the stand-in 'training' survives SIGTERM, as a checkpointing loop does
touch "$HPCBERT_TEST_LOG.started"
for _ in $(seq 300); do [ -e "$HPCBERT_STOP_FILE" ] && { sleep 0.5; echo done > "$HPCBERT_TEST_LOG.done"; exit 0; }; sleep 0.05; done
exit 3
""")
    script = stub(tmp_path / "job.sh", render(spec("slurm", nodes=1, gpus_per_node=0), "cmd"))
    proc = subprocess.Popen(["bash", str(script)], env=dict(env, SLURM_SUBMIT_DIR=str(tmp_path)), cwd=tmp_path,
                            stderr=subprocess.PIPE, text=True)
    started = Path(env["HPCBERT_TEST_LOG"] + ".started")
    for _ in range(200):
        if started.exists():
            break
        time.sleep(0.05)
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert (tmp_path / "runs" / "hpcbert" / "STOP").exists()
    assert Path(env["HPCBERT_TEST_LOG"] + ".done").exists()  # the job waited for training to end
    assert f"{sig.name.removeprefix('SIG')} at" in err and "launcher exited with status 0" in err


# --- the container wrapper ------------------------------------------------------------------------

FAKE_RUNTIME = """#!/usr/bin/env bash
# stand-in apptainer/singularity: records arguments and the *ENV_ variables, runs the command after the image
printf '%s\\n' "$@" > "$HPCBERT_TEST_LOG"
env | grep -E '^(APPTAINER|SINGULARITY)ENV_' | sort > "$HPCBERT_TEST_LOG.env"
[ "$1" = exec ] && shift
while [ $# -gt 0 ]; do case $1 in --bind|-B|--env) shift 2 ;; -*) shift ;; *) shift; break ;; esac; done
exec "$@"
"""


@pytest.fixture
def container_sandbox(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCBERT_", "CUDA_VISIBLE"))}
    # PATH without any real runtime or nvidia-smi: this dir, then only the basic system tools.
    env.update(PATH=f"{bin_dir}:/usr/bin:/bin", HPCBERT_TEST_LOG=str(tmp_path / "args"))
    return tmp_path, bin_dir, env


def wrap(env, *args):
    return subprocess.run([str(EXEC_SH), *args], env=env, capture_output=True, text=True, timeout=30)


def test_exec_sh_runs_the_command_in_apptainer_with_gpu_binds_and_the_rendezvous(container_sandbox):
    tmp_path, bin_dir, env = container_sandbox
    stub(bin_dir / "apptainer", FAKE_RUNTIME)
    stub(bin_dir / "singularity", FAKE_RUNTIME.replace("printf", "echo singularity-used >&2; printf"))
    env.update(CUDA_VISIBLE_DEVICES="0,1,2,3", MASTER_ADDR="node01", NODE_RANK="1", SLURM_JOB_ID="99",
               HPCBERT_BINDS="/scratch:/scratch", HPCBERT_CONTAINER_ENV="MY_VAR", MY_VAR="x,y", UNRELATED="no",
               PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False,max_split_size_mb:512")
    r = wrap(env, "--image", "img.sif", "--bind", "/data:/data:ro", "--", "sh", "-c", 'echo "ran $0 $1"', "a b")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "ran a b \n"
    assert (tmp_path / "args").read_text().splitlines() == [
        "exec", "--nv", "--cleanenv", "--bind", "/scratch:/scratch", "--bind", "/data:/data:ro",
        "--env", "PYTHONNOUSERSITE=1", "--bind", str(ROOT), "img.sif", "sh", "-c", 'echo "ran $0 $1"', "a b"]
    passed = (tmp_path / "args.env").read_text().splitlines()
    for line in ("APPTAINERENV_CUDA_VISIBLE_DEVICES=0,1,2,3", "APPTAINERENV_MASTER_ADDR=node01",
                 "APPTAINERENV_NODE_RANK=1", "APPTAINERENV_SLURM_JOB_ID=99", "APPTAINERENV_MY_VAR=x,y",
                 # a user's allocator settings, whole (without them hpcbert inside sets expandable segments)
                 "APPTAINERENV_PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False,max_split_size_mb:512",
                 f"APPTAINERENV_PYTHONPATH={ROOT / 'BERT'}"):
        assert line in passed
    assert not [p for p in passed if "UNRELATED" in p]
    assert "singularity-used" not in r.stderr  # apptainer first


def test_exec_sh_falls_back_to_singularity_and_drops_nv_without_a_gpu(container_sandbox):
    tmp_path, bin_dir, env = container_sandbox
    stub(bin_dir / "singularity", FAKE_RUNTIME)
    env.update(HPCBERT_IMAGE="from-env.sif", OMP_NUM_THREADS="3")
    r = wrap(env, "--", "true")
    assert r.returncode == 0, r.stderr
    args = (tmp_path / "args").read_text().splitlines()
    assert args == ["exec", "--cleanenv", "--env", "PYTHONNOUSERSITE=1", "--bind", str(ROOT), "from-env.sif", "true"]
    assert "SINGULARITYENV_OMP_NUM_THREADS=3" in (tmp_path / "args.env").read_text()
    r = wrap(dict(env, HPCBERT_NV="1"), "--no-cleanenv", "--", "true")
    assert (tmp_path / "args").read_text().splitlines()[:3] == ["exec", "--nv", "--env"]


# A stand-in runtime that does what matters here as apptainer does: --cleanenv drops the host's
# environment, APPTAINERENV_NAME becomes NAME inside, and the image's own packages (IMAGE_SITE, which
# holds an hpcbert of its own, as the image built from hpcbert.def does) come after PYTHONPATH.
CLEANENV_RUNTIME = """#!/usr/bin/env bash
[ "$1" = exec ] && shift
inside=()
while [ $# -gt 0 ]; do
  case $1 in --cleanenv) inside=(env -i HOME="$HOME" PATH=/usr/bin:/bin); shift ;; --env) inside+=("$2"); shift 2 ;;
             --bind|-B) shift 2 ;; -*) shift ;; *) shift; break ;; esac
done
[ ${{#inside[@]}} -gt 0 ] || inside=(env)
for v in $(compgen -e); do case $v in APPTAINERENV_*) inside+=("${{v#APPTAINERENV_}}=${{!v}}") ;; esac; done
pp=$(for w in "${{inside[@]}}"; do case $w in PYTHONPATH=*) printf %s "${{w#PYTHONPATH=}}:" ;; esac; done)
exec "${{inside[@]}}" PYTHONPATH="$pp{image_site}" "$@"
"""


def test_the_container_runs_this_checkouts_hpcbert_not_the_images(container_sandbox):
    """The launcher on the host is this checkout's (bootstrap.sh); the training inside the image must
    be the same code, not the hpcbert installed in the image when it was built."""
    tmp_path, bin_dir, env = container_sandbox
    image_site = tmp_path / "image-site-packages"
    (image_site / "hpcbert").mkdir(parents=True)
    (image_site / "hpcbert" / "__init__.py").write_text("")  # the image's own (older) hpcbert
    stub(bin_dir / "apptainer", CLEANENV_RUNTIME.format(image_site=image_site))
    which = "import hpcbert, os; print(os.path.realpath(hpcbert.__file__))"
    env.update(PYTHONPATH=str(tmp_path / "host-only"))  # the host's PYTHONPATH stays out
    r = wrap(env, "--image", "img.sif", "--", sys.executable, "-c", which)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(ROOT / "BERT" / "hpcbert" / "__init__.py")
    # ... because the checkout is bound into the container at its own path.
    stub(bin_dir / "apptainer", FAKE_RUNTIME)
    assert wrap(env, "--image", "img.sif", "--", "true").returncode == 0
    args = (tmp_path / "args").read_text().splitlines()
    assert args[:args.index("img.sif")][-2:] == ["--bind", str(ROOT)]


@pytest.mark.parametrize("args, words", [
    (["--image", "x.sif", "--", "true"], ["neither apptainer nor singularity"]),
    (["--", "true"], ["no image"]),
    (["--image", "x.sif"], ["no command"]),
    (["--image", "x.sif", "--bogus", "--", "true"], ["unknown option --bogus"]),
])
def test_exec_sh_errors_say_what_to_do(container_sandbox, args, words):
    _, _, env = container_sandbox
    r = wrap(env, *args)
    assert r.returncode == 2 and all(w in r.stderr for w in words), r.stderr


# --- the container definition, its sections run with stand-ins ------------------------------------

DEF_FILE = ROOT / "singularity" / "hpcbert.def"
DEF_SECTIONS = {"arguments", "setup", "files", "post", "environment", "runscript", "startscript", "test", "labels",
                "help"}
# What `python -m pip list --format=freeze` says in the NGC image: a pre-release torch of NVIDIA's
# build, which no index has, and a torchvision that must not be mistaken for torch.
IMAGE_FREEZE = "numpy==1.24.4\ntorch==2.4.0a0+07cecf4\ntorchvision==0.19.0a0+d23a6e1\nPyYAML==6.0.1\n"
# Stand-in `python` for %post: records each call (argv, JSON, one line) and answers `pip list`.
FAKE_IMAGE_PYTHON = """#!{python}
import json, os, sys
with open(os.environ["HPCBERT_TEST_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1:4] == ["-m", "pip", "list"]:
    sys.stdout.write({freeze!r})
"""


def definition(text: str) -> tuple[dict, dict]:
    """An Apptainer definition file: header keywords, and each %section's body (dedented), with the
    {{ NAME }} build arguments replaced by their %arguments defaults, as `apptainer build` does."""
    header: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    name = None
    for n, line in enumerate(text.splitlines(), 1):
        m = re.fullmatch(r"%(\w+)\s*", line)
        if m:
            name = m.group(1)
            assert name in DEF_SECTIONS and name not in sections, f"{DEF_FILE.name}:{n}: section %{name}"
            sections[name] = []
        elif name:
            sections[name].append(line)
        elif line.strip() and not line.startswith("#"):
            key, sep, value = line.partition(":")
            assert sep, f"{DEF_FILE.name}:{n}: header line without 'Keyword: value': {line!r}"
            header[key.strip()] = value.strip()
    body = {k: textwrap.dedent("\n".join(v)).strip("\n") + "\n" for k, v in sections.items()}
    args = dict(line.split("=", 1) for line in body.get("arguments", "").split())
    def fill(t):
        return re.sub(r"{{\s*(\w+)\s*}}", lambda m: args[m.group(1)], t)  # KeyError: used but not defined
    return {k: fill(v) for k, v in header.items()}, {k: fill(v) for k, v in body.items()}


def test_definition_file_sections_keep_the_images_torch_and_install_this_checkout(tmp_path):
    """Apptainer is not installable here, so the build is replayed: %files are copied into a stand-in
    root, %post runs under /bin/sh -e with a stand-in `python` that answers `pip list` as the NGC
    image would and records every pip call; %environment, %runscript and %test run with this
    machine's interpreter in the image's place."""
    header, sec = definition(DEF_FILE.read_text())
    assert header["Bootstrap"] == "docker"
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", header["From"]), header["From"]
    # %files, from the repository root (where the header says to build), into a stand-in root.
    rootfs = tmp_path / "rootfs"
    dests = []
    for line in sec["files"].splitlines():
        src, dest = line.split()
        assert (ROOT / src).exists(), f"%files: {src} is not in the repository"
        target = rootfs / dest.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(ROOT / src)
        dests.append(dest)
    inside = lambda t: re.sub(r"(?<![\w/])/opt/", f"{rootfs}/opt/", t)  # the image's /opt is rootfs/opt
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub(bin_dir / "python", FAKE_IMAGE_PYTHON.format(python=sys.executable, freeze=IMAGE_FREEZE))
    log = tmp_path / "calls.jsonl"
    r = subprocess.run(["/bin/sh", "-e", "-c", inside(sec["post"])], cwd=tmp_path, capture_output=True, text=True,
                       env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "HPCBERT_TEST_LOG": str(log)})
    assert r.returncode == 0, r.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    installs = [c[3:] for c in calls if c[:3] == ["-m", "pip", "install"]]
    assert installs and all(c[:3] in (["-m", "pip", "install"], ["-m", "pip", "list"]) for c in calls), calls
    # The image's torch and numpy, and only they, are pinned; every install keeps them.
    pins_files = {a[a.index("-c") + 1] for a in installs if "-c" in a}
    assert len(pins_files) == 1, installs
    pins = Path(pins_files.pop())
    assert pins.read_text().split() == ["numpy==1.24.4", "torch==2.4.0a0+07cecf4"]
    from packaging.requirements import Requirement
    installed = set()
    for a in installs:
        words = [w for i, w in enumerate(a) if not w.startswith("-") and a[i - 1] != "-c"]
        assert "--no-deps" in a or "-c" in a, f"%post: pip install {' '.join(a)} may replace the image's torch"
        for w in words:
            if Path(w).is_absolute():  # a directory: hpcbert itself, with --no-deps
                assert "--no-deps" in a and (Path(w) / "pyproject.toml").resolve() == ROOT / "pyproject.toml", a
                installed.add("hpcbert")
                continue
            req = Requirement(w)
            assert req.name.lower() not in ("torch", "numpy"), f"%post installs {w}: the image's must stay"
            installed.add(req.name.lower())
    # This checkout, and every dependency it declares except the image's torch and numpy.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {Requirement(d).name.lower() for d in project["dependencies"]} - {"torch", "numpy"}
    assert {"hpcbert", *needed} <= installed, f"%post does not install {sorted({'hpcbert', *needed} - installed)}"
    # The image's interpreter (here this machine's, hpcbert on its path as installed) runs the rest.
    py_dir = tmp_path / "image-bin"
    py_dir.mkdir()
    stub(py_dir / "python", f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    image_env = {"PATH": f"{py_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT / "BERT"),
                 "OMP_NUM_THREADS": "1"}
    r = subprocess.run(["/bin/sh", "-c", sec["environment"] + 'echo "$PYTHONNOUSERSITE"'], env=image_env,
                       capture_output=True, text=True)
    assert r.stdout == "1\n", r.stderr
    r = subprocess.run(["/bin/sh", "-e", "-c", sec["test"]], env=image_env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("torch "), r.stderr  # and `hpcbert.cli train --help` ran
    # `apptainer run IMG train ...` is `python -m hpcbert.cli train ...` (the recording python: one
    # torch import fewer; %test just ran that module).
    log.unlink()
    r = subprocess.run(["/bin/sh", "-c", sec["runscript"], "hpcbert.sif", "train", "--out", "a b"],
                       env=dict(image_env, PATH=f"{bin_dir}:/usr/bin:/bin", HPCBERT_TEST_LOG=str(log)))
    assert r.returncode == 0 and json.loads(log.read_text()) == ["-m", "hpcbert.cli", "train", "--out", "a b"]


# --- thin scripts and the CLI ---------------------------------------------------------------------

@pytest.mark.parametrize("script, command", [("run_glue.sh", "train"), ("eval.sh", "report")])
def test_hpcai_scripts_pass_every_argument_to_hpcbert(tmp_path, script, command):
    fake_python = stub(tmp_path / "python", '#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$HPCBERT_TEST_LOG"\n')
    env = dict(os.environ, HPCBERT_PYTHON=str(fake_python), HPCBERT_TEST_LOG=str(tmp_path / "args"))
    args = ["--task", "mrpc", "--out", "a dir/with space"]
    r = subprocess.run([str(ROOT / "hpcai_scripts" / script), *args], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "args").read_text().splitlines() == ["-m", "hpcbert.cli", command, *args]


def test_hpcbert_submit_dispatches_from_the_main_cli(capsys):
    from hpcbert.cli import main
    assert main(["submit", "--scheduler", "slurm", "--preset", "baseline", "--portable", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash\n") and "#SBATCH --gpus-per-node=1" in out and "--batch-size 24" in out


def test_submit_without_the_scheduler_command_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    rc = submit.cli(["--scheduler", "pbs", "--nodes", "1", "--gpus-per-node", "0", "--walltime", "00:10:00",
                     "--", *TRAIN])
    err = capsys.readouterr().err
    assert rc == 2 and "qsub not found" in err and (tmp_path / "hpcbert.pbs").exists()


def test_slurm_signal_is_left_out_where_its_early_window_would_stop_the_job_at_once():
    long = subprocess.run([sys.executable, "-m", "hpcbert.cli", "submit", "--scheduler", "slurm", "--nodes", "1",
                           "--gpus-per-node", "0", "--walltime", "00:30:00", "--stop-margin", "120", "--dry-run",
                           "--", "--task", "synthetic"], env=run_env(), capture_output=True, text=True)
    short = subprocess.run([sys.executable, "-m", "hpcbert.cli", "submit", "--scheduler", "slurm", "--nodes", "1",
                            "--gpus-per-node", "0", "--walltime", "00:01:00", "--stop-margin", "40", "--dry-run",
                            "--", "--task", "synthetic"], env=run_env(), capture_output=True, text=True)
    assert long.returncode == 0 and short.returncode == 0, long.stderr + short.stderr
    assert "#SBATCH --signal=B:USR1@120\n" in long.stdout
    assert "--signal" not in short.stdout.split("HPCBERT_KIT")[0]
    assert "HPCBERT_JOB_DEADLINE=$(( $(date +%s) + 60 - 40 ))" in short.stdout
