#!/usr/bin/env python
"""hpcbert on one CUDA GPU: against the Trainer on equal batches, MFU, and bert-large at length 512
per checkpointing policy (largest batch, planned and probed, and sequences/s). A measurement, not a
test; results/gpu/README.md is generated from the JSON files it writes (`render`).

    python benchmarks/gpu.py throughput --data-dir GLUE_DIR [--tokenizer DIR]   hpcbert vs Trainer, bert-base
    python benchmarks/gpu.py mfu [--batches 256 --norm-precision low,fp32]       hpcbert alone, synthetic
    python benchmarks/gpu.py mfu --task mlm --data-dir PREPARED                 hpcbert alone, pre-training
    python benchmarks/gpu.py profile [--compile off]                             where mfu's step spends its time
    python benchmarks/gpu.py large [--memory 24GiB]                              bert-large 512, every policy
    python benchmarks/gpu.py hostcost                                            host time per matmul call
    python benchmarks/gpu.py render                                              results/gpu/README.md

throughput: bert-base (--model; random weights, the published shape) at max length 128, bf16, MRPC, the same
batches on both sides (hpcbert's random order given to the Trainer as its sampler), each run its own
process, hpcbert and Trainer interleaved; the helpers and the Trainer worker are compare_hf.py's.
The Trainer runs in each of --hf-configs: plain dynamic padding, padding to a multiple of 8 (run_glue.py's
setting under fp16: fewer distinct shapes for cuBLAS and the allocator) and torch_compile, so that
hpcbert is compared with the Trainer at its best as well as at its plain setting.
Both sides time the same span (compare_hf.SPAN_NOTE) and synchronise the device at a step's end.
MFU counts the model FLOPs of the real tokens (hpcbert.model.batch_flops, and the head's: the
objectives' head_flops) against the GPU's data-sheet bf16 peak; on equal batches the Trainer does the same FLOPs per step, so its MFU is
hpcbert's divided by the ratio.

mfu: `hpcbert train` alone, bert-base at length 128, bf16, per batch, --compile and --norm-precision.
Two workloads: --task synthetic (mfu.json), pairs of lengths 8 to 128, about 65 real tokens a
sequence, what a GLUE fine-tuning batch holds; --task mlm (mfu-mlm.json), masked-LM pre-training on
`hpcbert prepare-pretraining`'s output, whole lines packed into sequences of up to 128 tokens, the
phase-1 workload MFU figures of BERT are usually quoted for.

profile: the mfu run's command (`hpcbert train`, bert-base, batch 256, --task as mfu's) with torch.profiler
around a few steps after the warm-up (Trainer.step wrapped in a child process): each operator's own
device time, grouped into matmuls, attention, optimizer and clipping, and the rest (element-wise,
LayerNorm, dropout, copies), beside the steps' wall time: what the device did not fill is host time.
The profiled run is not the timed one (the profiler adds host time).

hostcost: the host time of one matmul call (torch.mm and F.linear with bias, bf16, bert-base's
feed-forward shape, into a preallocated output) while the device is kept busy, so that no call
waits for it: the same row count every call against a new one every call (as an unpadded step's
token count is), the median of a few rounds. The profile put ~60 us of host time on each matmul.

large: one process; per policy a fresh copy of the model on the GPU under a memory cap
(torch.cuda.set_per_process_memory_fraction), the largest batch whose two whole training steps in a
row (forward, backward, AdamW step: the second beside the optimizer's state) fit, found by doubling
and bisection, beside `hpcbert plan`'s prediction for that cap; then sequences/s of whole steps at
the probed batch.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import itertools
import os
import re
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import compare_hf as C  # noqa: E402  (subprocess runs, the Trainer worker, machine info, JSON I/O)

RESULTS = C.ROOT / "results" / "gpu"
MODEL = "bert-base"
POLICIES = ("none", "selective", "alternate", "all", "offload")


def say(msg: str) -> None:
    print(f"[gpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def need_cuda():
    import torch
    if not torch.cuda.is_available() and not os.environ.get("HPCBERT_GPU_BENCH_ON_CPU"):  # smoke runs of the script
        sys.exit("benchmarks/gpu.py: needs a CUDA device (torch.cuda.is_available() is False)")
    return torch


def cmd_throughput(a) -> int:
    need_cuda()
    glue, work = C.glue_root(a.data_dir, a.task), Path(a.work_dir)
    batches = a.batches
    doc = C.header("gpu-throughput", a.threads)
    doc["settings"] = {"task": a.task, "model": a.model, "max_seq_length": C.SEQ_LEN, "precision": "bf16",
                       "batches": batches, "steps": a.steps, "warmup_steps_excluded": a.warmup_excluded,
                       "repeats": a.repeats, "seed": C.SEED, "hf_optim": a.hf_optim}
    doc["runs"] = []
    path = Path(a.results_dir) / "throughput.json"
    for rep in range(1, a.repeats + 1):
        for B in batches:
            name = f"gpu-{a.task}-b{B}-r{rep}"
            s = C.hpcbert_run(f"{name}-hp", work, a.threads, C.hpcbert_mrpc_args(
                glue, "bf16", C.SEED, max_steps=a.steps, sampler="random", warmup_excluded=a.warmup_excluded,
                log_every=1, task=a.task, model=a.model, batch=B, tokenizer=a.tokenizer) + ["--compile", a.hpcbert_compile])
            hp = C.hpcbert_record(s)
            hp.update(side="hpcbert", batch=B, repeat=rep, mfu=s.get("mfu"), peak_flops=s.get("peak_flops"),
                      token_multiple=s.get("token_multiple"), compile=s.get("compile"),
                      compile_steps=s.get("compile_steps"),
                      peak_flops_source=s.get("peak_flops_source"), model_flops_per_sec=s.get("model_flops_per_sec"),
                      attention=s.get("attention"))
            doc["runs"].append(hp)
            for conf in a.hf_configs:
                opts = {"padding": "dynamic", **HF_CONFIGS[conf][1]}
                hf = C.hf_run(f"{name}-hf-{conf}", work, a.threads, glue, work / "hf-json" / f"{name}-{conf}.json",
                              precision="bf16", seed=C.SEED, max_steps=a.steps,
                              warmup_excluded=a.warmup_excluded, optim=a.hf_optim, task=a.task, order="hpcbert-random",
                              model=a.model, batch=B, tokenizer=a.tokenizer, **opts)
                hf.update(side="hf", batch=B, repeat=rep, hf_config=conf)
                doc["runs"].append(hf)
                say(f"{name}: hpcbert {hp['steady_sequences_per_sec']:.0f} seq/s (MFU {hp['mfu'] or 0:.1%}), "
                    f"Trainer ({conf}) {hf['steady_sequences_per_sec']:.0f} seq/s")
                doc["summary"] = throughput_summary(doc)
                C.write_json(path, doc)
    print(render(Path(a.results_dir)))
    return 0


# The Trainer's configurations on equal batches (`throughput --hf-configs`): name -> (what, hf_run options).
HF_CONFIGS = {
    "plain": ("dynamic padding", {}),
    "pad8": ("dynamic padding to a multiple of 8", {"pad_to_multiple_of": 8}),
    "compile": ("dynamic padding, torch_compile", {"torch_compile": True}),
    # one shape, one compile: the Trainer's way to torch.compile without a graph per padded length
    "compile-max": ("padded to the maximum length, torch_compile", {"torch_compile": True, "padding": "max_length"}),
}


def hf_config_list(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in HF_CONFIGS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{','.join(bad) or repr(text)}: not a Trainer configuration; "
                                         f"comma-separated from {', '.join(HF_CONFIGS)}")
    return names


def throughput_summary(doc: dict) -> list[dict]:
    """Per batch and Trainer configuration: hpcbert against that Trainer, repeat by repeat. A run
    without `hf_config` (before --hf-configs) is the plain one."""
    out = []
    confs = list(dict.fromkeys(r.get("hf_config", "plain") for r in doc["runs"] if r["side"] == "hf"))
    for B, conf in itertools.product(doc["settings"]["batches"], confs):
        pairs = {}
        for r in doc["runs"]:
            if r["batch"] == B and (r["side"] == "hpcbert" or r.get("hf_config", "plain") == conf):
                pairs.setdefault(r["repeat"], {})[r["side"]] = r
        full = [p for p in pairs.values() if len(p) == 2]
        if not full:
            continue
        ratios = [p["hpcbert"]["steady_sequences_per_sec"] / p["hf"]["steady_sequences_per_sec"] for p in full]
        mfus = [p["hpcbert"]["mfu"] for p in full if p["hpcbert"].get("mfu")]
        out.append({"batch": B, "hf_config": conf, "repeats": len(full),
                    "hpcbert_seq_per_s": [p["hpcbert"]["steady_sequences_per_sec"] for p in full],
                    "hf_seq_per_s": [p["hf"]["steady_sequences_per_sec"] for p in full],
                    "ratio_per_repeat": ratios, "ratio_median": statistics.median(ratios),
                    # the typical step: the Trainer's new-length steps (several times its usual one on
                    # the H100) weigh in the seq/s ratio, not in this one
                    "median_step_ratio_per_repeat": [p["hf"]["steady_step_time_s"] / p["hpcbert"]["steady_step_time_s"]
                                                     for p in full],
                    "hpcbert_mfu_median": statistics.median(mfus) if mfus else None,
                    "hf_mfu_median": statistics.median(m / r for m, r in zip(mfus, ratios)) if mfus else None,
                    "hf_optim": full[0]["hf"].get("optim"), "hf_attention": full[0]["hf"].get("attn_implementation")})
    return out


def _new_length_line(doc: dict) -> str:
    """How many of the Trainer's slow steps (over twice its median) after the warm-up came at a padded
    length its run had not met before: counted from the runs' per-step shapes."""
    slow = new = 0
    for r in doc["runs"]:
        if r["side"] != "hf" or not r.get("step_times"):
            continue
        seen, med = set(), r["steady_step_time_s"]
        for i, (t, padded, n) in enumerate(zip(r["step_times"], r["step_padded_tokens"], r["step_sequences"])):
            first = padded // n not in seen
            seen.add(padded // n)
            if i >= r["warmup_steps_excluded"] and t > 2 * med:
                slow, new = slow + 1, new + first
    return (f"{slow} of its steps after the warm-up took over twice its median step, {new} of them at a padded "
            "length its run met for the first time.")


MFU_FILES = {"synthetic": "mfu.json", "mlm": "mfu-mlm.json"}  # mfu and profile --task: where their runs go
PROFILE_FILES = {"synthetic": "profile.json", "mlm": "profile-mlm.json"}


def task_args(a, batch: int, steps: int) -> list[str]:
    """`hpcbert train`'s task and data options for --task (synthetic: enough pairs for the steps)."""
    if a.task == "mlm":
        return ["--task", "mlm", "--data-dir", str(Path(a.data_dir).resolve())]
    return ["--task", "synthetic", "--synthetic-train-size", str(batch * (steps + 1))]


def pretraining_data(data_dir: str) -> dict:
    """What an `mfu --task mlm` run trained on, from the prepared folder's metadata.json."""
    path = Path(data_dir) / "metadata.json"
    if not path.is_file():
        sys.exit(f"gpu.py mfu --task mlm: {path}: not found; --data-dir takes the output of "
                 "`hpcbert prepare-pretraining` (benchmarks/gpu_session.sh prepares one with PRETRAIN=FILES)")
    meta = C.read_json(path)
    train = meta["splits"]["train"]
    return {"dir": Path(data_dir).name, "sources": [Path(src["path"]).name for src in meta["sources"]],
            "documents": train["documents"], "tokens": train["tokens"], "max_seq_length": meta["max_seq_length"],
            "tokenizer_sha256": meta["tokenizer"]["sha256"]}


def compile_args(value: str) -> list[str]:
    """hpcbert's options for one --compile value of mfu and profile: on, off or auto, or a
    torch.compile mode (max-autotune-no-cudagraphs), which compiles in that mode."""
    return ["--compile", value] if value in ("on", "off", "auto") else ["--compile", "on", "--compile-mode", value]


def cmd_mfu(a) -> int:
    need_cuda()
    work = Path(a.work_dir)
    doc = C.header("gpu-mfu", a.threads)
    doc["settings"] = {"task": a.task, "model": a.model, "max_seq_length": C.SEQ_LEN, "precision": "bf16",
                       "steps": a.steps, "warmup_steps_excluded": a.warmup_excluded, "compile": a.compile,
                       "norm_precision": a.norm_precision, "token_multiple": a.token_multiple}
    if a.task == "mlm":
        doc["settings"]["data"] = pretraining_data(a.data_dir)
    doc["runs"] = []
    path = Path(a.results_dir) / MFU_FILES[a.task]
    for B, comp, norms, mult in itertools.product(a.batches, a.compile.split(","), a.norm_precision.split(","),
                                                  a.token_multiple.split(",")):
            args = [*task_args(a, B, a.steps), "--model", a.model, "--max-seq-length", str(C.SEQ_LEN), "--batch-size",
                    str(B), "--precision", "bf16", "--max-steps", str(a.steps), "--warmup-steps-excluded", str(a.warmup_excluded), "--no-do-eval",
                    "--no-save-model", *compile_args(comp), "--norm-precision", norms, "--log-every", "1"]
            if mult != "auto":
                args += ["--token-multiple", mult]
            if a.tokenizer:
                args += ["--tokenizer", a.tokenizer]
            s = C.hpcbert_run(f"gpu-mfu-{a.task}-b{B}-compile-{comp}-norms-{norms}-tm-{mult}", work, a.threads, args)
            rec = {"batch": B, "compile": comp, "norm_precision": s.get("norm_precision"), "mfu": s.get("mfu"),
                   "token_multiple": s.get("token_multiple"),
                   "peak_flops": s.get("peak_flops"),
                   "peak_flops_source": s.get("peak_flops_source"),
                   "model_flops_per_sec": s.get("model_flops_per_sec"),
                   "steady_sequences_per_sec": s["steady_sequences_per_sec"], "tokens_per_sec": s["tokens_per_sec"],
                   "padded_tokens_per_sec": s["padded_tokens_per_sec"],
                   "steady_step_time_s": s["steady_step_time_s"], "wall_s": s["_wall_s"],
                   "attention": s.get("attention"), "compile_steps": s.get("compile_steps"),
                   "warmup_steps_excluded": s.get("warmup_steps_excluded"), "argv": s["_argv"]}
            doc["runs"].append(rec)
            say(f"mfu batch {B} compile {comp} norms {norms} token multiple {rec['token_multiple']}: "
                f"{rec['steady_sequences_per_sec']:.0f} seq/s, "
                f"MFU {rec['mfu'] or 0:.1%}")
            C.write_json(path, doc)
    print(render(Path(a.results_dir)))
    return 0


# The child of `profile`: `hpcbert train` with Trainer.step wrapped so that steps FIRST..FIRST+N-1
# run under torch.profiler; writes each operator's (CPU-side event's) own device and host time.
PROFILE_CHILD = r"""
import json, os, sys, time, torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from hpcbert import cli, train as T
first, n, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cuda = torch.cuda.is_available()
seen, held, step = [0], {}, T.Trainer.step
def sync():
    if cuda:
        torch.cuda.synchronize()
def profiled(self, *a, **k):
    i = seen[0]
    seen[0] += 1
    if i == first:
        sync()
        if cuda and os.environ.get("HPCBERT_SYNC_DEBUG"):  # a warning where a profiled step makes the host wait
            torch.cuda.set_sync_debug_mode("warn")
        held["prof"] = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
        held["prof"].__enter__()
        held["t0"] = time.perf_counter()
    r = step(self, *a, **k)
    if i == first + n - 1:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
        sync()
        wall = time.perf_counter() - held["t0"]
        held["prof"].__exit__(None, None, None)
        ops = [{"name": e.key, "calls": e.count, "self_device_us": getattr(e, "self_device_time_total", 0.0),
                "self_cpu_us": e.self_cpu_time_total} for e in held["prof"].key_averages()
               if e.device_type == DeviceType.CPU]
        with open(out, "w") as f:
            json.dump({"steps": n, "first_step": first + 1, "wall_s": wall, "ops": ops}, f)
    return r
T.Trainer.step = profiled
sys.exit(cli.main(sys.argv[4:]))
"""
PROFILE_GROUPS = (  # (group, substrings of operator names), first match wins
    ("attention", ("flash", "attention", "scaled_dot_product")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::linear",
                "aten::matmul", "gemm")),
    ("optimizer and clipping", ("adam", "_foreach", "lamb")),
)


