"""Data parallelism on CPU with gloo: 1 process vs 2 give the same numbers, per-rank batches give
the gradient of one big batch, epochs and evaluation see every example exactly once, only rank 0
writes, and a rank that never starts is named within the start-up timeout.

Multi-process runs go through the real CLI under torchrun, wrapped by tests/ddp_probe.py, which
records per rank (from outside) parameter hashes, gradients, data shards and file writes.
"""

from __future__ import annotations

import math
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, run_env
from hpcbert import batching
from hpcbert.config import RunConfig
from hpcbert.dist import Dist
from hpcbert.runfiles import read_metrics, read_summary

PROBE = ROOT / "tests" / "ddp_probe.py"
# Dropout off and fp32, so 1 and 2 processes compute the same function; no clipping, so the
# recorded gradient is the raw one.
COMMON = ["train", "--model", "bert-tiny", "--task", "synthetic", "--threads", "1", "--dropout", "0",
          "--precision", "fp32", "--max-grad-norm", "0", "--log-every", "1", "--synthetic-dev-size", "7",
          "--dist-timeout", "60"]


class Run:
    def __init__(self, out: Path, proc: subprocess.CompletedProcess, world: int):
        self.out, self.proc, self.world = out, proc, world
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        self.ranks = [torch.load(out / "probe" / f"rank{r}.pt") for r in range(world)]
        self.summary = read_summary(out / "run")
        self.losses = [m["loss"] for m in read_metrics(out / "run")]


def launch(tmp: Path, nproc: int, *args) -> Run:
    env = run_env()
    # a cache of its own, empty: what a rank writes to it is seen whatever ran before
    env.update(PROBE_OUT=str(tmp / "probe"), TMPDIR=str(tmp), OMP_NUM_THREADS="1", HPCBERT_CACHE=str(tmp / "cache"))
    (tmp / "cwd").mkdir(parents=True)
    cmd = [sys.executable, str(PROBE)] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(PROBE)]
    proc = subprocess.run([*cmd, *COMMON, *map(str, args), "--out", str(tmp / "run")], env=env, cwd=tmp / "cwd",
                          capture_output=True, text=True, timeout=120)
    return Run(tmp, proc, nproc)


# 37 examples, global batch 8: steps of 8, 8, 8, 8 and a short 5 (split 3 + 2 between two ranks).
@pytest.fixture(scope="module")
def one_proc_8(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("p1b8"), 1, "--batch-size", 8, "--synthetic-train-size", 37,
                  "--max-steps", 5)


@pytest.fixture(scope="module")
def two_proc_4(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("p2b4"), 2, "--batch-size", 4, "--synthetic-train-size", 37,
                  "--max-steps", 5)


# 17 examples, per-rank 3 + 5: steps of 8, 8 and 1 -- the last gives rank 0 nothing.
@pytest.fixture(scope="module")
def one_proc_8_of_17(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("p1b8s17"), 1, "--batch-size", 8, "--synthetic-train-size", 17,
                  "--epochs", 1, "--synthetic-dev-size", 1)


@pytest.fixture(scope="module")
def two_proc_3_5(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("p2b35"), 2, "--per-rank-batch", "3,5", "--synthetic-train-size", 17,
                  "--epochs", 1, "--synthetic-dev-size", 1)  # one dev example: rank 1 scores none


def rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm())


slow = pytest.mark.slow


@slow
def test_two_processes_give_the_losses_of_one_and_identical_parameters(one_proc_8, two_proc_4):
    assert len(one_proc_8.losses) == len(two_proc_4.losses) == 5
    for a, b in zip(two_proc_4.losses, one_proc_8.losses):
        assert abs(a - b) <= 1e-5 * abs(b), (two_proc_4.losses, one_proc_8.losses)
    r0, r1 = two_proc_4.ranks
    assert len(r0["param_sha256"]) == 5 and r0["param_sha256"] == r1["param_sha256"]  # bit-identical, every step
    assert two_proc_4.summary["global_batch_size"] == 8 and two_proc_4.summary["per_device_batch_size"] == 4


