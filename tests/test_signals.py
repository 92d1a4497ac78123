"""Faults a batch job meets: SIGTERM (several times) during a step, during evaluation and during a
save each end in one complete checkpoint; a rank killed mid-run makes the job fail fast, naming it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import ROOT, run_env
from hpcbert.checkpoint import CheckpointManager

pytestmark = pytest.mark.slow

TINY = ["--model", "bert-tiny", "--task", "synthetic", "--batch-size", "4", "--threads", "1"]


def start(*a, nproc=1):
    launcher = [sys.executable, "-m", "hpcbert.cli"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m", "hpcbert.cli"]
    return subprocess.Popen(launcher + ["train", *map(str, a)], env=run_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(pred, timeout=120, what="condition"):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def logged_steps(run: Path) -> int:
    f = run / "metrics.jsonl"
    return len(f.read_text().splitlines()) if f.exists() else 0


def test_sigterm_during_training_saves_once_and_resume_continues(tmp_path):
    run = tmp_path / "run"
    p = start(*TINY, "--max-steps", 100000, "--log-every", 1, "--checkpoint-steps", 100000, "--out", run)
    wait_for(lambda: logged_steps(run) >= 3, what="three steps")
    for _ in range(3):  # Slurm + torchrun deliver SIGTERM several times: the handler is idempotent
        p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    s = json.loads((run / "summary.json").read_text())
    assert s["stopped_by"] == "signal" and s["eval"] == {}
    cks = CheckpointManager(run / "checkpoints").list()
    assert [c.step for c in cks] == [s["steps"]]  # exactly one checkpoint, at the step it stopped
    CheckpointManager(run / "checkpoints").verify(cks[0].path)
    again = [*TINY, "--max-steps", 100000, "--log-every", 1, "--checkpoint-steps", 100000, "--out", run,
             "--resume", "auto", "--time-budget", 8]
    r = subprocess.run([sys.executable, "-m", "hpcbert.cli", "train", *map(str, again)],
                       env=run_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and f"step {s['steps']}," in r.stderr, r.stderr


def test_sigterm_during_evaluation_leaves_the_final_checkpoint(tmp_path):
    run = tmp_path / "run"
    # 40,000 dev examples one at a time: tens of seconds of evaluation, cheap to generate.
    p = start(*TINY, "--max-steps", 3, "--checkpoint-steps", 100, "--synthetic-dev-size", 40000,
              "--eval-batch-size", 1, "--out", run)
    wait_for(lambda: (run / "checkpoints" / "step-00000003" / "MANIFEST.json").exists(), what="the final checkpoint")
    time.sleep(1.0)  # now evaluating 40k dev examples
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGTERM  # evaluation is not saved state: the process ends at once
    assert not (run / "summary.json").exists()
    mgr = CheckpointManager(run / "checkpoints")
    assert mgr.latest().step == 3


SAVE_UNDER_SIGTERM = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, sys.argv[2])
    import hpcbert.checkpoint as c
    from hpcbert.stopping import StopConditions
    stops = StopConditions(None)
    stops.install_signal_handlers()
    real = c._write
    def write(path, obj):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives in the middle of the save
        return real(path, obj)
    c._write = write
    c.CheckpointManager(sys.argv[1]).save(7, {"w": torch.ones(10)}, {})
    print(stops.reason(0))
""")


def test_sigterm_during_a_save_completes_the_save():
    import tempfile
    d = tempfile.mkdtemp()
    r = subprocess.run([sys.executable, "-c", SAVE_UNDER_SIGTERM, d, str(ROOT / "BERT")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "signal", r.stderr
    assert CheckpointManager(d).latest().step == 7


def _worker_pids(parent: int) -> dict[int, int]:
    """RANK -> pid of torchrun's worker processes."""
    out = {}
    for child in subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split():
        try:
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for kv in env:
            if kv.startswith(b"RANK="):
                out[int(kv[5:])] = int(child)
    return out


def test_a_rank_killed_mid_run_fails_the_job_naming_it(tmp_path):
    run = tmp_path / "run"
    p = start(*TINY, "--max-steps", 100000, "--log-every", 1, "--dist-timeout", 30, "--out", run, nproc=2)
    wait_for(lambda: logged_steps(run) >= 2, what="two steps")
    pids = _worker_pids(p.pid)
    assert set(pids) == {0, 1}
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.time()
    _, err = p.communicate(timeout=90)
    assert p.returncode != 0 and time.time() - t0 < 60
    assert "rank: 1" in err or "local_rank: 1" in err, err[-2000:]