def profile_groups(ops: list[dict], steps: int, key: str = "self_device_us") -> dict[str, float]:
    """Operators' own microseconds (`key`: device, or host for a CPU smoke run) summed per group
    (PROFILE_GROUPS, else 'other'), in milliseconds per step."""
    groups = {g: 0.0 for g, _ in PROFILE_GROUPS} | {"other": 0.0}
    for op in ops:
        name = op["name"].lower()
        g = next((g for g, keys in PROFILE_GROUPS if any(k in name for k in keys)), "other")
        groups[g] += op[key] / 1e3 / steps
    return groups


def cmd_profile(a) -> int:
    need_cuda()
    work = Path(a.work_dir)
    doc = C.header("gpu-profile", a.threads)
    doc["settings"] = {"task": a.task, "model": a.model, "max_seq_length": C.SEQ_LEN, "precision": "bf16",
                       "batch": a.batch, "profiled_steps": a.steps, "after_steps": a.after}
    if a.task == "mlm":
        doc["settings"]["data"] = pretraining_data(a.data_dir)
    doc["runs"] = []
    path = Path(a.results_dir) / PROFILE_FILES[a.task]
    for comp in a.compile.split(","):
        total = a.after + a.steps + 2
        args = ["train", *task_args(a, a.batch, total), "--model", a.model, "--max-seq-length", str(C.SEQ_LEN),
                "--batch-size", str(a.batch), "--precision", "bf16", "--max-steps", str(total),
                "--no-do-eval", "--no-save-model",
                *compile_args(comp), "--log-every", "1", "--threads", str(a.threads)]
        if a.tokenizer:
            args += ["--tokenizer", a.tokenizer]
        out = C.fresh_dir(work / "profile" / f"{a.task}-compile-{comp}")
        raw = work / "profile" / f"ops-{a.task}-compile-{comp}.json"
        args += ["--out", str(out)]
        C.run_logged([sys.executable, "-c", PROFILE_CHILD, str(a.after), str(a.steps), str(raw), *args],
                     work / "logs" / f"profile-{a.task}-compile-{comp}.log", a.threads)
        prof = C.read_json(raw)
        key = "self_device_us" if any(o["self_device_us"] for o in prof["ops"]) else "self_cpu_us"  # CPU smoke runs
        ops = sorted(prof["ops"], key=lambda o: -o[key])
        step_ms = 1e3 * prof["wall_s"] / prof["steps"]
        groups = profile_groups(ops, prof["steps"], key)
        rec = {"compile": comp, "step_ms": step_ms, "time_of": key, "device_busy_ms": sum(groups.values()),
               "groups_ms": groups, "top_ops": [{**o, "device_ms_per_step": o[key] / 1e3 / prof["steps"]} for o in ops[:15]],
               "argv": ["hpcbert", *args[:-2]]}
        doc["runs"].append(rec)
        say(f"profile compile {comp}: step {step_ms:.1f} ms, device busy {rec['device_busy_ms']:.1f} ms: "
            + ", ".join(f"{g} {v:.1f}" for g, v in groups.items()))
        C.write_json(path, doc)
    print(render(Path(a.results_dir)))
    return 0


