"""Resume is exact: a run rolled back to a checkpoint and resumed ends bit-identical to the
straight run (losses, parameters, optimizer, scheduler, scaler, data position, RNG), on 1 and 2
ranks, mid-epoch and at an epoch boundary. Settings that change the maths are refused on resume."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import run_env

pytestmark = pytest.mark.slow

# 64 examples / global batch 8 = 8 steps per epoch: step 4 is mid-epoch, step 8 an epoch boundary.
def args(out, nproc):
    return ["train", "--model", "bert-tiny", "--task", "synthetic", "--synthetic-train-size", 64,
            "--synthetic-dev-size", 16, "--batch-size", 8 // nproc, "--max-steps", 12, "--log-every", 1,
            "--checkpoint-steps", 4, "--keep-last", 5, "--threads", 1, "--sampler", "random", "--out", out]


def hpcbert(nproc, *a):
    launcher = [sys.executable, "-m", "hpcbert.cli"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        "-m", "hpcbert.cli"]
    return subprocess.run(launcher + [str(x) for x in a], env=run_env(), capture_output=True, text=True, timeout=300)


def losses(run):
    return [(m["step"], m["loss"]) for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def final_state(run, nproc):
    ck = run / "checkpoints" / "step-00000012"
    shared = torch.load(ck / "shared.pt", weights_only=False)
    ranks = [torch.load(ck / f"rank-{r:05d}.pt", weights_only=False) for r in range(nproc)]
    return shared, ranks


def assert_same(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: keys differ"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.mark.parametrize("nproc", [1, 2])
def test_resumed_run_equals_straight_run(tmp_path, nproc):
    straight = tmp_path / "straight"
    r = hpcbert(nproc, *args(straight, nproc))
    assert r.returncode == 0, r.stderr
    ref_shared, ref_ranks = final_state(straight, nproc)
    for resume_at in (4, 8):  # mid-epoch, epoch boundary
        run = tmp_path / f"resumed-{resume_at}"
        shutil.copytree(straight, run)
        for ck in (run / "checkpoints").iterdir():  # roll back: as if killed right after step resume_at
            if int(ck.name.split("-")[1]) > resume_at:
                shutil.rmtree(ck)
        r = hpcbert(nproc, *args(run, nproc), "--resume", "auto")
        assert r.returncode == 0, r.stderr
        assert f"resumed from {run / 'checkpoints' / f'step-{resume_at:08d}'}" in r.stderr
        assert losses(run) == losses(straight)  # exact equality, every step
        shared, ranks = final_state(run, nproc)
        for key in ("model", "optimizer", "scheduler", "scaler", "data"):
            assert_same(shared[key], ref_shared[key], key)
        for key in ("step", "epoch", "pos", "sequences"):
            assert shared["loop"][key] == ref_shared["loop"][key], key
        for r_, ref in zip(ranks, ref_ranks):
            assert_same(r_, ref, "rng")
        summary = json.loads((run / "summary.json").read_text())
        assert summary["resumed_from_step"] == resume_at and summary["steps"] == 12
        assert summary["eval"] == json.loads((straight / "summary.json").read_text())["eval"]


def test_changed_settings_are_refused_naming_the_field(tmp_path):
    run = tmp_path / "run"
    assert hpcbert(1, *args(run, 1)).returncode == 0
    r = hpcbert(1, *args(run, 1), "--resume", "auto", "--lr", "1e-3")
    assert r.returncode == 2 and "lr (checkpoint 2e-05, now 0.001)" in r.stderr, r.stderr
    # Fields that do not change the maths may differ (here: log cadence, where compiles are cached).
    r = hpcbert(1, *args(run, 1)[:-2], "--out", run, "--resume", "auto", "--log-every", 3,
                "--compile-cache", tmp_path / "cache")
    assert r.returncode == 0, r.stderr


def test_a_checkpoint_from_before_norm_precision_resumes_only_with_fp32_layer_norms(tmp_path):
    """A bf16 run checkpointed by an hpcbert without --norm-precision ran its LayerNorms in fp32:
    resuming it under the new default (low) would change its maths mid-run, so it is refused with
    what to pass instead, and resumes with --norm-precision fp32."""
    import hashlib

    run = tmp_path / "run"
    bf16 = [*args(run, 1), "--precision", "bf16"]
    assert hpcbert(1, *bf16).returncode == 0
    for later in ("step-00000008", "step-00000012"):  # as if stopped after step 4's checkpoint
        shutil.rmtree(run / "checkpoints" / later)
    ck = run / "checkpoints" / "step-00000004"
    shared = torch.load(ck / "shared.pt", weights_only=False)
    del shared["config"]["norm_precision"]  # as the earlier hpcbert wrote it
    torch.save(shared, ck / "shared.pt")
    data = (ck / "shared.pt").read_bytes()
    manifest = json.loads((ck / "MANIFEST.json").read_text())
    manifest["files"]["shared.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ck / "MANIFEST.json").write_text(json.dumps(manifest))
    (run / "summary.json").unlink()
    r = hpcbert(1, *bf16, "--resume", "auto")
    assert r.returncode == 2 and "resume it with --norm-precision fp32" in r.stderr, r.stderr
    r = hpcbert(1, *bf16, "--resume", "auto", "--norm-precision", "fp32")
    assert r.returncode == 0, r.stderr
    assert json.loads((run / "summary.json").read_text())["resumed_from_step"] == 4
