"""Stop conditions: time box, job deadline, stop file, idempotent signal handlers."""

from __future__ import annotations

import os
import signal
import time

import pytest

from hpcbert.stopping import StopConditions


def test_time_box_and_job_deadline_look_ahead_one_step():
    now = time.time()
    s = StopConditions(budget_deadline=now + 10, job_deadline=now + 100)
    assert s.reason(next_step_s=1) is None
    assert s.reason(next_step_s=20) == "time_budget"
    s = StopConditions(budget_deadline=None, job_deadline=now + 5)
    assert s.reason(next_step_s=1) is None and s.reason(next_step_s=6) == "job_deadline"


def test_stop_file_and_env(tmp_path, monkeypatch):
    stop = tmp_path / "STOP"
    monkeypatch.setenv("HPCBERT_STOP_FILE", str(stop))
    monkeypatch.setenv("HPCBERT_JOB_DEADLINE", str(int(time.time()) + 3600))
    s = StopConditions.from_env(None)
    assert s.reason(0) is None
    stop.touch()
    assert s.reason(0) == "stop_file"
    monkeypatch.setenv("HPCBERT_JOB_DEADLINE", "tomorrow")
    with pytest.raises(ValueError, match="HPCBERT_JOB_DEADLINE='tomorrow'"):
        StopConditions.from_env(None)


def test_signal_handler_is_idempotent_and_restored():
    before = signal.getsignal(signal.SIGUSR1)
    s = StopConditions(None)
    s.install_signal_handlers()
    try:
        for _ in range(4):  # Slurm + torchrun deliver SIGTERM several times
            os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert s.reason(0) == "signal" and s.signal_received == signal.SIGTERM
    finally:
        s.restore_signal_handlers()
    assert signal.getsignal(signal.SIGUSR1) == before
