"""A checkpoint save that runs out of disk or quota: a one-line CheckpointError naming the file and
the system's reason, the partial temporary directory removed, the previous checkpoint still the one
`latest()` returns; with several ranks, every rank gets the error (none waits in a collective).

The full disk is real where this runs as root: a 2 MiB tmpfs mounted as the checkpoints folder.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_env
from hpcbert import checkpoint
from hpcbert.checkpoint import CheckpointError, CheckpointManager

PAGE = 4096  # tmpfs allocates whole pages


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of `size` mounted at `path` (root only; skips otherwise), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 2 MiB tmpfs at tmp_path/checkpoints."""
    with tmpfs(tmp_path / "checkpoints", "2m") as disk:
        yield disk


def serialized_size(obj) -> int:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return len(buf.getvalue())


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def assert_previous_checkpoint_intact(mgr: CheckpointManager, root: Path) -> None:
    assert not list(root.glob(".step-*")), "the partial temporary directory was left behind"
    assert not (root / "step-00000002").exists()
    ck = mgr.latest()
    assert ck is not None and ck.step == 1
    mgr.verify(ck.path)
    shared, mine = mgr.load(ck)
    assert torch.equal(shared["w"], torch.ones(50_000)) and mine == {"rank": 0}


@pytest.mark.root
@pytest.mark.parametrize("too_big", ["rank file", "shared state"])
def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tiny_disk, too_big):
    mgr = CheckpointManager(tiny_disk, keep_last=2)
    mgr.save(1, {"w": torch.ones(50_000)}, {"rank": 0})  # 200 kB: fits
    free_before = free_bytes(tiny_disk)
    big = {"w": torch.ones(600_000)}  # 2.4 MB on a 2 MiB disk
    shared, mine = (big, {"rank": 0}) if too_big == "shared state" else ({"w": torch.ones(3)}, big)
    with pytest.raises(CheckpointError) as e:
        mgr.save(2, shared, mine)
    message = str(e.value)
    failed = tiny_disk / ".step-00000002.tmp" / ("shared.pt" if too_big == "shared state" else "rank-00000.pt")
    assert f"{failed}: No space left on device (ENOSPC)" in message and "\n" not in message
    assert isinstance(e.value, ValueError)  # a user error: the CLI prints it as one line, exit 2
    assert_previous_checkpoint_intact(mgr, tiny_disk)
    assert free_bytes(tiny_disk) == free_before  # the partial files' space came back
    mgr.save(3, {"w": torch.zeros(10)}, {"rank": 0})  # and the next save, once there is room, works
    assert mgr.latest().step == 3


