"""`hpcbert bench`: the embedded default benchmark.

With no arguments: the pretrained minilm-l6 on the synthetic task, short time-boxed runs of every
gradient-checkpointing policy (none, selective, alternate, all), each in its own process (so
start-up, peak memory and the time box are each run's own), in 3 rounds that interleave the
policies (round r starts with the r-th policy), then a table of throughput, step time and
activation memory per policy relative to `none`, and an HTML report beside the run directories.
About 3 minutes on a 2-core CPU. Every train option can be given to change what is benchmarked.

Why rounds: on a shared machine other work only ever adds time to a step, and it comes and goes.
Every run of the bench uses the same seed, so step i trains on the same batch in every run of
every policy; the fastest time of step i over the rounds is that step's time without the
contention, and a policy's time relative to `none` is the sum of those fastest times over the
steps every run reached. One long run per policy measured each under whatever load its minute
happened to have.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import config
from .config import parse_grad_ckpt

# Rounds of short boxes, 12 runs x 15 s: the 3 x 50 s the bench took with one run per policy. The
# LR schedule (10% warm-up) is one epoch's (128 steps at batch 32), so the short boxes train at full
# LR. Every step is logged (outside the timed step), so every step's time is in metrics.jsonl.
DEFAULTS = dict(model="minilm-l6", task="synthetic", time_budget="15s", epochs=1.0, lr=5e-5, log_every=1,
                do_eval=False, save_model=False)
DEFAULT_POLICIES = "none,selective,alternate,all"
DEFAULT_ROUNDS = 3


def add_options(p: argparse.ArgumentParser) -> None:
    config.add_arguments(p, defaults=DEFAULTS)
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help=f"comma-separated checkpointing policies (default: {DEFAULT_POLICIES})")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                   help=f"runs per policy, interleaved (default: {DEFAULT_ROUNDS})")


def _measure_peak_once(base: config.RunConfig) -> None:
    """MFU divides by the device's peak. On CPU it is measured: once here, before the runs, and
    cached for the machine, so every policy's run divides by the same peak (each run measuring its
    own let contention make `alternate` look more efficient than `none`)."""
    import torch

    from . import dist, meters, policies as pol

    if torch.cuda.is_available():
        return  # GPU peaks come from data sheets
    torch.set_num_threads(base.threads or dist.default_threads(1))  # what each run will use
    cpu = torch.device("cpu")
    peak, source = meters.peak_flops(cpu, pol.resolve_precision(base.precision, cpu), refresh=True)
    print(f"[hpcbert bench] peak {peak / 1e9:.0f} GFLOP/s for MFU ({source})", file=sys.stderr, flush=True)


def best_of_repeats(step_times: list[list[float]], first: int, last: int) -> list[float]:
    """For each step i in [first, last): its fastest time over the repeats (lists of step times of
    runs that trained on the same batches in the same order)."""
    return [min(t[i] for t in step_times) for i in range(first, last)]


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Per policy, from its runs' summary.json and metrics.jsonl (`runs[policy]` = [{summary,
    metrics}, ...]): best-of-rounds step time and throughput over the steps every run reached,
    and each relative to `none`."""
    first = max(r["summary"]["warmup_steps_excluded"] for rs in runs.values() for r in rs)
    # A run that logged no timed step (a stall on a shared machine ate its box) is left out, and
    # named, where its policy has another round; a policy with none left cannot be compared.
    dropped = [r["summary"]["run"] for rs in runs.values() for r in rs if len(r["metrics"]) <= first]
    runs = {p: [r for r in rs if len(r["metrics"]) > first] for p, rs in runs.items()}
    short = [p for p, rs in runs.items() if not rs]
    if short:
        raise ValueError(f"bench: no run of {', '.join(short)} logged more than the {first} untimed first step(s); "
                         f"give a longer --time-budget")
    n_common = min(len(r["metrics"]) for rs in runs.values() for r in rs)
    out: dict = {"steps_compared": [first + 1, n_common], "dropped_runs": dropped, "policies": {}}
    for policy, rs in runs.items():
        times = [[m["step_time_s"] for m in r["metrics"]] for r in rs]
        best = best_of_repeats(times, first, n_common)
        seqs = [round(m["sequences_per_sec"] * m["step_time_s"]) for m in rs[0]["metrics"][first:n_common]]
        tokens = [[round(m["tokens_per_sec"] * m["step_time_s"]) for m in r["metrics"][first:n_common]] for r in rs]
        s = rs[0]["summary"]
        out["policies"][policy] = {
            "runs": [r["summary"]["run"] for r in rs],
            "best_step_time_s": sum(best) / len(best),
            "best_seq_per_s": sum(seqs) / sum(best),
            "same_batches": all(t == tokens[0] for t in tokens),
            "median_seq_per_s_per_round": [r["summary"]["steady_sequences_per_sec"] for r in rs],
            "steps_in_budget_per_round": [r["summary"]["steps_in_budget"] for r in rs],
            "startup_s_per_round": [r["summary"]["startup_s"] for r in rs],
            "peak_memory_bytes": max(r["summary"]["peak_memory_bytes"] or 0 for r in rs),
            "activation_bytes_per_sequence": s["activation_bytes_per_sequence"],
            "mfu": s["mfu"], "precision": s["precision"], "batch": s["per_device_batch_size"],
            "_best": best,
        }
    none = out["policies"].get("none")
    for p in out["policies"].values():
        if none:
            p["time_vs_none"] = sum(p["_best"]) / sum(none["_best"])
            p["bytes_vs_none"] = p["activation_bytes_per_sequence"] / none["activation_bytes_per_sequence"]
    for p in out["policies"].values():
        del p["_best"]
    return out