@slow
def test_gradient_checkpointing_works_under_ddp(one_proc_8, tmp_path):
    ckpt = launch(tmp_path, 2, "--batch-size", 4, "--synthetic-train-size", 37, "--max-steps", 5,
                  "--grad-ckpt", "all")
    assert ckpt.summary["ckpt_layers"] == [0, 1]
    for a, b in zip(ckpt.losses, one_proc_8.losses):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert ckpt.ranks[0]["param_sha256"] == ckpt.ranks[1]["param_sha256"]


@slow
def test_per_rank_batches_3_and_5_give_the_gradient_of_one_batch_of_8(one_proc_8_of_17, two_proc_3_5):
    r0, r1 = two_proc_3_5.ranks
    ref = one_proc_8_of_17.ranks[0]["grads"]
    assert len(ref) == len(r0["grads"]) == 3
    # Rank 0 had no example in the last global batch (1 example, split 3:5) and still took part.
    assert [len(s[0]) for s in r0["shards"]] == [3, 3, 0] and [len(s[0]) for s in r1["shards"]] == [5, 5, 1]
    for step, (g0, g1, g) in enumerate(zip(r0["grads"], r1["grads"], ref)):
        assert torch.equal(g0, g1), f"step {step + 1}: ranks hold different gradients"
        assert rel(g0, g) <= 1e-5, f"step {step + 1}: relative gradient difference {rel(g0, g):.2e}"
    assert r0["param_sha256"] == r1["param_sha256"]
    s = two_proc_3_5.summary
    assert (s["per_device_batch_size"], s["global_batch_size"], s["sequences"], s["steps"]) == ([3, 5], 8, 17, 3)


@slow
@pytest.mark.parametrize("which,n", [("two_proc_4", 37), ("two_proc_3_5", 17)])
def test_an_epoch_visits_every_training_example_once(which, n, request):
    run = request.getfixturevalue(which)
    seen = [i for rank in run.ranks for step in rank["shards"] for micro in step for i in micro]
    assert sorted(seen) == list(range(n))


@slow
def test_distributed_evaluation_scores_every_dev_example_once(one_proc_8, two_proc_4):
    # 7 dev examples over 2 ranks (4 + 3): every rank ends with all 7 predictions, in example order.
    one, two = one_proc_8.summary["eval"]["dev"], two_proc_4.summary["eval"]["dev"]
    assert two["accuracy"] == one["accuracy"] and abs(two["loss"] - one["loss"]) <= 1e-5 * one["loss"]
    assert 7 * two["accuracy"] == pytest.approx(round(7 * two["accuracy"]))  # a count out of 7, not of 8


@slow
def test_evaluation_with_fewer_dev_examples_than_ranks(one_proc_8_of_17, two_proc_3_5):
    one, two = one_proc_8_of_17.summary["eval"]["dev"], two_proc_3_5.summary["eval"]["dev"]
    assert two["accuracy"] == one["accuracy"] in (0.0, 1.0) and abs(two["loss"] - one["loss"]) <= 1e-5 * one["loss"]


@slow
def test_only_rank_0_writes_files(two_proc_4):
    # torch itself may create its compile cache dir ($TMPDIR/torchinductor_USER) in any process.
    r0, r1 = ([w for w in r["writes"] if "torchinductor_" not in w] for r in two_proc_4.ranks)
    assert r1 == []  # not even the machine's peak FLOP/s cache, which starts empty here (CI saw rank 1 write it)
    run_dir, cache = two_proc_4.out / "run", two_proc_4.out / "cache"
    assert any(Path(p).resolve().is_relative_to(cache.resolve()) for p in r0)  # rank 0 measured the peak
    r0 = [p for p in r0 if not Path(p).resolve().is_relative_to(cache.resolve())]
    assert r0 and all(Path(p).resolve().is_relative_to(run_dir.resolve()) for p in r0), r0
    # the run's files and its final model (--save-model: model/ and the classifier's labels.json)
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json", "labels.json", "metrics.jsonl", "model",
                                                        "summary.json"]
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4, 5]  # one writer, no duplicate lines
    assert list((two_proc_4.out / "cwd").iterdir()) == []