@pytest.mark.root
def test_disk_full_at_the_manifest_after_the_data_files_fit(tiny_disk):
    mgr = CheckpointManager(tiny_disk, keep_last=2)
    mgr.save(1, {"w": torch.ones(50_000)}, {"rank": 0})
    shared, mine = {"w": torch.full((100_000,), 2.0)}, {"rank": 0}
    # Leave exactly the pages the two data files need, none for the manifest written after them.
    pages = sum(-(-serialized_size(x) // PAGE) for x in (shared, mine))
    filler = tiny_disk / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * (free_bytes(tiny_disk) - pages * PAGE))
    assert free_bytes(tiny_disk) == pages * PAGE
    with pytest.raises(CheckpointError) as e:
        mgr.save(2, shared, mine)
    assert f"{tiny_disk / '.step-00000002.tmp' / 'MANIFEST.json'}: No space left on device" in str(e.value)
    filler.unlink()
    assert_previous_checkpoint_intact(mgr, tiny_disk)


def test_quota_exceeded_at_the_rename_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    # Runs without root: the OSError a quota gives (EDQUOT), injected where the save renames.
    mgr = CheckpointManager(tmp_path, keep_last=2)
    mgr.save(1, {"w": torch.ones(50_000)}, {"rank": 0})

    def replace(src, dst):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(checkpoint.os, "replace", replace)
    with pytest.raises(CheckpointError) as e:
        mgr.save(2, {"w": torch.ones(5)}, {"rank": 0})
    assert str(e.value).startswith(f"checkpoint of step 2 not saved: {tmp_path / 'step-00000002'}: "
                                   f"{os.strerror(errno.EDQUOT)} (EDQUOT)")
    monkeypatch.undo()
    assert_previous_checkpoint_intact(mgr, tmp_path)


TWO_RANKS = textwrap.dedent("""
    import errno, os, sys, torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[4])
    import hpcbert.checkpoint as c
    rank, failing = int(sys.argv[1]), sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2] + "/store", rank=rank, world_size=2)
    from hpcbert.dist import Dist, all_gather_objects
    d = Dist(rank, 2, rank, 2, torch.device("cpu"), "gloo")
    mgr = c.CheckpointManager(sys.argv[2] + "/ck", keep_last=2, rank=rank, world_size=2, barrier=dist.barrier,
                              gather=lambda item: all_gather_objects(d, item))
    mgr.save(1, {"w": torch.ones(4)}, {"rank": rank})
    real_write = c._write
    def write(path, obj):  # the disk fills up under one rank's file
        if path.name == failing:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(path, obj)
    c._write = write
    try:
        mgr.save(2, {"w": torch.zeros(4)}, {"rank": rank})
        print("saved", flush=True)
    except c.CheckpointError as e:
        print("CheckpointError:", e, flush=True)
    c._write = real_write
    mgr.save(3, {"w": torch.zeros(4)}, {"rank": rank})  # the group is still usable: nobody is stuck
    print("latest", mgr.latest().step, flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("failing", ["rank-00001.pt", "shared.pt"])
def test_a_failed_write_on_one_rank_raises_on_every_rank(tmp_path, failing):
    procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS, str(rank), str(tmp_path), failing,
                               str(ROOT / "BERT")], env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for rank in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank hung after another rank's write failed")
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    lines = [out.splitlines() for out, _ in outs]
    where = tmp_path / "ck" / ".step-00000002.tmp" / failing
    for rank_lines in lines:
        assert rank_lines[0].startswith(f"CheckpointError: checkpoint of step 2 not saved: {where}: "
                                        f"No space left on device (ENOSPC)"), rank_lines
        assert rank_lines[1] == "latest 3"
    assert lines[0][0] == lines[1][0]  # the same message on both ranks
    assert not list((tmp_path / "ck").glob(".step-*"))


@pytest.mark.slow
@pytest.mark.root
def test_training_run_whose_checkpoint_disk_fills_stops_with_one_line_and_keeps_the_last_checkpoint(tmp_path):
    # bert-tiny's checkpoint (weights + AdamW moments) is ~51 MB: step 1 fits on 80 MB, step 2 does not.
    run = tmp_path / "run"
    with tmpfs(run / "checkpoints", "80m") as disk:
        r = subprocess.run([sys.executable, "-m", "hpcbert.cli", "train", "--model", "bert-tiny",
                            "--task", "synthetic", "--max-steps", "3", "--checkpoint-steps", "1", "--batch-size", "4",
                            "--synthetic-train-size", "64", "--synthetic-dev-size", "8", "--threads", "1",
                            "--out", str(run)], env=run_env(), capture_output=True, text=True, timeout=240)
        assert r.returncode == 2, r.stderr[-3000:]
        assert "Traceback" not in r.stderr
        assert r.stderr.splitlines()[-1] == (
            f"hpcbert train: error: checkpoint of step 2 not saved: {disk / '.step-00000002.tmp'}/shared.pt: "
            "No space left on device (ENOSPC); the partial .step-00000002.tmp was removed, "
            "earlier checkpoints are kept")
        assert sorted(p.name for p in disk.iterdir()) == ["step-00000001"]
        assert CheckpointManager(disk).latest().step == 1
