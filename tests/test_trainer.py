"""The Trainer and its objective interface, in process on a tiny model: the step never syncs the
device, the per-step agreement read one step late gives the same run, the time-fitted LR horizon,
the shared CPU peak, precision choices on GPUs we do not have (mocked capability), start-up
errors that leave no run directory, and the objective protocol."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import run_env
from hpcbert import batching, dist, meters, model, objectives, optim, policies
from hpcbert.config import RunConfig
from hpcbert.model import BertConfig, BertForSequenceClassification
from hpcbert.runfiles import read_metrics, read_summary
from hpcbert.train import LRSchedule, Trainer, train

TINY = dict(model="bert-tiny", task="synthetic", batch_size=8, synthetic_train_size=64, synthetic_dev_size=16,
            log_every=1, threads=1, precision="fp32")


def cli(*args, cwd=None, timeout=240, env=None):
    return subprocess.run([sys.executable, "-m", "hpcbert.cli", *map(str, args)], env=env or run_env(), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


# --- the hot loop ------------------------------------------------------------------------------

class _NoSync:
    """Make every host read of a tensor's value raise: .item(), .tolist(), float(), int(), bool()."""

    NAMES = ("item", "tolist", "__float__", "__int__", "__bool__", "numpy", "__index__")

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def refuse(name):
            def f(*a, **k):
                raise AssertionError(f"Tensor.{name} called inside the step (a host-device sync)")
            return f
        for n in self.NAMES:
            setattr(torch.Tensor, n, refuse(n))
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


def test_a_step_lets_its_graph_go_before_the_optimizer_step(monkeypatch, tmp_path):
    """What a checkpointed layer's autograd nodes hold outside their saved tensors (under alternate:
    the kept K and V, a LayerNorm's kept output, dropout-mask bits) goes with the graph. The step
    lets the graph go after each micro-batch's backward, so by gradient clipping, just before the
    optimizer step, nothing of it is held: every registry of kept tensors is empty (bert-tiny's
    layer 0 is recomputed; two micro-batches a step)."""
    from hpcbert import train as train_module

    seen = []
    real_clip = train_module.clip_grad_norm

    def clip(params, max_norm):
        seen.append((len(model._KEPT_KV), len(model._DRAWN_MASKS)))
        return real_clip(params, max_norm)

    monkeypatch.setattr(train_module, "clip_grad_norm", clip)
    train(RunConfig(**TINY, grad_ckpt="alternate", grad_accum=2, max_steps=2,
                    do_eval=False, save_model=False, out=str(tmp_path / "run")))
    assert seen == [(0, 0), (0, 0)]


def test_a_step_reads_no_tensor_value_on_the_host(tmp_path, monkeypatch):
    # Reads are allowed of CPU tensors only, through model.cpu_value (which refuses any other
    # device): clipping's "is the norm within the bound?" once per step, and each CPU dropout
    # mask's seed (model.keep_mask).
    d = dist.init(threads=1)
    cfg = RunConfig(**TINY, max_steps=3, out=str(tmp_path / "run"), grad_accum=2)
    tr = Trainer(cfg, d, objectives.get(cfg))
    gb = np.arange(16)
    item, reads = torch.Tensor.item, []

    def read(t):
        reads.append((t.device.type, t.dtype))
        return item(t)

    masks = []
    real_keep_mask = model.keep_mask

    def keep_mask(*a):
        masks.append(a[0])
        return real_keep_mask(*a)

    monkeypatch.setattr(model, "cpu_value", read)
    monkeypatch.setattr(optim, "cpu_value", read)
    monkeypatch.setattr(model, "keep_mask", keep_mask)
    with _NoSync():
        loss, grad_norm, counts = tr.step(gb)
    assert masks, "the tiny model trains with dropout"
    # one read of the clipping norm (a float) and one seed (int64) per dropout mask drawn
    assert sorted(reads, key=str) == sorted([("cpu", torch.float32)] + [("cpu", torch.int64)] * len(masks), key=str)
    # The values are there, on the device, for whoever reads them later.
    assert torch.isfinite(loss) and float(loss) > 0 and float(grad_norm) > 0
    assert counts[0] > 0 and counts[1] >= counts[0]