def cmd_hostcost(a) -> int:
    torch = need_cuda()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    doc = C.header("gpu-hostcost", a.threads)
    H, inner, n, calls = 768, 3072, a.tokens, a.calls
    doc["settings"] = {"in_features": H, "out_features": inner, "tokens": n, "calls": calls, "rounds": a.rounds,
                       "dtype": "bf16"}
    rows_max = n + 2 * calls * a.rounds + 1  # every "new" call takes a row count no call took before
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows_max, H, device=dev, dtype=torch.bfloat16, generator=g)
    w = torch.randn(inner, H, device=dev, dtype=torch.bfloat16, generator=g)
    bias = torch.randn(inner, device=dev, dtype=torch.bfloat16, generator=g)
    out = torch.empty(rows_max, inner, device=dev, dtype=torch.bfloat16)
    ops = {"mm": lambda m: torch.mm(x[:m], w.t(), out=out[:m]),
           "addmm (linear with bias)": lambda m: torch.addmm(bias, x[:m], w.t(), out=out[:m])}
    fresh = itertools.count(n + 1)
    rows = []
    for name, op in ops.items():
        for shapes in ("same", "new"):
            per_call = []
            for _ in range(a.rounds):
                ms = [n] * calls if shapes == "same" else [next(fresh) for _ in range(calls)]
                op(n)  # the same shape met before the timed calls
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda._sleep(int(2e9))  # ~1 s of device work queued ahead: no call waits for the device
                t0 = time.perf_counter()
                for m in ms:
                    op(m)
                per_call.append((time.perf_counter() - t0) / calls)
                if cuda:
                    torch.cuda.synchronize()
            rows.append({"op": name, "shapes": shapes, "host_us_per_call": 1e6 * statistics.median(per_call),
                         "rounds_us": [1e6 * t for t in per_call]})
            say(f"hostcost {name}, {shapes} rows: {rows[-1]['host_us_per_call']:.1f} us per call")
    doc["runs"] = rows
    C.write_json(Path(a.results_dir) / "hostcost.json", doc)
    print(render(Path(a.results_dir)))
    return 0


