"""When training stops early: the time box, the job's deadline, a stop file, and signals.

All of them are checked at step boundaries only, so a run always stops between two optimizer
steps with a consistent state to checkpoint. The trainer makes every rank agree on the answer
(any rank's reason stops all), so all ranks stop at the same step.

- time box (`--time-budget`): counted from process start, plus budget already used by earlier
  segments of a resumed run;
- job deadline (`HPCBERT_JOB_DEADLINE`, epoch seconds, exported by the generated job scripts as
  job start + walltime - margin): PBS gives no warning before its SIGTERM, so the job keeps its own;
- stop file: `RUN_DIR/STOP` for any run (`touch RUN_DIR/STOP` stops it at the next step boundary,
  with a checkpoint), and `HPCBERT_STOP_FILE` where a job script names another; the job script's
  USR1/TERM trap touches it, so the launcher never has to survive a non-TERM signal (hpc-lab
  NOTES §3.3). Only rank 0 looks at the files and the clock; the trainer tells the others;
- SIGTERM / SIGUSR1 / SIGINT delivered to the worker: the handler only sets a flag, so it is
  idempotent (workers under Slurm + torchrun receive SIGTERM 3-4 times).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopConditions:
    def __init__(self, budget_deadline: float | None, job_deadline: float | None = None,
                 stop_file: str | os.PathLike | None = None, run_dir: str | os.PathLike | None = None):
        self.budget_deadline = budget_deadline
        self.job_deadline = job_deadline
        self.stop_files = [Path(p) for p in (stop_file, Path(run_dir) / "STOP" if run_dir else None) if p]
        self.signal_received: int | None = None
        self._previous: dict[int, object] = {}

    @classmethod
    def from_env(cls, budget_deadline: float | None, run_dir: str | os.PathLike | None = None) -> "StopConditions":
        raw = os.environ.get("HPCBERT_JOB_DEADLINE")
        try:
            job_deadline = float(raw) if raw else None
        except ValueError as e:
            raise ValueError(f"environment: HPCBERT_JOB_DEADLINE={raw!r} is not epoch seconds") from e
        return cls(budget_deadline, job_deadline, os.environ.get("HPCBERT_STOP_FILE") or None, run_dir)

    def install_signal_handlers(self) -> None:
        def handler(signum, frame):  # only a flag: safe to receive any number of times
            if self.signal_received is None:
                self.signal_received = signum
        for s in STOP_SIGNALS:
            self._previous[s] = signal.signal(s, handler)

    def restore_signal_handlers(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)  # type: ignore[arg-type]
        self._previous.clear()

    def reason(self, next_step_s: float) -> str | None:
        """Why to stop before the next step (expected to take next_step_s), or None."""
        if self.signal_received is not None:
            return "signal"
        if any(f.exists() for f in self.stop_files):
            return "stop_file"
        now = time.time()
        if self.job_deadline is not None and now + next_step_s > self.job_deadline:
            return "job_deadline"
        if self.budget_deadline is not None and now + next_step_s > self.budget_deadline:
            return "time_budget"
        return None


# Reasons in the order ranks agree on them (the highest code any rank reports wins). "target"
# (--target-mlm-accuracy reached) is decided after an evaluation, by every rank alike, never posted.
REASONS = (None, "time_budget", "job_deadline", "stop_file", "signal", "target")
