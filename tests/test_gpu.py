"""GPU checks: CI has no GPU and skips them; they run unchanged on a GPU machine with
`python -m pytest -m gpu`. fp16 with the loss scaler, NCCL under torchrun, --per-rank-batch auto
and bf16 on the device, each through the real CLI; figures are checked against the CPU's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import run_env
from hpcbert.runfiles import read_metrics, read_summary

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TINY = ["train", "--model", "bert-tiny", "--task", "synthetic", "--batch-size", "16", "--synthetic-dev-size", "64",
        "--log-every", "1"]


def run(*args, nproc: int = 1, timeout: int = 600, env: dict | None = None):
    prefix = [sys.executable, "-m", "hpcbert.cli"] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
         "hpcbert.cli"]
    r = subprocess.run([*prefix, *map(str, args)], env=env or run_env(), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_fp16_with_the_loss_scaler_trains_and_matches_fp32(tmp_path):
    steps = 40
    run(*TINY, "--max-steps", steps, "--precision", "fp16", "--lr", "1e-3", "--dropout", "0", "--out", tmp_path / "fp16")
    run(*TINY, "--max-steps", steps, "--precision", "fp32", "--lr", "1e-3", "--dropout", "0", "--out", tmp_path / "fp32")
    s16, s32 = read_summary(tmp_path / "fp16"), read_summary(tmp_path / "fp32")
    assert s16["precision"] == "fp16" and s32["precision"] == "fp32" and s16["dist_backend"] is None
    l16 = [m["loss"] for m in read_metrics(tmp_path / "fp16")]
    l32 = [m["loss"] for m in read_metrics(tmp_path / "fp32")]
    # The scaler may skip a few steps at the start (inf gradients while it finds its scale); the
    # rest train like fp32: the last losses within a few percent, both well below the first.
    assert s16["nonfinite_grad_steps"] < 10
    assert abs(l16[-1] - l32[-1]) <= 0.05 * l32[-1] + 0.02 and l16[-1] < l16[0]


def test_nccl_two_processes_give_the_losses_of_one(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs for two NCCL ranks")
    common = [*TINY, "--max-steps", 5, "--precision", "fp32", "--dropout", "0", "--max-grad-norm", "0"]
    run(*common, "--batch-size", 8, "--out", tmp_path / "one")
    run(*common, "--batch-size", 4, "--out", tmp_path / "two", nproc=2)
    assert read_summary(tmp_path / "two")["dist_backend"] == "nccl"
    one = [m["loss"] for m in read_metrics(tmp_path / "one")]
    two = [m["loss"] for m in read_metrics(tmp_path / "two")]
    assert two == pytest.approx(one, rel=1e-3)  # reduction order (and TF32 on Ampere+) differ


def test_nccl_single_rank_under_torchrun(tmp_path):
    run(*TINY, "--max-steps", 3, "--out", tmp_path / "r", nproc=1)
    s = read_summary(tmp_path / "r")
    assert s["steps"] == 3 and s["hardware"]["device_type"] == "cuda"


def test_per_rank_batch_auto_probes_the_gpu_and_grows_with_checkpointing(tmp_path):
    for policy in ("none", "all"):
        run("train", "--model", "bert-base", "--task", "synthetic", "--max-seq-length", 512, "--per-rank-batch",
            "auto", "--grad-ckpt", policy, "--max-steps", 2, "--synthetic-train-size", 1024, "--no-do-eval",
            "--out", tmp_path / policy)
    none, all_ = (read_summary(tmp_path / p)["per_device_batch_size"] for p in ("none", "all"))
    # all keeps ~18 MiB a sequence (results/pareto): 1024 of them fit any GPU this runs on, and the
    # probe stops at the training set's 1024 sequences (0.9 x 1024 kept); none's 270 MiB do not
    assert 1 <= none < all_ <= int(0.9 * 1024)


def test_auto_precision_on_this_gpu_follows_its_compute_capability(tmp_path):
    run(*TINY, "--max-steps", 2, "--out", tmp_path / "r")
    s = read_summary(tmp_path / "r")
    native = torch.cuda.get_device_capability(0) >= (8, 0)
    assert s["precision"] == ("bf16" if native else "fp32")
    assert s["peak_flops"] is None or s["mfu"] is None or 0 < s["mfu"] < 1


def test_a_batch_goes_to_the_gpu_without_waiting_for_it():
    """Batch.to copies the whole batch in one transfer from pinned memory: the host does not wait
    for the GPU's queued work, so it can queue the step while the last one runs. A blocking copy
    (the control) waits for the queue to drain first. (A non-blocking copy of 8 KB from pageable
    memory, this test's control until an H200 session, returned in 0.2 ms there: CUDA stages small
    pageable copies without waiting.)"""
    import time

    import numpy as np

    from hpcbert.data.features import Features, collate

    f = Features.from_lists([list(range(100, 100 + n)) for n in (30, 50, 20)], [[0] * n for n in (30, 50, 20)],
                            [0, 1, 0])
    b = collate(f, [0, 1, 2])
    dev = torch.device("cuda")
    b.to(dev)  # the pinned host allocator's first block
    torch.cuda.synchronize()

    def host_seconds(fn) -> tuple:
        torch.cuda._sleep(2_000_000_000)  # the GPU busy for ~1 s
        t = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t
        torch.cuda.synchronize()
        return dt, out

    packed, moved = host_seconds(lambda: b.to(dev))
    blocking, _ = host_seconds(lambda: torch.from_numpy(np.arange(1000)).to(dev))
    assert packed < 0.1 < blocking, (packed, blocking)
    assert torch.equal(moved.input_ids.cpu(), b.input_ids) and torch.equal(moved.labels.cpu(), b.labels)
    assert moved.tokens.cu_seqlens.tolist() == [0, 30, 80, 100]


def test_the_agreement_is_read_without_waiting_for_the_step_queued_after_it():
    """One step late (Agreement's lag on CUDA), reading step N's agreed values waits for step N,
    not for step N+1 already queued behind it: the host then prepares step N+2 while N+1 runs. The
    control: reading N+1's values waits for the ~1 s of work queued before them."""
    import time

    from hpcbert import dist

    d = dist.Dist(0, 1, 0, 1, torch.device("cuda"))
    a = dist.Agreement(d)
    assert a.lag == 1
    x = torch.ones((), device="cuda")
    a.post("step 1", [1.0, 2.0], [x * 3])
    torch.cuda._sleep(2_000_000_000)  # step 2's work: the GPU busy for ~1 s
    a.post("step 2", [4.0, 5.0], [x * 6])
    t = time.perf_counter()
    first = a.ready()
    waited = time.perf_counter() - t
    t = time.perf_counter()
    second = a.ready(flush=True)
    drained = time.perf_counter() - t
    assert first == [("step 1", [1.0, 2.0, 3.0])] and second == [("step 2", [4.0, 5.0, 6.0])]
    assert waited < 0.1 < drained, (waited, drained)


@pytest.mark.parametrize("policy", ["none", "selective", "alternate", "all", "offload"])
def test_a_step_dropped_before_backward_leaves_nothing_allocated(policy):
    """A forward whose backward never runs (a step that ran out of memory, as --per-rank-batch auto's
    probe and benchmarks/gpu.py large provoke) frees what it allocated once dropped, under every
    policy. On an H200 at 9a2a6c4 selective's and alternate's did not (flash attention saves its own
    output, which their saved-tensor hook kept as it was: a cycle with its node that gc cannot
    free), and every batch probed after the first out-of-memory failed."""
    import gc

    from hpcbert import objectives, plan, policies
    from hpcbert.config import RunConfig

    dev = torch.device("cuda")
    cfg = RunConfig(task="synthetic", model="bert-tiny", max_seq_length=128, precision="bf16")
    obj = objectives.get(cfg)
    model = obj.build_model(plan._model_config(cfg)).to(dev).train()
    policies.apply_grad_ckpt(model, policy)
    batch, norm = obj.example_batch(64, 128, model.config.vocab_size)
    batch = batch.to(dev)

    def forward():
        with policies.autocast("bf16", dev):
            return obj.loss(model, obj.forward(model, batch), batch, norm)

    forward().backward()  # a whole step first: what CUDA and its libraries keep after it (workspaces)
    model.zero_grad(set_to_none=True)
    gc.collect()
    before = torch.cuda.memory_allocated(dev)
    loss = forward()
    graph = torch.cuda.memory_allocated(dev) - before
    del loss
    gc.collect()
    left = torch.cuda.memory_allocated(dev) - before
    assert graph > 0 and left <= 0.01 * graph, (policy, graph, left)


def test_hpcbert_runs_cuda_with_expandable_segments_unless_the_user_set_the_allocator(tmp_path):
    """A training run records the allocator settings it ran with, and torch's own record of its
    segments (torch.cuda.memory._snapshot) shows them expandable where hpcbert set the default after
    torch was imported and before CUDA first allocated (as benchmarks/gpu.py does; the CLI sets it
    before importing torch); with a user's expandable_segments:False, the control, they are not."""
    env = {k: v for k, v in run_env().items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    run(*TINY, "--max-steps", 2, "--out", tmp_path / "r", env=env)
    assert read_summary(tmp_path / "r")["hardware"]["allocator"] == "expandable_segments:True"
    code = ("import json, torch, hpcbert; hpcbert.cuda_allocator_default(); x = torch.ones(2**20, device='cuda'); "
            "print(json.dumps([s.get('is_expandable') for s in torch.cuda.memory._snapshot()['segments']]))")
    for user, expandable in ((None, True), ("expandable_segments:False", False)):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**env, **({"PYTORCH_CUDA_ALLOC_CONF": user} if user else {})})
        assert r.returncode == 0, r.stderr[-3000:]
        flags = json.loads(r.stdout.strip().splitlines()[-1])
        assert flags and all(f is expandable for f in flags), (user, flags)