# memory a policy's probe and timing may leave allocated after its model is freed before the log and the
# page say so (64 MiB; a graph kept after running out of memory holds a large share of the cap)
HELD_NOTABLE = 2**26


def cmd_large(a) -> int:
    torch = need_cuda()
    from hpcbert import cuda_allocator_settings, objectives, plan, policies
    from hpcbert.batching import largest_that_fits
    from hpcbert.config import RunConfig
    from hpcbert.optim import make_optimizer

    # with its index: set_per_process_memory_fraction refuses a bare "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cap = a.memory
    cuda = dev.type == "cuda"
    total = torch.cuda.get_device_properties(dev).total_memory if cuda else cap

    def set_cap(fraction: float) -> None:
        if cuda:
            torch.cuda.set_per_process_memory_fraction(fraction, dev)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    cfg = RunConfig(task="synthetic", model=a.model, max_seq_length=a.length, precision="bf16")
    obj = objectives.get(cfg)
    torch.manual_seed(0)
    base = obj.build_model(plan._model_config(cfg)).train()  # on the host; a copy per policy goes to the GPU

    def run_steps(model, b: int, n: int) -> list[float]:
        """n whole training steps of `model` at batch b with one optimizer; each one's seconds."""
        opt = make_optimizer(cfg, model, 1e-5, dev)
        batch, norm = obj.example_batch(b, a.length, model.config.vocab_size)
        batch, times = batch.to(dev), []
        try:
            for _ in range(n):
                sync()
                t = time.perf_counter()
                with policies.autocast("bf16", dev):
                    loss = obj.loss(model, obj.forward(model, batch), batch, norm)
                loss.backward()
                del loss
                opt.step()
                opt.zero_grad(set_to_none=True)
                sync()
                times.append(time.perf_counter() - t)
        finally:
            model.zero_grad(set_to_none=True)
            del opt, batch
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
                if hasattr(torch._C, "_host_emptyCache"):  # offload's pinned blocks, cached per size
                    torch._C._host_emptyCache()
        return times

    def fits(model, b: int) -> bool:
        # two steps: the second forward and backward run beside AdamW's moments, as every step of
        # training after the first does (one step alone allocates them only after backward has
        # freed the activations: on the first H100 run that fitted 1.3-1.5x more than two in a row)
        try:
            run_steps(model, b, 2)
            return True
        except torch.OutOfMemoryError:
            return False

    if cuda:
        # a whole step first, as tests/test_gpu.py's leak test takes one: what CUDA's libraries keep for
        # the process once a step has run (their workspaces) is not the first policy's to leave behind
        # (at 0071d95 none, probed first, "left" 65 MiB on an H100, each policy after it 0-1 MiB)
        warm = copy.deepcopy(base).to(dev)
        run_steps(warm, 1, 1)
        del warm
        gc.collect()
        torch.cuda.empty_cache()
    doc = C.header("gpu-large", a.threads)
    doc["settings"] = {"model": a.model, "max_seq_length": a.length, "precision": "bf16", "memory_cap_bytes": cap,
                       "gpu_total_bytes": total, "timed_steps": a.steps, "probe_steps": 2,
                       "host_memory_bytes": a.host_memory,
                       "allocator": (cuda_allocator_settings() or "PyTorch's default") if cuda else None}
    doc["policies"] = []
    path = Path(a.results_dir) / f"{a.name}.json"
    for policy in a.policies:
        set_cap(1.0)
        made = plan.make_plan(cfg, cap, dev, (policy,), host_bytes=a.host_memory)
        predicted = made.policies[0]
        # the plan's workspace against the count alone (up to 0071d95 on CUDA it took at least
        # plan.workspace_rule's; since, the count): the largest batch the count alone would plan, beside
        # the probe, says whether the GPU follows it; the plan's own wherever the count ran
        counted = predicted.workspace_counted
        count_error = None if counted is not None else predicted.note
        by_count = predicted.largest_batch if counted is not None else None
        gc.collect()
        held_before = torch.cuda.memory_allocated(dev) if cuda else 0
        model = copy.deepcopy(base).to(dev)
        policies.apply_grad_ckpt(model, policy)
        set_cap(cap / total)

        # up to twice the prediction; offload's pinned host memory only a little past it (the plan already
        # allows it half the host's memory, and a probe past the host's would end the process)
        limit = int(1.2 * predicted.largest_batch) + 1 if policy == "offload" else 2 * predicted.largest_batch + 8
        t0 = time.perf_counter()
        probed = largest_that_fits(functools.partial(fits, model), limit)
        probe_s = time.perf_counter() - t0
        times, timed_batch = [], probed
        while timed_batch and not times:  # at the probed batch, else 10% smaller (fragmentation after the probe)
            if cuda:  # the peaks of these steps alone: what the batch timed takes, allocated and held
                torch.cuda.reset_peak_memory_stats(dev)
            try:
                times = run_steps(model, timed_batch, 1 + a.steps)[1:]  # the first step is not timed
            except torch.OutOfMemoryError:
                say(f"{policy}: out of memory timing batch {timed_batch}; timing a smaller one")
                timed_batch = int(0.9 * timed_batch)
        rec = {"policy": policy, "predicted_largest_batch": predicted.largest_batch,
               "predicted_activation_bytes_per_sequence": predicted.activation_bytes_per_sequence,
               "predicted_workspace_bytes_per_sequence": predicted.workspace_bytes_per_sequence,
               "counted_workspace_bytes_per_sequence": counted, "count_error": count_error,
               "largest_batch_by_count": by_count, "plan_state_bytes": made.state_total,
               "plan_held_bytes": made.held_bytes, "gradients_held": made.gradients_held,
               "predicted_peak_bytes": made.memory(policy, predicted.largest_batch) if predicted.largest_batch else None,
               # the plan's peak at the batch timed, beside what those steps allocated at their peak
               "predicted_peak_at_timed_bytes": made.memory(policy, timed_batch) if timed_batch and times else None,
               "predicted_note": predicted.note, "probed_largest_batch": probed, "probe_limit": limit,
               "probe_s": probe_s, "step_times_s": times,
               "timed_batch": timed_batch,
               "sequences_per_sec": timed_batch / statistics.median(times) if times else None,
               "peak_allocated_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None,
               "peak_reserved_bytes": torch.cuda.max_memory_reserved(dev) if cuda else None}
        doc["policies"].append(rec)
        say(f"{a.model} {a.length} {policy}: predicted {predicted.largest_batch} (by the count alone {by_count}), "
            f"probed {probed} "
            f"({probe_s:.0f} s), {rec['sequences_per_sec'] or 0:.1f} seq/s at batch {timed_batch}")
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
            # what this policy's probe and timing left allocated once its model is gone: nothing, unless a
            # step that ran out of memory kept its graph (at 9a2a6c4 selective's and alternate's did, and
            # every batch tried after it failed); the policies probed after it would be lower bounds
            rec["held_after_bytes"] = torch.cuda.memory_allocated(dev) - held_before
            if rec["held_after_bytes"] > HELD_NOTABLE:
                say(f"{policy}: {rec['held_after_bytes'] / 2**20:.0f} MiB still allocated after its model was freed; "
                    "the probes after it in this process are lower bounds")
        C.write_json(path, doc)
    set_cap(1.0)
    print(render(Path(a.results_dir)))
    return 0