def test_clipping_reads_no_value_of_gradients_off_the_cpu():
    # meta tensors stand in for a GPU's: clipping must scale them without reading the norm
    ps = [torch.nn.Parameter(torch.zeros(4, 3, device="meta")), torch.nn.Parameter(torch.zeros(5, device="meta"))]
    for p in ps:
        p.grad = torch.ones_like(p)
    with _NoSync():
        norm = optim.clip_grad_norm(ps, 1.0)
    assert norm.device.type == "meta"
    with pytest.raises(ValueError, match="meta tensor; reading it would make the host wait"):
        model.cpu_value(norm)


def test_the_sync_detector_detects_a_sync():
    with _NoSync(), pytest.raises(AssertionError, match="Tensor.item"):
        torch.ones(()).item()


def test_one_agreement_per_step_with_everything_the_ranks_need(monkeypatch, tmp_path):
    posted = []
    real_post = dist.Agreement.post

    def post(self, tag, host, device_values=()):
        posted.append((tag, list(host), len(device_values)))
        return real_post(self, tag, host, device_values)

    monkeypatch.setattr(dist.Agreement, "post", post)
    s = train(RunConfig(**TINY, max_steps=4, out=str(tmp_path / "run")))
    steps = [p for p in posted if p[0] is not None]
    assert len(posted) == 5 and len(steps) == 4  # the decision before step 1, then one per step
    assert [p[0].step for p in steps] == [1, 2, 3, 4]
    # stop code, signal, save request, evaluation request + real tokens, padded tokens, FLOPs;
    # on the device: loss, non-finite, norm
    assert all(len(p[1]) == 7 and p[2] == 3 for p in steps)
    assert s["steps"] == 4 and s["nonfinite_grad_steps"] == 0


def test_reading_the_agreement_one_step_late_gives_the_same_run(monkeypatch, tmp_path):
    base = dict(TINY, dropout=0.0, max_steps=6, checkpoint_steps=3)
    a = train(RunConfig(**base, out=str(tmp_path / "lag0")))
    real_init = dist.Agreement.__init__
    monkeypatch.setattr(dist.Agreement, "__init__", lambda self, d, lag=None: real_init(self, d, lag=1))
    b = train(RunConfig(**base, out=str(tmp_path / "lag1")))
    la = [m["loss"] for m in read_metrics(tmp_path / "lag0")]
    lb = [m["loss"] for m in read_metrics(tmp_path / "lag1")]
    assert len(la) == 6 and la == pytest.approx(lb, rel=1e-6)
    assert a["steps"] == b["steps"] == 6
    assert sorted(p.name for p in (tmp_path / "lag1" / "checkpoints").iterdir()) == ["step-00000003", "step-00000006"]


def test_agreement_keeps_lag_results_pending_until_flushed():
    d = dist.Dist(0, 1, 0, 1, torch.device("cpu"))
    a = dist.Agreement(d, lag=1)
    a.post("s1", [1.0, 2.0], [torch.tensor(3.0)])
    assert a.ready() == []
    a.post("s2", [4.0, 5.0], [torch.tensor(6.0)])
    assert a.ready() == [("s1", [1.0, 2.0, 3.0])]
    assert a.ready(flush=True) == [("s2", [4.0, 5.0, 6.0])]