def render(result: dict) -> str:
    from .report import markdown_grid

    a, b = result["steps_compared"]
    rows = []
    for policy, p in result["policies"].items():
        rows.append([policy, f"{p['best_seq_per_s']:.1f}", f"{1000 * p['best_step_time_s']:.0f}",
                     f"{p.get('time_vs_none', float('nan')):.2f}x",
                     f"{p['activation_bytes_per_sequence'] / 2**20:.2f}", f"{p.get('bytes_vs_none', float('nan')):.2f}x",
                     f"{p['peak_memory_bytes'] / 2**30:.2f}",
                     ", ".join(str(x) for x in p["steps_in_budget_per_round"]),
                     ", ".join(f"{x:.1f}" for x in p["startup_s_per_round"])])
    rounds = max(len(p["runs"]) for p in result["policies"].values())
    head = (f"Steps {a}..{b} of every run, fastest of up to {rounds} "
            f"interleaved rounds per step (the same batches in every run: "
            f"{'checked' if all(p['same_batches'] for p in result['policies'].values()) else 'NOT the same'})"
            + (f"; left out, no timed step: {', '.join(result['dropped_runs'])}." if result.get("dropped_runs") else "."))
    return head + "\n\n" + markdown_grid(
        ["grad_ckpt", "seq/s", "step ms", "time vs none", "act MiB/seq", "bytes vs none", "peak mem GiB",
         "steps in box (per round)", "startup s (per round)"], rows)


def run(ns: argparse.Namespace) -> int:
    from .report import bench_report
    from .runfiles import read_metrics, read_summary

    policies = [parse_grad_ckpt(p) for p in ns.policies.split(",") if p.strip()]
    if ns.rounds < 1:
        raise ValueError(f"rounds: must be >= 1, got {ns.rounds}")
    base = config.from_namespace(ns)
    bench_dir = Path(base.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    _measure_peak_once(base)
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    run_dirs = []
    for r in range(ns.rounds):
        for policy in policies[r % len(policies):] + policies[:r % len(policies)]:
            name = policy.replace(":", "") + (f"-r{r + 1}" if ns.rounds > 1 else "")
            cfg = base.replace(grad_ckpt=policy, out=str(bench_dir / name))
            print(f"[hpcbert bench] round {r + 1}/{ns.rounds}: grad_ckpt={policy} -> {cfg.out}", file=sys.stderr,
                  flush=True)
            proc = subprocess.run([sys.executable, "-m", "hpcbert.cli", "train", *config.to_argv(cfg)], env=env)
            if proc.returncode != 0:
                print(f"[hpcbert bench] run {cfg.out} failed with exit code {proc.returncode}", file=sys.stderr)
                return proc.returncode
            run_dirs.append(Path(cfg.out))
            runs[policy].append({"summary": read_summary(cfg.out), "metrics": read_metrics(cfg.out)})
    result = summarise(runs)
    result["command"] = "hpcbert bench " + " ".join(sys.argv[2:])
    (bench_dir / "bench.json").write_text(json.dumps(result, indent=1))
    (bench_dir / "bench.md").write_text(render(result) + "\n")  # the table printed below, kept with the runs
    html = bench_dir / "report.html"
    bench_report(run_dirs, html)  # every run's figures, for the HTML report
    print(render(result))
    print(f"\nrun directories: {bench_dir}/; bench.json, bench.md (this table) and report.html there")
    return 0