@slow
def test_summary_shows_per_rank_step_times_and_the_policies(two_proc_3_5):
    s = two_proc_3_5.summary
    t = s["per_rank_step_time_s"]
    assert len(t["per_rank"]) == 2 and t["min"] <= t["median"] <= t["max"]
    assert t["slowest_rank"] == int(np.argmax(t["per_rank"])) and t["max"] == max(t["per_rank"])
    assert s["dist_backend"] == "gloo" and s["lr_scaling"] == "none" and s["world_size"] == 2
    assert "per-rank 3+5 x 1 accum = 8 global" in two_proc_3_5.proc.stderr
    assert "backend gloo, 1 thread(s) each" in two_proc_3_5.proc.stderr
    glibc = sys.platform == "linux" and __import__("platform").libc_ver()[0] == "glibc"
    assert s["host_allocator"] == ("glibc-retain" if glibc else "system")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank_0_that_cannot_listen_on_master_port_says_so_and_what_to_do():
    # Another process holds MASTER_PORT on rank 0's machine: the error must name the port and the
    # remedy, not blame a rank 0 that "never started" (rank 0 is the one reporting).
    from hpcbert.dist import Rendezvous, StartupError, check_in
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        t0 = time.time()
        with pytest.raises(StartupError) as e:
            check_in(0, 2, 20, Rendezvous("127.0.0.1", port, "hpcbert/test", host_store=True))
    assert time.time() - t0 < 10  # at once, not after the timeout
    assert f"rank 0 hosts the rendezvous store but cannot listen on port {port}" in str(e.value)
    assert "set MASTER_PORT to a free port" in str(e.value) and "never started" not in str(e.value)


@slow
@pytest.mark.parametrize("started,world,missing", [((0, 1), 3, "rank(s) 2 never arrived"),
                                                    ((1,), 2, "(missing rank: 0)")])
def test_a_rank_that_never_starts_is_named_within_the_timeout(tmp_path, started, world, missing):
    port, timeout = _free_port(), 5
    procs = []
    t0 = time.time()
    for r in started:  # by hand, no torchrun: the rank that is not started simply never comes
        env = run_env()
        env.update(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "hpcbert.cli", *COMMON[:-1], str(timeout),
                                       "--out", str(tmp_path / "run")], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout + 30)[1])
        except subprocess.TimeoutExpired:
            p.kill()
            pytest.fail("a rank hung instead of failing within the start-up timeout")
    wall = time.time() - t0
    for p, err in zip(procs, outs):
        assert p.returncode == 1, err
        assert missing in err and "Traceback" not in err, err
    assert wall < timeout + 20