def test_steady_figures_leave_compile_steps_out_unless_every_timed_step_compiled():
    m = meters.StepMeter()
    for sec, compiled in [(9.0, True), (1.0, False), (30.0, True), (2.0, False), (3.0, False)]:
        m.add(sec, 10, 100, 120, 1e9, 0.0, compiled=compiled)
    s = m.steady(1)  # steps 2..5 less step 3: 1 + 2 + 3 s for 30 sequences
    assert m.timed(1) == [1, 3, 4] and s["steady_sequences_per_sec"] == pytest.approx(30 / 6.0)
    assert s["steady_step_time_s"] == 2.0 and s["tokens_per_sec"] == pytest.approx(300 / 6.0)
    only = meters.StepMeter()
    for sec in (5.0, 4.0):
        only.add(sec, 10, 100, 120, 1e9, 0.0, compiled=True)
    assert only.timed(1) == [1] and only.steady(1)["steady_sequences_per_sec"] == pytest.approx(10 / 4.0)


@pytest.mark.parametrize("lag", [0, 1])
def test_a_compile_is_timed_in_the_step_that_compiled_also_when_read_a_step_late(monkeypatch, tmp_path, lag):
    """A compile is host time inside one step. Read one step late (the GPU's lag), the interval that
    ends at step 2's reading holds step 3's host part: the compile's seconds belong to step 3.
    Stand-in: step 3 sleeps 0.6 s and dynamo's graph count goes up by one in it (no real compile)."""
    pause, calls, graphs = 0.6, [0], [0]
    real_step, real_init = Trainer.step, dist.Agreement.__init__

    def step(self, gb, epoch=0):
        calls[0] += 1
        if calls[0] == 3:
            time.sleep(pause)
            graphs[0] += 1
        return real_step(self, gb, epoch)

    monkeypatch.setattr(policies, "resolve_compile", lambda mode, device: True)
    monkeypatch.setattr(policies, "maybe_compile", lambda model, enabled, mode="default": model)
    monkeypatch.setattr(policies, "compiled_graphs", lambda: graphs[0])
    monkeypatch.setattr(Trainer, "step", step)
    monkeypatch.setattr(dist.Agreement, "__init__", lambda self, d, lag_=None: real_init(self, d, lag=lag))
    s = train(RunConfig(**TINY, max_steps=5, out=str(tmp_path / "run")))
    times = {m["step"]: m["step_time_s"] for m in read_metrics(tmp_path / "run")}
    (c,) = s["compile_steps"]
    assert (c["step"], c["graphs"]) == (3, 1)
    assert c["host_s"] >= pause and c["step_s"] >= pause and times[3] >= pause
    # the other steps: a tiny model's (tens of ms), none holding the pause
    assert max(t for k, t in times.items() if k != 3) < pause / 2, times
    # the steady figures: the timed steps (2..5 of 5: the first is untimed) less the compile step,
    # reported apart
    assert s["warmup_steps_excluded"] == 1 and "and step 3, in which torch.compile compiled" in s["throughput_method"]
    assert s["steady_step_time_s"] == pytest.approx(np.median([times[2], times[4], times[5]]), rel=1e-3)
    assert s["steady_sequences_per_sec"] == pytest.approx(3 * 8 / (times[2] + times[4] + times[5]), rel=1e-3)


# --- the LR schedule fitted to the time box ----------------------------------------------------

def test_lr_schedule_warmup_then_linear_decay_and_refit():
    s = LRSchedule(warmup=4, horizon=20)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(12) == pytest.approx((20 - 12) / 16) and s(20) == 0.0 and s(25) == 0.0
    s.refit(warmup=2, horizon=10)
    assert s(1) == 1.0 and s(6) == pytest.approx(4 / 8) and s(10) == 0.0