def _where(doc: dict) -> str:
    m = doc["machine"]
    return (f"`{doc['command']}`, {doc['date']}, GPU {m.get('cuda')}, torch {m['torch']}, transformers "
            f"{m.get('transformers')}, hpcbert {m['hpcbert_source'].get('note')}"
            + (f" {str(m.get('git_commit'))[:12]}" if m.get("git_commit") else ""))


def _run_commit(doc: dict, run: dict) -> str:
    """The commit a run measured: its own "source"'s (a run of another command, another call) or the doc's."""
    return str((run.get("source") or doc)["machine"].get("git_commit") or "—")[:7]


def _where_lines(doc: dict) -> list[str]:
    """One "- command, date, machine" line per command behind the doc's runs, in order of first use."""
    found = {}
    for r in doc["runs"]:
        d = r.get("source") or doc
        found.setdefault((d["command"], d["date"]), d)
    return [f"- {_where(d)}" for d in (found.values() or [doc])]


def _late_compiles(run: dict, warmup: int) -> list[dict]:
    """A run's compile steps (hpcbert's summary `compile_steps`) after its `warmup` left-out steps:
    their compile time is in its measured figures. None recorded (runs before 0e32550): []."""
    return [c for c in run.get("compile_steps") or [] if c["step"] > warmup]


def _compile_at(c: dict) -> str:
    """'step N (S s on the host)' for a compile step. Runs before its `host_s` was recorded read
    their CUDA results a step late and timed the compile in the step before it: no seconds."""
    return f"step {c['step']}" + (f" ({c['host_s']:.0f} s on the host)" if "host_s" in c else
                                  " (its seconds counted in the step before: not recorded apart)")


def _compiles_note(late: list[str], held: bool) -> str:
    """The note on compiles after the left-out first steps: runs that record `host_s` (86039ca on)
    leave those steps out of their steady figures; older runs' figures hold them."""
    if not late:
        return ""
    return (" Compiled again inside the measured steps, that time in the row: " if held else
            " Compiled again after the left-out first steps (those steps left out of the row too): ") \
        + "; ".join(late) + "."


def _names(names: list[str]) -> str:
    """'a, b, c' for a few; 'a ... z (N files)' for more."""
    return ", ".join(names) if len(names) <= 4 else f"{names[0]} ... {names[-1]} ({len(names)} files)"


def _workload(settings: dict) -> str:
    return "masked-LM pre-training" if settings.get("task") == "mlm" else "synthetic task"


def _large_section(doc: dict, path: Path) -> list[str]:
    """The README's section for one `gpu.py large` results file."""
    from hpcbert.report import markdown_grid
    out: list[str] = []
    s = doc["settings"]
    rows = [[r["policy"], str(r["predicted_largest_batch"]) + (f" ({r['predicted_note']})" if r.get("predicted_note") else ""),
             str(r["probed_largest_batch"]) + (" (probe limit)" if r["probed_largest_batch"] == r.get("probe_limit") else ""),
             (f"{r['probed_largest_batch'] / r['predicted_largest_batch']:.2f}" if r["predicted_largest_batch"] else "—"),
             f"{r['sequences_per_sec']:.1f} ({r.get('timed_batch', r['probed_largest_batch'])})"
             if r["sequences_per_sec"] else "—",
             f"{r['predicted_activation_bytes_per_sequence'] / 2**20:.0f}"
             if r["predicted_activation_bytes_per_sequence"] else "—"] for r in doc["policies"]]
    alloc = f", CUDA allocator {s['allocator']}" if s.get("allocator") else ""
    out += [f"## {s['model']} at length {s['max_seq_length']}, {s['precision']}, under a "
            f"{s['memory_cap_bytes'] / 2**30:.0f} GiB cap{alloc}: largest batch and sequences/s per policy", "",
            markdown_grid(["policy", "planned largest batch", "probed largest batch", "probed / planned",
                           "seq/s (batch timed)", "planned activation MiB/seq"], rows).rstrip("\n"), "",
            "Probed: the largest batch for which "
            + ("one training step (forward, backward, AdamW step) fits, with the optimizer's state allocated "
               "only at its end (the first probe's method: the timing below then ran out of memory at the "
               "probed batch, as training's second step does, and the batch timed is what repeated steps fit "
               "within 10%)" if s.get("probe_steps", 1) == 1 else
               "two training steps in a row (forward, backward, AdamW step; the second beside the optimizer's "
               "state) fit")
            + " under `torch.cuda.set_per_process_memory_fraction`, by doubling and bisection; planned: `hpcbert plan` "
            f"for the same cap. seq/s: median of {s['timed_steps']} whole steps at the probed batch (10% smaller where it ran out of memory after "
            "the probe), full-length "
            "sequences."]
    counted = [r for r in doc["policies"] if "largest_batch_by_count" in r]
    if counted:
        mib = 2**20

        def per_seq(r: dict, key: str) -> str:  # what the batch timed took beyond the plan's state, per sequence
            return (f"{(r[key] - r['plan_state_bytes']) / r['timed_batch'] / mib:.1f}"
                    if r.get(key) and r.get("timed_batch") else "—")

        rows = [[r["policy"],
                 f"{r['predicted_activation_bytes_per_sequence'] / mib:.1f}"
                 if r["predicted_activation_bytes_per_sequence"] is not None else "—",
                 f"{r['predicted_workspace_bytes_per_sequence'] / mib:.1f}"
                 if r["predicted_workspace_bytes_per_sequence"] is not None else "—",
                 f"{r['counted_workspace_bytes_per_sequence'] / mib:.1f}"
                 if r["counted_workspace_bytes_per_sequence"] is not None else f"— ({r.get('count_error')})",
                 str(r["predicted_largest_batch"]),
                 "—" if r["largest_batch_by_count"] is None else str(r["largest_batch_by_count"]),
                 str(r["probed_largest_batch"]), per_seq(r, "peak_allocated_bytes"), per_seq(r, "peak_reserved_bytes"),
                 (f"{r['peak_allocated_bytes'] / r['predicted_peak_at_timed_bytes']:.3f}"
                  if r.get("predicted_peak_at_timed_bytes") and r.get("peak_allocated_bytes") else "—")]
                for r in counted]
        out += ["", "The plan's workspace against the GPU's: planned, the plan's per-sequence workspace (on CUDA, "
                "up to commit 0071d95 its count but at least `plan.workspace_rule`'s; since, the count alone); "
                "counted, the count alone (FakeTensorMode), and "
                "the largest batch it alone would plan; peak allocated and reserved, of the steps timed, less the "
                "plan's state, over the batch timed (MiB per sequence; compare activation + workspace); "
                "allocated / planned: the steps' peak allocated against the plan's memory at the batch timed "
                "(`Plan.memory`, since the plan counts the step's peak with the gradients it holds there: "
                "recorded from the commit after 7bdcf59 on).", "",
                markdown_grid(["policy", "activation MiB/seq", "planned workspace", "counted workspace",
                               "planned batch", "batch by count", "probed batch", "peak allocated MiB/seq",
                               "peak reserved MiB/seq", "allocated / planned at batch timed"], rows).rstrip("\n")]
    hosts = {r["policy"]: (r.get("source") or s).get("host_memory_bytes") for r in doc["policies"]}
    if hosts.get("offload"):
        out += ["", f"offload: planned for {hosts['offload'] / 2**30:.0f} GiB of host memory (`--host-memory`; "
                "half of it for the activations it pins there), its probe stopping a fifth past the plan: it "
                "keeps little on the device, so its bound is the host's memory."]
    untimed = [r["policy"] for r in doc["policies"] if r["probed_largest_batch"] and not r.get("step_times_s")]
    held = [f"{r['policy']} {r['held_after_bytes'] / 2**20:.0f} MiB" for r in doc["policies"]
            if (r.get("held_after_bytes") or 0) > HELD_NOTABLE]
    if untimed or held:
        out += ["", "Not a clean measurement:"
                + (f" timed at no batch ({', '.join(untimed)}): after the probe every batch down to 1 ran out of "
                   "memory, as where memory stays allocated after a step that ran out of it;" if untimed else "")
                + (f" still allocated after the policy's model was freed: {', '.join(held)};" if held else "")
                + " that policy's own probe, from its first batch that ran out of memory, and the probes after it "
                "in the same process are lower bounds (0: not even one sequence fitted)."]
    missing = [p for p in POLICIES if p not in {r["policy"] for r in doc["policies"]}]
    if missing:
        out += ["", f"No record in `{path.name}` for: {', '.join(missing)}."]
    own = [r for r in doc["policies"] if r.get("source")]  # a policy measured by a command of its own
    out += ["", f"- {_where(doc)}" + (f" ({', '.join(r['policy'] for r in doc['policies'] if not r.get('source'))})"
                                      if own else "")]
    out += [f"- {_where(r['source'])} ({r['policy']})" for r in own] + [""]
    return out