@slow
def test_per_rank_batch_entries_must_match_world_size(tmp_path):
    r = subprocess.run([sys.executable, "-m", "hpcbert.cli", *COMMON, "--per-rank-batch", "4,4",
                        "--out", str(tmp_path / "run")], env=run_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "per_rank_batch: '4,4' has 2 entries but WORLD_SIZE=1" in r.stderr


@slow
def test_auto_per_rank_batch_on_cpu_uses_batch_size(tmp_path):
    r = subprocess.run([sys.executable, "-m", "hpcbert.cli", *COMMON, "--per-rank-batch", "auto", "--batch-size", "4",
                        "--max-steps", "2", "--synthetic-train-size", "16", "--no-do-eval", "--out",
                        str(tmp_path / "run")], env=run_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "no device memory to probe on cpu; every rank uses --batch-size 4" in r.stderr
    assert read_summary(tmp_path / "run")["per_device_batch_size"] == 4


# --- batch arithmetic (no processes) ------------------------------------------------------------

def cpu_dist(world: int, rank: int = 0) -> Dist:
    return Dist(rank, world, 0, world, torch.device("cpu"), "gloo" if world > 1 else None, 1)


@pytest.mark.parametrize("scaling,factor", [("none", 1.0), ("linear", 4.0), ("sqrt", 2.0)])
def test_epochs_map_to_steps_through_the_global_batch(scaling, factor):
    cfg = RunConfig(batch_size=8, grad_accum=2, epochs=3, lr=1e-4, lr_scaling=scaling, warmup_ratio=0.1)
    p = batching.plan(cfg, 1000, [8] * 4)
    assert p.global_batch == 64 and p.steps_per_epoch == math.ceil(1000 / 64) == 16
    assert p.total_steps == 48 and p.warmup_steps == 5 and p.lr == pytest.approx(1e-4 * factor)
    assert "lr 0.0004" in batching.plan(cfg.replace(lr_scaling="linear"), 1000, [8] * 4).describe(1000)
    mixed = batching.plan(cfg.replace(max_steps=7), 1000, [32, 32, 16, 16])
    assert mixed.global_batch == 192 and mixed.total_steps == 7 and "per-rank 32+32+16+16" in mixed.describe(1000)


def test_per_rank_batches_come_from_the_list_or_the_batch_size():
    assert batching.per_rank_batches(RunConfig(batch_size=6), cpu_dist(3)) == [6, 6, 6]
    assert batching.per_rank_batches(RunConfig(per_rank_batch="32,32,16,16"), cpu_dist(4)) == [32, 32, 16, 16]
    with pytest.raises(ValueError, match="has 3 entries but WORLD_SIZE=4"):
        batching.per_rank_batches(RunConfig(per_rank_batch="8,8,8"), cpu_dist(4))
    with pytest.raises(ValueError, match="per_rank_batch: cannot read '8,0'"):
        RunConfig(per_rank_batch="8,0")
    logged = []
    assert batching.per_rank_batches(RunConfig(per_rank_batch="auto", batch_size=5), cpu_dist(1),
                                     probe=lambda: 99, log=logged.append) == [5]
    assert "nothing" not in logged[0] and "no device memory to probe on cpu" in logged[0]


@pytest.mark.parametrize("largest,limit,expected", [(37, 4096, 37), (1, 64, 1), (0, 64, 0), (5000, 4096, 4096),
                                                    (64, 64, 64)])
def test_the_batch_probe_search_finds_the_largest_size_that_fits(largest, limit, expected):
    tried = []
    fits = lambda b: tried.append(b) or b <= largest  # noqa: E731
    assert batching.largest_that_fits(fits, limit) == expected
    assert max(tried) <= limit and len(tried) <= 2 * math.log2(limit) + 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_batch_on_a_gpu_fits_and_grows_with_checkpointing():
    from hpcbert import policies, zoo
    from hpcbert.model import BertForSequenceClassification
    src = zoo.resolve("bert-base")
    dev = torch.device("cuda", 0)
    amp = lambda: policies.autocast("bf16", dev)  # noqa: E731
    sizes = {}
    for policy in ("none", "all"):
        model = BertForSequenceClassification(type(src.config)(**{**src.config.to_dict(), "num_labels": 2})).to(dev)
        policies.apply_grad_ckpt(model, policy)
        def loss_of(b: int, model=model) -> torch.Tensor:
            ids = torch.randint(0, model.config.vocab_size, (b, 512), device=dev)
            with amp():
                return model.loss_sum(model(ids, None, torch.zeros_like(ids)), torch.zeros(b, dtype=torch.long, device=dev))

        sizes[policy] = batching.probe_max_batch(model, loss_of, dev, limit=2048)
        del model
        torch.cuda.empty_cache()
    assert 1 <= sizes["none"] < sizes["all"]


@slow
def test_grad_accumulation_under_ddp_gives_the_losses_and_parameters_of_one_process(one_proc_8, tmp_path):
    # 2 ranks x batch 2 x 2 micro-batches = the global batch 8 of one process: DDP's no_sync on
    # the first micro-batch, one all-reduce on the last, the same losses and the same parameters.
    accum = launch(tmp_path, 2, "--batch-size", 2, "--grad-accum", 2, "--synthetic-train-size", 37,
                   "--max-steps", 5)
    assert accum.summary["global_batch_size"] == 8 and accum.summary["grad_accum"] == 2
    for a, b in zip(accum.losses, one_proc_8.losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (accum.losses, one_proc_8.losses)
    r0, r1 = accum.ranks
    assert r0["param_sha256"] == r1["param_sha256"]
    assert all(len(step) == 2 for step in r0["shards"])  # two micro-batches per step on each rank
    for g, ref in zip(r0["grads"], one_proc_8.ranks[0]["grads"], strict=True):
        assert rel(g, ref) <= 1e-5


# --- host allocator (dist.tune_host_allocator) -------------------------------------------------

_FAULTS = """
import resource, sys, torch
from hpcbert import dist
print(dist.tune_host_allocator())
sizes = [48 << 20, 8 << 20, 40 << 20, 1 << 20]   # a step's buffers: some over glibc's 32 MiB mmap limit
for i in range(8):                                # allocate, touch (torch.ones), free, as steps do
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    xs = [torch.ones(n // 4) for n in sizes]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    del xs
print(faults, sum(sizes) // 4096)
"""


@pytest.mark.skipif(sys.platform != "linux" or __import__("platform").libc_ver()[0] != "glibc",
                    reason="mallopt tuning is glibc's (Linux); elsewhere tune_host_allocator leaves malloc alone")
@pytest.mark.parametrize("setting", ["retain", "system"])
def test_host_allocator_keeps_freed_buffers_mapped_for_the_next_step(setting):
    # The kernel's minor-fault count of the process: a step that reuses memory kept mapped touches
    # no new page; one that gets fresh mmaps faults once per 4 KiB page it writes.
    env = run_env() | {"HPCBERT_HOST_ALLOCATOR": setting}
    out = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    applied, counts = out.stdout.split("\n")[:2]
    faults, pages = map(int, counts.split())
    if setting == "retain":
        assert applied == "glibc-retain"
        assert faults < 0.05 * pages, f"{faults} page faults in a step that writes {pages} pages"
    else:
        assert applied == "system"
        assert faults > 0.5 * pages, f"only {faults} faults for {pages} fresh pages: the test does not see mmaps"


def test_host_allocator_setting_must_be_known(monkeypatch):
    from hpcbert import dist
    monkeypatch.setenv("HPCBERT_HOST_ALLOCATOR", "jemalloc")
    with pytest.raises(ValueError, match="HPCBERT_HOST_ALLOCATOR='jemalloc'; accepted: retain .* or system"):
        dist.tune_host_allocator()


def test_under_ddp_the_gradients_are_views_of_its_buckets_and_stay_exact(tmp_path):
    """dist.data_parallel (the training loop's DDP): after each backward, two of them with the
    gradients set to None between (as the loop's zero_grad does), every parameter's gradient lies in
    one of DDP's few bucket storages, not a storage of its own, so the gradients are held once; and
    they equal autograd's without DDP (one process: the all-reduce averages one rank)."""
    import copy

    import torch.distributed as tdist

    from hpcbert.dist import data_parallel
    from hpcbert.model import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=64,
                                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    ref = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        ddp = data_parallel(model, Dist(rank=0, world_size=1, local_rank=0, local_world_size=1,
                                        device=torch.device("cpu"), backend="gloo"))
        for step in range(2):
            ids = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(step))
            ddp(ids).sum().backward()
            ref(ids).sum().backward()
            storages = {p.grad.untyped_storage().data_ptr() for p in params}
            assert len(storages) <= 3 < len(params), (step, len(storages), len(params))
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=f"step {step}: {name}")
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
        del ddp
    finally:
        tdist.destroy_process_group()