@pytest.mark.alone
def test_a_time_boxed_run_decays_to_zero_inside_its_box(tmp_path):
    # Planned: 3 epochs of 4096 examples (1536 steps); the 20 s box (start-up included) holds far fewer.
    out = tmp_path / "run"
    r = cli("train", "--model", "bert-tiny", "--task", "synthetic", "--batch-size", 8, "--epochs", 3,
            "--time-budget", "20s", "--lr-horizon", "time-budget", "--log-every", 1, "--threads", 1,
            "--precision", "fp32", "--synthetic-dev-size", 16, "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    s = read_summary(out)
    assert s["stopped_by"] == "time_budget" and s["steps"] > 3, "the box must hold more than the fitting steps"
    assert s["lr_horizon_steps"] < 1536
    assert "time budget" in s["lr_horizon_source"]
    lrs = [m["lr"] for m in read_metrics(out)]
    peak = max(lrs)
    # Decays after the peak; the last step ran at a small fraction of it (the planned schedule
    # would still be in its warm-up here: 154 warm-up steps).
    assert lrs[-1] < 0.35 * peak, lrs
    # The horizon the run used is where it would have reached zero: never far past the box.
    assert s["lr_horizon_steps"] <= 2 * s["steps"] + 5
    # Refitted as the run went (the first fit has two steps to go on), and every refit kept the LR
    # continuous: after the peak it only ever decreases.
    assert int(s["lr_horizon_source"].rsplit("(fit ", 1)[1].rstrip(")")) > 1, s["lr_horizon_source"]
    after = lrs[lrs.index(peak):]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(after, after[1:])), after


def test_lr_schedule_refit_during_the_decay_is_continuous():
    from hpcbert.train import LRSchedule

    s = LRSchedule(warmup=10, horizon=110)
    assert s(4) == pytest.approx(0.5) and s(10) == pytest.approx(1.0) and s(60) == pytest.approx(0.5)
    # At step 60 (multiplier 0.5) the horizon moves to 160: from there 0.5 x (160 - step) / 100.
    s.refit(10, 160, anchor=(60, s(60)))
    assert s(60) == pytest.approx(0.5) and s(110) == pytest.approx(0.25) and s(160) == 0.0
    assert s(5) == pytest.approx(0.6)  # the warm-up is unchanged
    p = LRSchedule(warmup=0, horizon=100, power=0.5)
    p.refit(0, 200, anchor=(75, p(75)))  # p(75) = 0.5
    assert p(75) == pytest.approx(0.5) and p(200 - 125 / 4) == pytest.approx(0.25)  # 0.5 x (1/4) ** 0.5


def test_time_budget_horizon_needs_a_budget():
    with pytest.raises(ValueError, match="lr_horizon: 'time-budget' fits the LR decay to --time-budget"):
        RunConfig(lr_horizon="time-budget")


# --- devices we do not have: precision by compute capability -----------------------------------

@pytest.mark.parametrize("capability,expected", [((7, 0), "fp32"), ((7, 5), "fp32"), ((8, 0), "bf16"),
                                                 ((9, 0), "bf16")])
def test_auto_precision_is_bf16_only_from_ampere(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # counts emulation (V100/T4)
    assert policies.resolve_precision("auto", torch.device("cuda", 0)) == expected


def test_tf32_for_fp32_on_ampere_only(monkeypatch):
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
        assert policies.enable_tf32("fp32", torch.device("cuda", 0)) is False
        assert torch.backends.cuda.matmul.allow_tf32 is False
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        assert policies.enable_tf32("bf16", torch.device("cuda", 0)) is False
        assert policies.enable_tf32("fp32", torch.device("cpu")) is False
        assert policies.enable_tf32("fp32", torch.device("cuda", 0)) is True
        assert torch.backends.cuda.matmul.allow_tf32 is True and torch.backends.cudnn.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("name,label,bf16", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989e12), ("NVIDIA H100 PCIe", "H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", "H100 NVL", 835e12), ("NVIDIA A10", "A10", 125e12), ("NVIDIA A10G", "A10G", 70e12),
    ("NVIDIA A100-SXM4-80GB", "A100", 312e12), ("NVIDIA H200", "H200", 989e12)])
def test_gpu_peaks_tell_the_variants_apart(name, label, bf16):
    value, source = meters.gpu_peak_flops(name, "bf16")
    assert value == bf16 and source.endswith(f"{label} bf16")