def render(results: Path = RESULTS) -> str:
    from hpcbert.report import markdown_grid
    out = ["# hpcbert on a GPU", "", "Generated by `python benchmarks/gpu.py render` from the JSON files here; every "
           "figure comes from the command listed under its table.", ""]
    # throughput.json, and throughput-NAME.json: the runs of another call or another GPU
    for tp in sorted(results.glob("throughput*.json"), key=lambda f: (f.name != "throughput.json", f.name)):
        doc = C.read_json(tp)
        s = doc["settings"]
        summary = throughput_summary(doc)
        rows = [[str(r["batch"]), HF_CONFIGS[r["hf_config"]][0],
                 C._fmt_list(r["hpcbert_seq_per_s"], "{:.0f}"), C._fmt_list(r["hf_seq_per_s"], "{:.0f}"),
                 C._fmt_list(r["ratio_per_repeat"]), f"**{r['ratio_median']:.2f}x**",
                 C._fmt_list(r["median_step_ratio_per_repeat"]) if r.get("median_step_ratio_per_repeat") else "—",
                 f"{r['hpcbert_mfu_median']:.1%}" if r["hpcbert_mfu_median"] else "—",
                 f"{r['hf_mfu_median']:.1%}" if r["hf_mfu_median"] else "—"] for r in summary]
        best = []
        for B in s["batches"]:  # the Trainer at its best: its fastest configuration at this batch
            mine = [r for r in summary if r["batch"] == B]
            if len(mine) > 1:
                top = C.fastest_trainer(mine, "hf_seq_per_s")
                best.append(f"batch {B}: **{top['ratio_median']:.2f}x** against its fastest, "
                            f"{HF_CONFIGS[top['hf_config']][0]}")
        best_line = [f"hpcbert against the Trainer at its best on equal batches: {'; '.join(best)}.", ""] if best else []
        out += [f"## Against the Trainer on equal batches: {s['model']}, {s['task'].upper()}, length "
                f"{s['max_seq_length']}, {s['precision']}, {doc['machine'].get('cuda')}", "",
                *best_line,
                markdown_grid(["batch", "Trainer", "hpcbert seq/s", "Trainer seq/s", "ratio per repeat", "ratio (median)",
                               "median step, Trainer / hpcbert", "hpcbert MFU", "Trainer MFU"], rows).rstrip("\n"), "",
                f"The same batches on both sides (hpcbert's random order as the Trainer's sampler), {s['steps']} steps, "
                f"the first {s['warmup_steps_excluded']} left out; Trainer optim "
                f"`{(doc.get('summary') or [{}])[0].get('hf_optim')}`, attention "
                f"`{(doc.get('summary') or [{}])[0].get('hf_attention')}`. MFU: model FLOPs of the real tokens over "
                f"the data-sheet bf16 peak; the Trainer's is hpcbert's over the ratio (equal batches, equal FLOPs). "
                "seq/s counts every step after the warm-up, as `compare_hf.py` does; the median step leaves out "
                f"the Trainer's slow steps: {_new_length_line(doc)} A whole fine-tuning run pays those too, but "
                "less per step as lengths repeat."
                + "".join(f" hpcbert's rows rounded up to a multiple of {m} (`--token-multiple`)." for m in sorted(
                    {r.get("token_multiple") or 1 for r in doc["runs"] if r["side"] == "hpcbert"}) if m > 1)
                + (" hpcbert compiled (`--compile on`; its first compile in the steps left out)." if any(
                    r.get("compile") for r in doc["runs"] if r["side"] == "hpcbert") else "")
                # compare_hf counts hpcbert's compile steps after the warm-up, as the Trainer's
                + "".join(_compiles_note([f"hpcbert at batch {r['batch']}, {_compile_at(c)}"], True)
                          for r in doc["runs"] if r["side"] == "hpcbert"
                          for c in _late_compiles(r, s["warmup_steps_excluded"])),
                "", f"- {_where(doc)}", ""]
    for task, name in MFU_FILES.items():
        if not (results / name).is_file():
            continue
        doc = C.read_json(results / name)
        # a run from before --norm-precision ran its LayerNorms in fp32
        # a run from before --token-multiple had no filler rows (1)
        rows = [[_run_commit(doc, r), str(r["batch"]), r["compile"],
                 r.get("norm_precision") or "fp32", str(r.get("token_multiple") or 1),
                 f"{r['steady_sequences_per_sec']:.0f}", f"{r['tokens_per_sec']:.0f}",
                 f"{r['tokens_per_sec'] / r['steady_sequences_per_sec']:.1f}",
                 f"{r['model_flops_per_sec'] / 1e12:.0f}" if r["model_flops_per_sec"] else "—",
                 f"**{r['mfu']:.1%}**" if r["mfu"] else "—"] for r in doc["runs"]]
        s = doc["settings"]
        if task == "mlm":
            d = s["data"]
            what = (f"{_workload(s)}, length {s['max_seq_length']}",
                    f"Masked-LM pre-training (`--task mlm`) on `hpcbert prepare-pretraining`'s output of "
                    f"{_names(d['sources'])} ({d['documents']:,} documents, {d['tokens']:,} tokens), whole lines "
                    f"packed into sequences of up to {s['max_seq_length']} tokens, 15% of them masked. The model FLOPs "
                    "are the encoder's on the real tokens, the last layer's output projection and feed-forward at the masked rows only "
                    "(what it computes), and the masked-LM head's transform and vocabulary projection at the masked rows")
        else:
            what = (f"{_workload(s)}, length {s['max_seq_length']}",
                    f"Synthetic pairs of lengths 8 to {s['max_seq_length']} (hpcbert's `--task synthetic`, a "
                    "fine-tuning batch); the model FLOPs are the encoder's on the real tokens, the last layer's "
                    "output projection and feed-forward at [CLS] only (and, in runs of commits after 6d701e8, the pooler "
                    "and the classifier at [CLS]: 0.01% of them)")
        # a compile inside the measured steps (runs from 9e146b1 on record them): its time is in the row
        # of runs before 86039ca (no host_s), left out of it from then on
        late = [(f"{_run_commit(doc, r)} batch {r['batch']} --compile {r['compile']}: "
                 + ", ".join(_compile_at(c) for c in inside), any("host_s" not in c for c in inside))
                for r in doc["runs"] if (inside := _late_compiles(r, r.get("warmup_steps_excluded") or 0))]
        out += [f"## MFU: {s['model']}, {what[0]}, {s['precision']}", "",
                markdown_grid(["commit", "batch", "--compile", "--norm-precision", "--token-multiple", "seq/s", "real tokens/s",
                               "real tokens/seq", "model TFLOP/s", "MFU"], rows).rstrip("\n"),
                "", f"{what[1]}. {s['steps']} steps, the first {s['warmup_steps_excluded']} left out; peak: "
                f"{'; '.join(dict.fromkeys(r['peak_flops_source'] for r in doc['runs'])) or '—'}."
                + _compiles_note([t for t, held in late if held], True)
                + _compiles_note([t for t, held in late if not held], False),
                "",
                *_where_lines(doc), ""]
    for name in PROFILE_FILES.values():
        if not (results / name).is_file():
            continue
        doc = C.read_json(results / name)
        s = doc["settings"]
        groups = list(doc["runs"][0]["groups_ms"]) if doc["runs"] else []
        rows = [[_run_commit(doc, r), r["compile"], f"{r['step_ms']:.1f}",
                 f"{r['device_busy_ms']:.1f} ({r['device_busy_ms'] / r['step_ms']:.0%})",
                 *(f"{r['groups_ms'][g]:.1f} ({r['groups_ms'][g] / r['step_ms']:.0%})" for g in groups),
                 ", ".join(f"`{o['name'][:40]}` {o['device_ms_per_step']:.1f}" for o in r["top_ops"][:4])]
                for r in doc["runs"]]
        out += [f"## Where a step goes: {s['model']}, {_workload(s)}, length {s['max_seq_length']}, batch {s['batch']}, "
                f"{s['precision']}", "",
                markdown_grid(["commit", "--compile", "step ms", "device busy ms (share)", *(f"{g} ms" for g in groups),
                               "top operators, device ms per step"], rows).rstrip("\n"), "",
                f"torch.profiler over {s['profiled_steps']} steps after the first {s['after_steps']} of the mfu "
                "run's command (a run of its own: the profiler adds host time); each operator's own device time, "
                "grouped by name (`gpu.PROFILE_GROUPS`). Device busy is their sum; the rest of the step is "
                "time the device waited for the host.", "",
                *_where_lines(doc), ""]
    att = results / "attention.json"
    if att.is_file():  # benchmarks/gpu_attention.py
        doc = C.read_json(att)
        out += [f"## Attention kernels: batch {doc['batch']}, {doc['heads']} heads of {doc['head_dim']}, lengths "
                f"{doc['lengths'][0]}-{doc['lengths'][1]}, {doc['dtype']}, {doc['device']}", ""]
        for t in doc["tables"]:
            rows = [[r["variant"], f"{r['median_ms']:.3f}", f"**{r['ratio_to_training_path']:.2f}x**",
                     f"{r['max_abs_diff_without_dropout']:.1e}"] for r in t["rows"]]
            rows += [[name, "refused", "—", err] for name, err in t["refused"].items()]
            out += [f"Attention dropout {t['dropout']}:", "",
                    markdown_grid(["kernel", "forward + backward ms (median)", "against the training path",
                                   "max abs difference without dropout"], rows).rstrip("\n"), ""]
        out += [f"{doc['real_tokens']} real tokens of {doc['padded_tokens']} padded; the training path is "
                "`model.attention` (flash varlen over the unpadded rows), the padded kernels run "
                "`model.padded_attention` (padding and unpadding included) under `sdpa_kernel`; in one process, the "
                "variants in rotating order each round.", "",
                f"- `{doc['command']}`, {doc['date']}, torch {doc['torch']}"
                + (f", hpcbert commit {doc['commit']}" if doc.get("commit") else ""), ""]
    hc = results / "hostcost.json"
    if hc.is_file():
        doc = C.read_json(hc)
        s = doc["settings"]
        rows = [[r["op"], r["shapes"], f"{r['host_us_per_call']:.1f}", C._fmt_list(r["rounds_us"], "{:.1f}")]
                for r in doc["runs"]]
        out += [f"## Host time per matmul call: ({s['tokens']}, {s['in_features']}) x ({s['in_features']}, "
                f"{s['out_features']}), {s['dtype']}", "",
                markdown_grid(["operator", "row count", "host us per call (median)", "per round"], rows).rstrip("\n"),
                "", f"{s['calls']} calls a round, {s['rounds']} rounds, into a preallocated output, the device kept "
                "busy ahead of them by about 1 s of queued work (a call that waits for the device adds that second "
                "to its round: ~10 ms a call over 100 calls); same: every call the row count met before, new: "
                "every call a row count no call had before (an unpadded step's token count is new each step).",
                "", f"- {_where(doc)}", ""]
    # large.json, and large-NAME.json: another model, cap or allocator (gpu.py large --name)
    for path in sorted(results.glob("large*.json"), key=lambda f: (f.name != "large.json", f.name)):
        out += _large_section(C.read_json(path), path)
    # in the order they ran: pytest-N-..., by N (pytest-10 after pytest-9)
    logs = sorted(results.glob("pytest-*.log"), key=lambda f: (int(m.group(1)) if (m := re.match(r"pytest-(\d+)", f.name))
                                                              else 0, f.name))
    if logs:
        out += ["## GPU tests", "", "`pytest -m gpu` on the GPU; `pytest-N-WHAT-COMMIT.log` is the N-th run, of commit COMMIT.", ""]
        for log in logs:
            lines = [ln.strip("= \n") for ln in log.read_text().splitlines() if ln.strip()]
            counts = next((ln for ln in reversed(lines) if re.search(r"\d+ (passed|failed)", ln)),
                          f"no summary line; it ends: {lines[-1] if lines else '(empty)'}")
            failed = list(dict.fromkeys([ln.split()[1] for ln in lines if ln.startswith("FAILED ")]  # the summary's
                                        + [m.group(1) for ln in lines if (m := re.match(r"(\S+::\S+) FAILED", ln))]))  # -v's
            out += [f"- `{log.name}`: {counts}" + (f"; failed: {', '.join(f'`{f}`' for f in failed)}" if failed else "")]
        out += [""]
    if len(out) == 4:
        out += ["Not measured yet.", ""]
    return "\n".join(out)


