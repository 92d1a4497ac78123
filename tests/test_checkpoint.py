"""Checkpoint files: atomic, verified by a manifest written last, never loaded when damaged."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import ROOT
from hpcbert.checkpoint import CheckpointError, CheckpointManager


def state(step):
    return {"model": {"w": torch.full((64, 64), float(step))}, "step": step}


def test_save_list_latest_load_and_retention(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    torch.manual_seed(0)
    for step in (10, 20, 30):
        mgr.save(step, state(step), {"rng": torch.get_rng_state()})
        saved_stream = torch.rand(5)  # what the run draws right after the step-30 save
    torch.rand(1000)  # the RNG moves on: the current state is no longer the saved one
    assert not torch.equal(torch.rand(5), saved_stream)
    assert [c.step for c in mgr.list()] == [20, 30]  # keep_last=2 pruned step 10
    ck = mgr.latest()
    shared, mine = mgr.load(ck)
    assert ck.step == 30 and shared["step"] == 30
    assert torch.equal(shared["model"]["w"], torch.full((64, 64), 30.0))
    torch.set_rng_state(mine["rng"])
    assert torch.equal(torch.rand(5), saved_stream)  # the restored stream continues where it was saved
    assert not list(tmp_path.glob(".step-*"))  # no temporary directories left behind


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_manifest", "bad_manifest", "missing_rank_file"])
def test_damaged_newest_falls_back_to_previous_with_a_warning_naming_the_file(tmp_path, damage):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(1, state(1), {})
    newest = mgr.save(2, state(2), {})
    target = newest / "shared.pt"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "no_manifest":
        (newest / "MANIFEST.json").unlink()
    elif damage == "bad_manifest":
        (newest / "MANIFEST.json").write_text("{not json")
    else:
        (newest / "rank-00000.pt").unlink()
    with pytest.warns(UserWarning, match=str(newest)):
        ck = mgr.latest()
    assert ck.step == 1
    with pytest.raises(CheckpointError):
        mgr.verify(newest)


def test_keep_last_below_two_is_refused(tmp_path):
    with pytest.raises(ValueError, match="keep_last: must be >= 2"):
        CheckpointManager(tmp_path, keep_last=1)


def test_other_world_size_is_refused(tmp_path):
    CheckpointManager(tmp_path).save(5, state(5), {})
    mgr2 = CheckpointManager(tmp_path, world_size=2, gather=lambda item: [item, item])  # loading needs no collective
    with pytest.raises(CheckpointError, match="written by 1 ranks, this run has 2"):
        mgr2.load(CheckpointManager(tmp_path).latest())


KILLER = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, sys.argv[3])
    import hpcbert.checkpoint as c
    stage = sys.argv[2]
    mgr = c.CheckpointManager(sys.argv[1], keep_last=2)
    mgr.save(1, {"w": torch.ones(1000)}, {})
    real_write, real_replace = c._write, c.os.replace
    def write(path, obj):
        if stage == "mid_file" and path.name == "shared.pt":
            open(path, "wb").write(b"partial")
            os.kill(os.getpid(), signal.SIGKILL)
        out = real_write(path, obj)
        if stage == "after_files" and path.name == "shared.pt":
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    def replace(a, b):
        if stage == "before_rename":
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(a, b)
    c._write, c.os.replace = write, replace
    mgr.save(2, {"w": torch.full((1000,), 2.0)}, {})
""")


@pytest.mark.parametrize("stage", ["mid_file", "after_files", "before_rename"])
def test_sigkill_at_each_stage_of_a_save_never_yields_a_loadable_partial(tmp_path, stage):
    r = subprocess.run([sys.executable, "-c", KILLER, str(tmp_path), stage, str(ROOT / "BERT")],
                       capture_output=True, timeout=60)
    assert r.returncode == -signal.SIGKILL
    mgr = CheckpointManager(tmp_path, keep_last=2)
    ck = mgr.latest()
    assert ck.step == 1 and mgr.load(ck)[0]["w"].sum() == 1000
    mgr.save(2, {"w": torch.zeros(3)}, {})  # the leftover temporary directory does not block the next save
    assert mgr.latest().step == 2