def test_cpu_peak_is_measured_once_per_machine_and_only_moves_up(monkeypatch, tmp_path):
    monkeypatch.setenv("HPCBERT_CACHE", str(tmp_path))
    measured = iter([100e9, 50e9, 300e9])
    monkeypatch.setattr(meters, "measure_cpu_peak", lambda dtype, **k: next(measured))
    cpu = torch.device("cpu")
    assert meters.peak_flops(cpu, "fp32")[0] == 100e9
    assert meters.peak_flops(cpu, "fp32")[0] == 100e9          # cached: not measured again
    assert meters.peak_flops(cpu, "fp32", refresh=True)[0] == 100e9  # a slower re-measure does not lower it
    assert meters.peak_flops(cpu, "fp32", refresh=True)[0] == 300e9
    assert json.loads((tmp_path / "peak_flops.json").read_text())  # one file, readable


def test_probe_catches_the_cuda_oom_class_that_torch_2_3_has(monkeypatch):
    # torch 2.3 (allowed by pyproject) has torch.cuda.OutOfMemoryError but no torch.OutOfMemoryError.
    model = torch.nn.Linear(2, 2)
    monkeypatch.delattr(torch, "OutOfMemoryError", raising=False)
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: real_empty(1))

    def loss_of(b):
        if b > 6:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return model(torch.ones(b, 2)).sum()

    assert batching.probe_max_batch(model, loss_of, torch.device("cuda", 0), limit=64) == int(6 * 0.9)


# --- start-up: user errors are one line, and a failed start leaves no run directory ------------

def test_resume_from_a_path_that_does_not_exist_fails_at_once_in_one_line(tmp_path):
    out = tmp_path / "run"
    t0 = time.time()
    r = cli("train", "--model", "bert-tiny", "--max-steps", 2, "--resume", tmp_path / "nope", "--out", out)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    err = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(err) == 1 and f"{tmp_path / 'nope'} does not exist" in err[0]
    assert "MANIFEST" not in r.stderr and "RANDOM weights" not in r.stderr  # before model and data
    assert not out.exists() and time.time() - t0 < 60


@pytest.mark.parametrize("args,words", [
    (["--task", "mrpx", "--data-dir", "."], "mrpx"),
    (["--task", "mrpc", "--data-dir", "/nonexistent-glue"], "/nonexistent-glue"),
])
def test_a_failed_start_leaves_no_run_directory(tmp_path, args, words):
    out = tmp_path / "run"
    r = cli("train", "--model", "bert-tiny", "--max-steps", 2, *args, "--out", out)
    assert r.returncode == 2 and "Traceback" not in r.stderr and words in r.stderr
    assert not out.exists()


def test_a_checkpoint_error_is_one_line_naming_the_file(tmp_path):
    from hpcbert.checkpoint import CheckpointManager
    ck = CheckpointManager(tmp_path / "run" / "checkpoints").save(2, {"model": {"w": torch.ones(1000)}}, {})
    (ck / "shared.pt").write_bytes(b"damaged")
    r = cli("train", "--model", "bert-tiny", "--max-steps", 4, "--resume", ck, "--out", tmp_path / "run")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    err = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(err) == 1 and f"{ck / 'shared.pt'}: 7 bytes, manifest says" in err[0]


def test_every_subcommand_help_exits_0_and_lists_its_options():
    for sub, option in (("train", "--warmup-steps-excluded"), ("bench", "--policies"), ("report", "--format"),
                        ("submit", "--scheduler")):
        r = cli(sub, "--help", timeout=60)
        assert r.returncode == 0, (sub, r.stderr[-1000:])
        assert option in r.stdout and "usage:" in r.stdout
    r = cli("--help", timeout=60)
    assert r.returncode == 0 and all(s in r.stdout for s in ("train", "bench", "report", "submit"))


# --- the stop file of any run ------------------------------------------------------------------

