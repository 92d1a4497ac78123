"""LAMB step time: hpcbert's multi-tensor (torch._foreach_*) Lamb vs the per-tensor loop it replaced.

    python benchmarks/bench_lamb.py [--model bert-base] [--repeats 12] [--threads CORES] [--out results/lamb]
    python benchmarks/bench_lamb.py --render      # README.md again from the JSON, nothing measured

One process, one model of the named shape (random weights, hpcbert.zoo), its parameters in the two
groups hpcbert trains with (weight decay 0.01, none on biases and LayerNorm weights), gradients
filled with N(0, 1) values once. Two optimizers over the same parameters, each with its own state:
`hpcbert.optim.Lamb` (foreach) and `LoopLamb` from tests/test_lamb.py (the per-tensor reference
that the tests prove it equal to). After --warmup steps of each, every repeat times one step of
each, in alternating order (so machine noise hits both alike); the figure is the median step time
per implementation and the median over repeats of loop / foreach within a repeat. Torch threads:
CPU cores unless --threads says otherwise. Writes OUT/bench_lamb.json and OUT/README.md (the table is generated here).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "BERT"))
sys.path.insert(0, str(ROOT / "tests"))  # the per-tensor reference lives with the tests
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import _small_bench  # noqa: E402
from hpcbert import meters, zoo  # noqa: E402
from hpcbert.model import BertForSequenceClassification  # noqa: E402
from hpcbert.optim import Lamb, param_groups  # noqa: E402
from test_lamb import LoopLamb  # noqa: E402

IMPLS = ("foreach", "loop")


def busy_cpu_s() -> float:
    """Seconds of CPU time all cores of the machine spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]  # idle + iowait
    return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def timed_step(opt: torch.optim.Optimizer, device: torch.device) -> tuple[float, float]:
    """-> (wall seconds, CPU seconds of this process over all its threads) of one step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0, c0 = time.perf_counter(), time.process_time()
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CPU-GPU sync point: the step's kernels have run
    return time.perf_counter() - t0, time.process_time() - c0


def measure(a) -> dict:
    device = torch.device(a.device)
    allocator = _small_bench.setup(a.threads)  # threads and the host allocator, as hpcbert train sets them
    torch.manual_seed(0)
    cfg = zoo.resolve(a.model).config
    model = BertForSequenceClassification(cfg).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    opts = {"foreach": Lamb(param_groups(model, a.weight_decay), lr=a.lr),
            "loop": LoopLamb(param_groups(model, a.weight_decay), lr=a.lr)}
    for name in IMPLS:
        for _ in range(a.warmup):
            timed_step(opts[name], device)
    times: dict[str, list[float]] = {n: [] for n in IMPLS}
    cpu: dict[str, list[float]] = {n: [] for n in IMPLS}
    other: list[float] = []  # per repeat: cores that other processes kept busy (machine busy time minus ours)
    load_before = os.getloadavg()[0]
    for r in range(a.repeats):
        cpu0, own0, t0 = busy_cpu_s(), time.process_time(), time.perf_counter()
        for name in (IMPLS if r % 2 == 0 else IMPLS[::-1]):
            wall, used = timed_step(opts[name], device)
            times[name].append(wall)
            cpu[name].append(used)
        other.append(max(0.0, (busy_cpu_s() - cpu0 - (time.process_time() - own0)) / (time.perf_counter() - t0)))
        print(f"[bench_lamb] repeat {r + 1}/{a.repeats}: loop {times['loop'][-1] * 1e3:.1f} ms, foreach "
              f"{times['foreach'][-1] * 1e3:.1f} ms, other work {other[-1]:.2f} cores", file=sys.stderr, flush=True)
    for p in params:  # both optimizers moved the weights: they are still finite
        assert torch.isfinite(p).all()
    ratios = [lo / fe for lo, fe in zip(times["loop"], times["foreach"])]
    cpu_ratios = [lo / fe for lo, fe in zip(cpu["loop"], cpu["foreach"])]
    n_elems = sum(p.numel() for p in params)
    return {
        "meta": {
            "command": "python " + " ".join(shlex.quote(x) for x in [str(Path(__file__).relative_to(ROOT)),
                                                                      *sys.argv[1:]]),
            "model": a.model, "parameter_tensors": len(params), "parameters": n_elems,
            "dtype": str(params[0].dtype).replace("torch.", ""), "lr": a.lr, "weight_decay": a.weight_decay,
            "warmup_steps": a.warmup, "repeats": a.repeats, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else meters.cpu_name(),
            "machine": platform.machine(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "host_allocator": allocator,
            "load_average_1min": [load_before, os.getloadavg()[0]], "other_work_cores": statistics.mean(other),
            "other_work_cores_per_repeat": other,
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        },
        "step_time_s": {n: {"median": statistics.median(times[n]), "min": min(times[n]), "all": times[n]}
                        for n in IMPLS},
        "step_cpu_s": {n: {"median": statistics.median(cpu[n]), "all": cpu[n]} for n in IMPLS},
        "ratio_loop_over_foreach": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                                    "of_best": min(times["loop"]) / min(times["foreach"]), "all": ratios,
                                    "cpu_time_median": statistics.median(cpu_ratios), "cpu_time_all": cpu_ratios},
    }


def render(res: dict) -> str:
    m, t, c, r = res["meta"], res["step_time_s"], res["step_cpu_s"], res["ratio_loop_over_foreach"]
    gb = m["parameters"] * 4 / 1e9
    lines = [
        "# LAMB step time: multi-tensor (foreach) vs per-tensor loop",
        "",
        "Generated by `benchmarks/bench_lamb.py` from `bench_lamb.json`; do not edit by hand.",
        "",
        f"Command: `{m['command']}`",
        "",
        f"Fixed: {m['model']} shape ({m['parameter_tensors']} parameter tensors, {m['parameters'] / 1e6:.1f} M "
        f"parameters, {m['dtype']}, {gb:.2f} GB), random weights, gradients N(0, 1), weight decay "
        f"{m['weight_decay']} (not on biases and LayerNorm weights), lr {m['lr']}; {m['device']} "
        f"({m['device_name']}), {m['cores']} cores, torch {m['torch']} with {m['threads']} threads; "
        f"{m['warmup_steps']} warm-up steps each, then {m['repeats']} repeats, each timing one step of both "
        f"in alternating order. The machine was shared: 1-minute load average {m['load_average_1min'][0]:.1f} "
        f"before, {m['load_average_1min'][1]:.1f} after; other processes kept {m['other_work_cores']:.2f} "
        f"cores busy on average while the repeats ran. Host allocator: {_small_bench.allocator(m)}. "
        f"{m['date_utc']} UTC.",
        "",
        "| implementation | step time (ms, median) | step time (ms, fastest) | CPU time (ms, median) |",
        "|---|---:|---:|---:|",
        *(f"| {label} | {t[n]['median'] * 1e3:.1f} | {t[n]['min'] * 1e3:.1f} | {c[n]['median'] * 1e3:.1f} |"
          for n, label in (("loop", "per-tensor loop (tests/test_lamb.py `LoopLamb`)"),
                           ("foreach", "foreach (`hpcbert.optim.Lamb`)"))),
        "",
        f"**loop / foreach: {r['median']:.2f}x** (median over repeats of the step-time ratio within a repeat; "
        f"range {r['min']:.2f}–{r['max']:.2f}). Fastest loop step / fastest foreach step: {r['of_best']:.2f}x. "
        f"CPU time, loop / foreach: {r['cpu_time_median']:.2f}x (median over repeats).",
        "",
        "- Both implementations run the same algorithm (You et al. 2020, Algorithm 2) and agree to 1e-6 "
        "relative on every parameter (tests/test_lamb.py).",
        "- Step time is wall-clock from the call of `step()` to its return. Other work on a shared machine "
        "only adds time, so the fastest steps estimate a quiet machine.",
        "- CPU time: this process's CPU seconds (all threads) during the step. Time spent waiting for a core "
        "taken by other work is not in it, so it is less sensitive to a busy machine than the step time; "
        "it does include threads spinning while they wait for each other.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bert-base", choices=sorted(zoo.RANDOM_SHAPES),
                    help="a random-weight shape from hpcbert.zoo")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: CPU cores)")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="steps of each optimizer before timing")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--out", default=str(ROOT / "results" / "lamb"), help="results folder")
    ap.add_argument("--render", action="store_true", help="only regenerate OUT/README.md from OUT/bench_lamb.json")
    a = ap.parse_args()
    if a.repeats < 1 or a.warmup < 0 or a.threads < 1:
        ap.error(f"--repeats and --threads must be >= 1 and --warmup >= 0 (got {a.repeats}, {a.threads}, {a.warmup})")
    out = Path(a.out)
    if a.render:
        path = out / "bench_lamb.json"
        if not path.is_file():
            sys.exit(f"bench_lamb: {path} not found (run the benchmark first)")
        res = json.loads(path.read_text())
    else:
        res = measure(a)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_lamb.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "README.md").write_text(render(res))
    print(render(res))


if __name__ == "__main__":
    main()