render_readme = render  # the name tests/test_report.py's freshness check calls


def cmd_render(a) -> int:
    text = render(Path(a.results_dir))
    (Path(a.results_dir) / "README.md").write_text(text)
    print(text)
    return 0


def batch_list(text: str) -> list[int]:
    """'32,128' -> [32, 128] (argparse type: a bad list is a one-line usage error)."""
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}; accepted: comma-separated positive integers (32,128)")
    return sizes


def policy_list(text: str) -> list[str]:
    names = [p for p in text.split(",") if p]
    unknown = [p for p in names if p not in POLICIES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown or text!r}; accepted: comma-separated {', '.join(POLICIES)}")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def workload(sp):
        sp.add_argument("--task", default="synthetic", choices=tuple(MFU_FILES),
                        help="synthetic: pairs of lengths 8 to 128 (a fine-tuning batch); mlm: masked-LM pre-training "
                        "on --data-dir (hpcbert prepare-pretraining's output), sequences packed to 128")
        sp.add_argument("--data-dir", default=None, help="with --task mlm: prepared pre-training data")

    def common(sp):
        sp.add_argument("--results-dir", default=str(RESULTS))
        sp.add_argument("--work-dir", default=str(C.ROOT / "runs" / "gpu"))
        sp.add_argument("--threads", type=int, default=4)
        sp.add_argument("--tokenizer", default=None, help="tokenizer directory (default: minilm-l6's)")

    t = sub.add_parser("throughput")
    common(t)
    t.add_argument("--data-dir", default="../shared/data/glue")
    t.add_argument("--task", default="mrpc", choices=tuple(C.TASK_FOLDERS))
    t.add_argument("--model", default=MODEL, help="both sides' model, random weights (default: %(default)s)")
    t.add_argument("--batches", type=batch_list, default="32,128")
    t.add_argument("--steps", type=int, default=60)
    t.add_argument("--warmup-excluded", type=int, default=10)
    t.add_argument("--repeats", type=int, default=2)
    t.add_argument("--hf-optim", default=None, help="TrainingArguments.optim (default: the Trainer's)")
    t.add_argument("--hpcbert-compile", choices=("off", "on"), default="off", help="hpcbert's --compile")
    t.add_argument("--hf-configs", type=hf_config_list, default="plain,pad8,compile",
                   help="the Trainer's configurations, each on hpcbert's batches: " +
                        "; ".join(f"{k}: {v[0]}" for k, v in HF_CONFIGS.items()) + " (default: %(default)s)")
    m = sub.add_parser("mfu")
    common(m)
    m.add_argument("--model", default=MODEL)
    m.add_argument("--batches", type=batch_list, default="256")
    m.add_argument("--steps", type=int, default=40)
    m.add_argument("--warmup-excluded", type=int, default=10)
    m.add_argument("--compile", default="off", help="comma-separated --compile values to run; a torch.compile mode "
                   "(max-autotune-no-cudagraphs) compiles in that mode")
    m.add_argument("--norm-precision", default="low,fp32", help="comma-separated --norm-precision values to run")
    m.add_argument("--token-multiple", default="auto", help="comma-separated --token-multiple values to run "
                   "(auto: hpcbert's default, not passed)")
    workload(m)
    f = sub.add_parser("profile")
    common(f)
    f.add_argument("--model", default=MODEL)
    f.add_argument("--batch", type=int, default=256)
    f.add_argument("--after", type=int, default=10, help="steps run before the profiled ones")
    f.add_argument("--steps", type=int, default=5, help="steps profiled")
    f.add_argument("--compile", default="off", help="comma-separated --compile values to run; a torch.compile mode "
                   "(max-autotune-no-cudagraphs) compiles in that mode")
    workload(f)
    g = sub.add_parser("large")
    common(g)
    g.add_argument("--model", default="bert-large")
    g.add_argument("--length", type=int, default=512)
    g.add_argument("--memory", default="24GiB", help="the cap the probe runs under and the plan is made for")
    g.add_argument("--policies", type=policy_list, default=",".join(POLICIES))
    g.add_argument("--steps", type=int, default=3)
    g.add_argument("--host-memory", default=None, help="host memory offload's plan is made for (default: the "
                   "host's available); its probe stops a little past that plan")
    g.add_argument("--name", default="large", help="the results file: NAME.json (large-*.json: another model, "
                   "cap or allocator beside large.json)")
    h = sub.add_parser("hostcost")
    common(h)
    h.add_argument("--tokens", type=int, default=17408, help="rows of the same-shape calls (bert-base at batch "
                   "256 of lengths 8 to 128 holds about this many real tokens)")
    h.add_argument("--calls", type=int, default=100)
    h.add_argument("--rounds", type=int, default=5)
    r = sub.add_parser("render")
    r.add_argument("--results-dir", default=str(RESULTS))
    a = p.parse_args(argv)
    C.use_hpcbert(None)
    from hpcbert import cuda_allocator_default
    cuda_allocator_default()  # CUDA's allocator as hpcbert train runs it: here and in the runs started from here
    if a.command == "large":  # read here: hpcbert is importable only after use_hpcbert
        from hpcbert.plan import parse_bytes
        try:
            a.memory = parse_bytes(a.memory)
        except ValueError as e:
            p.error(str(e))  # names the option: "memory: cannot read ..."
        try:
            a.host_memory = parse_bytes(a.host_memory) if a.host_memory else None
        except ValueError as e:
            p.error("--host-" + str(e))
    if os.environ.get("HPCBERT_COMMIT"):  # a copy of the tree whose .git (if any) is not the commit
        C.HPCBERT_SRC.update(commit=os.environ["HPCBERT_COMMIT"], note="copy of commit")
    if a.command in ("mfu", "profile") and (a.task == "mlm") != bool(a.data_dir):
        p.error("--data-dir goes with --task mlm, and --task mlm needs it")
    if getattr(a, "tokenizer", None):
        a.tokenizer = str(Path(a.tokenizer).resolve())
    Path(getattr(a, "results_dir")).mkdir(parents=True, exist_ok=True)
    return {"throughput": cmd_throughput, "mfu": cmd_mfu, "profile": cmd_profile, "large": cmd_large,
            "hostcost": cmd_hostcost, "render": cmd_render}[a.command](a)


if __name__ == "__main__":
    sys.exit(main())