def test_run_dir_stop_file_stops_a_plain_run_with_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    env = run_env()
    env.pop("HPCBERT_STOP_FILE", None)
    proc = subprocess.Popen([sys.executable, "-m", "hpcbert.cli", "train", "--model", "bert-tiny", "--max-steps",
                             "100000", "--batch-size", "4", "--threads", "1", "--log-every", "1", "--out", str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
            assert time.time() < deadline and proc.poll() is None, "the run did not start"
            time.sleep(0.2)
        (out / "STOP").touch()
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    s = read_summary(out)
    assert s["stopped_by"] == "stop_file" and 0 < s["steps"] < 100000
    assert (out / "checkpoints" / f"step-{s['steps']:08d}" / "MANIFEST.json").is_file()
    assert "run the same command again to resume" in err


# --- the model's config.json -------------------------------------------------------------------

def test_hf_config_keys_that_change_the_maths_are_honoured_and_the_others_named(tmp_path):
    raw = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100,
               classifier_dropout=0.0, hidden_dropout_prob=0.5, architectures=["BertModel"], model_type="bert",
               id2label={"0": "neg", "1": "neu", "2": "pos"})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    cfg, ignored = BertConfig.read_json(path)
    assert ignored == ["architectures", "model_type"]
    assert cfg.num_labels == 3 and cfg.classifier_dropout == 0.0
    m = BertForSequenceClassification(cfg).train()
    assert m.dropout.p == 0.0  # HF: classifier_dropout replaces hidden_dropout_prob before the head
    path.write_text(json.dumps({**raw, "is_decoder": True}))
    with pytest.raises(ValueError, match="is_decoder=true is not supported"):
        BertConfig.read_json(path)


# --- the objective protocol --------------------------------------------------------------------

def test_glue_and_synthetic_objectives_implement_the_protocol():
    from hpcbert.objectives.classification import SequenceClassification
    for task, labels in (("synthetic", 2), ("mrpc", 2), ("mnli", 3), ("sts-b", 1)):
        obj = objectives.get(RunConfig(task=task, data_dir="x" if task != "synthetic" else None))
        assert isinstance(obj, SequenceClassification) and obj.name == task
        model = obj.build_model(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                           intermediate_size=64, vocab_size=100))
        batch, norm = obj.example_batch(3, 10, 100)
        assert norm == {"examples": 3.0} == obj.norm(None, np.arange(3), epoch=0)
        out = obj.forward(model, batch)
        assert out.shape == (3, labels)
        loss = obj.loss(model, out, batch, norm)
        preds = objectives.to_host(obj.predict(out, batch))
        assert loss.ndim == 0 and preds["pred"].shape == (3,)
        # The per-example loss terms the evaluation averages are the training loss's terms.
        assert float(np.mean(preds["loss"])) == pytest.approx(float(loss.detach()), rel=1e-6)
        if labels > 1:
            assert obj.hf_config()["id2label"] == {str(i): name for i, name in enumerate(obj.spec.labels)}
    with pytest.raises(ValueError, match="mrpx"):
        objectives.get(RunConfig(task="mrpx", data_dir="x"))


def test_plain_torchrun_without_out_gives_every_rank_one_directory(tmp_path):
    env = run_env()
    env.update(OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "hpcbert.cli", "train", "--model", "bert-tiny", "--max-steps", "2", "--batch-size", "2",
                        "--synthetic-dev-size", "4", "--threads", "1", "--dist-timeout", "60"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    dirs = list((tmp_path / "runs").iterdir())
    assert len(dirs) == 1 and (dirs[0] / "summary.json").is_file(), dirs


# --- torch.compile ---------------------------------------------------------------------------

@pytest.mark.slow
def test_compile_trains_the_same_losses_as_eager(tmp_path):
    common = ["train", "--model", "bert-tiny", "--max-steps", 3, "--batch-size", 8, "--dropout", 0, "--precision",
              "fp32", "--log-every", 1, "--no-do-eval", "--threads", 1]
    cache = tmp_path / "compile-cache"  # new: nothing in it yet
    r = r_compiled = cli(*common, "--compile", "--compile-cache", cache, "--out", tmp_path / "compiled", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli(*common, "--out", tmp_path / "eager")
    assert r.returncode == 0, r.stderr[-3000:]
    compiled = [m["loss"] for m in read_metrics(tmp_path / "compiled")]
    eager = [m["loss"] for m in read_metrics(tmp_path / "eager")]
    assert read_summary(tmp_path / "compiled")["compile"] is True
    assert len(compiled) == 3 and compiled == pytest.approx(eager, rel=1e-5)
    # the first step compiles (the model has run nowhere before), reported apart and in the log
    steps = read_summary(tmp_path / "compiled")["compile_steps"]
    assert steps[0]["step"] == 1 and steps[0]["graphs"] >= 1 and steps[0]["step_s"] > 0
    assert "step 1: torch.compile made" in r_compiled.stderr
    assert read_summary(tmp_path / "eager")["compile_steps"] is None
    # --compile-cache: the first run compiled everything into the new folder; the same run again
    # takes its graphs from there (and trains the same losses)
    first = read_summary(tmp_path / "compiled")["compile_cache"]
    assert first["dir"] == str(cache.resolve()) and first["graphs_from_cache"] == 0 and first["graphs_compiled"] > 0
    assert any(cache.rglob("*")) and read_summary(tmp_path / "eager")["compile_cache"] is None
    r = cli(*common, "--compile", "--compile-cache", cache, "--out", tmp_path / "again", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    again = read_summary(tmp_path / "again")["compile_cache"]
    assert again["graphs_from_cache"] >= 1 and again["graphs_from_cache"] + again["graphs_compiled"] > 0
    assert [m["loss"] for m in read_metrics(tmp_path / "again")] == pytest.approx(compiled, rel=1e-6)


@pytest.mark.slow
def test_compile_mode_max_autotune_trains_the_same_losses_as_eager(tmp_path):
    common = ["train", "--model", "bert-tiny", "--max-steps", 3, "--batch-size", 8, "--dropout", 0, "--precision",
              "fp32", "--log-every", 1, "--no-do-eval", "--threads", 1, "--no-save-model"]
    r = cli(*common, "--compile", "--compile-mode", "max-autotune-no-cudagraphs", "--out", tmp_path / "tuned",
            timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert cli(*common, "--out", tmp_path / "eager").returncode == 0
    assert json.loads((tmp_path / "tuned" / "config.json").read_text())["compile_mode"] == "max-autotune-no-cudagraphs"
    tuned = [m["loss"] for m in read_metrics(tmp_path / "tuned")]
    assert len(tuned) == 3 and tuned == pytest.approx([m["loss"] for m in read_metrics(tmp_path / "eager")], rel=1e-5)
    # the mode without a compile: said, not silently dropped
    r = cli(*common[:4], 1, *common[5:], "--compile", "off", "--compile-mode", "max-autotune-no-cudagraphs",
            "--out", tmp_path / "off")
    assert r.returncode == 0 and "--compile-mode max-autotune-no-cudagraphs: not used, this run does not compile" in r.stderr


def test_compile_mode_reaches_torch_compile_as_its_options_and_cuda_graph_modes_are_refused(monkeypatch):
    import torch._inductor
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda model, **kw: seen.update(kw) or model)
    lin = torch.nn.Linear(2, 2)
    policies.maybe_compile(lin, True, "max-autotune-no-cudagraphs")
    # what the mode stands for, as torch itself lists it (torch.compile takes a mode or options, not both)
    want = torch._inductor.list_mode_options("max-autotune-no-cudagraphs", dynamic=True)
    assert want.get("max_autotune") is True and "mode" not in seen and seen["dynamic"] is True
    assert {k: seen["options"][k] for k in want} == want
    assert not seen["options"].get("triton.cudagraphs")
    assert {k: seen["options"][k] for k in policies.inductor_options()} == policies.inductor_options()
    seen.clear()
    policies.maybe_compile(lin, True)
    assert seen["options"] == (policies.inductor_options() or None)
    with pytest.raises(ValueError, match=r"compile_mode: 'reduce-overhead' captures CUDA graphs.*choose one of "
                                         r"default, max-autotune-no-cudagraphs"):
        RunConfig(compile_mode="reduce-overhead")
    with pytest.raises(ValueError, match="compile_mode: 'fast' is not accepted; choose one of default, "
                                         "max-autotune-no-cudagraphs"):
        RunConfig(compile_mode="fast")


def test_the_summary_says_in_what_precision_the_layer_norms_ran(tmp_path):
    """--norm-precision is recorded as run: low or fp32 under bf16, fp32 in an fp32 run whatever was asked."""
    def ran(name, **kw):
        cfg = RunConfig(**{**TINY, **kw}, max_steps=1, do_eval=False, save_model=False, out=str(tmp_path / name))
        return train(cfg)["norm_precision"], read_summary(tmp_path / name)["norm_precision"]

    assert ran("bf16", precision="bf16") == ("low", "low")
    assert ran("bf16-fp32", precision="bf16", norm_precision="fp32") == ("fp32", "fp32")
    assert ran("fp32", precision="fp32", norm_precision="low") == ("fp32", "fp32")


def test_filler_rows_train_the_same_losses_and_the_summary_says_how_many(tmp_path, monkeypatch):
    """--token-multiple 64 (each padded micro-batch's rows rounded up with filler rows no head reads)
    trains and evaluates as the run without filler, dropout off (a filler row draws dropout too); the
    summary records the multiple: where not given, 1 in fp32 and 32 in bf16 on CPU."""
    rows, build = [], model.Tokens.build

    def spy(*a, **k):
        t = build(*a, **k)
        rows.append((sum(t.lengths), t.fill))
        return t

    monkeypatch.setattr(model.Tokens, "build", spy)

    def run(name, **kw):
        rows.clear()
        cfg = RunConfig(**{**TINY, **kw}, dropout=0.0, max_steps=4, do_eval=True, save_model=False,
                        out=str(tmp_path / name))
        s = train(cfg)
        return [m["loss"] for m in read_metrics(tmp_path / name)], s, list(rows)

    plain, s1, rows1 = run("plain")
    filled, s64, rows64 = run("filled", token_multiple=64)
    assert (s1["token_multiple"], s64["token_multiple"]) == (1, 64)
    assert rows1 and all(f == 0 for _, f in rows1)
    assert all((n + f) % 64 == 0 and f < 64 for n, f in rows64 if f) and any(f for _, f in rows64)
    assert len(plain) == 4 and filled == pytest.approx(plain, rel=1e-6)
    assert s64["eval"]["dev"] == pytest.approx(s1["eval"]["dev"], rel=1e-6)
    # bf16 on CPU, not given: 32 (policies.TOKEN_MULTIPLE_AUTO), and the loop's batches have it
    _, s_bf16, rows_bf16 = run("bf16", precision="bf16")
    assert s_bf16["token_multiple"] == 32 and any(f for _, f in rows_bf16)
    assert all((n + f) % 32 == 0 for n, f in rows_bf16 if f)
    with pytest.raises(ValueError, match="token_multiple: 0; a positive number"):
        RunConfig(**TINY, token_multiple=0)


def test_a_compile_cache_that_cannot_be_a_folder_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"compile_cache: .*file/cache cannot be a folder here \(Not a directory"):
        policies.use_compile_cache(str(tmp_path / "file" / "cache"))
    policies.use_compile_cache(str(tmp_path / "new" / "cache"))
    assert (tmp_path / "new" / "cache").is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "new" / "cache").resolve())
