"""`hpcbert bench`: the embedded default benchmark.

With no arguments: the pretrained minilm-l6 on the synthetic task, every gradient-checkpointing
policy (none, selective, alternate, all), measured two ways, then a table per policy relative to
`none` and an HTML report beside the run directories. About 3 minutes on a 2-core CPU. Every train
option can be given to change what is benchmarked.

1. Interleaved (the ratios a user quotes): one process, one model, the training loop's own step
   (`Trainer.step`); the policy is switched on the model between steps. A few batches
   (INTERLEAVED_BATCHES, taken in turn) are measured over and over: block k runs its batch under
   every policy twice, in the order P1..Pn Pn..P1 (the first policy rotates with k), so each
   policy's measurements of a batch sit seconds apart and beside every other policy's. A policy's
   step time for a batch is its fastest over every block of that batch; its time relative to
   `none` is the sum of those over the batches, over the same sum for `none`. On a shared machine
   other work only ever adds time: the fastest of many measurements of the same step drops load
   that comes and goes within seconds, but not load that lasts the whole bench. Separate runs
   per policy (what the bench did first) moved the ratios by up to 8% from one bench to the next,
   a new batch per block (the fastest of two) by 7%, and this scheme by up to 10% on a busy day
   of the project's shared 2-core host, within 2% over three consecutive fp32 benches on a quieter
   one, and within 1.3% over three bf16 benches of the batches of steps 3 to 10 on an AVX512-BF16
   host (results/bench/, its checkout-1/ and checkout-2/): compare within one bench.
2. Runs: one short time-boxed run per policy, each in its own process, through the whole loop
   (`hpcbert train`), for what only a run has: start-up, peak memory, steps in the box, MFU, the
   report. `--rounds N` repeats them, interleaved (round r starts with the r-th policy), and their
   step time is then each step's fastest over the rounds (the same batches in every run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import config, objectives
from .config import parse_grad_ckpt

# Interleaved 90 s + 4 runs x 15 s: the 3 minutes the bench took as 3 rounds of 4 x 15-s runs. The
# LR schedule (10% warm-up) is one epoch's (128 steps at batch 32), so the short boxes train at full
# LR. Every step is logged (outside the timed step), so every step's time is in metrics.jsonl.
DEFAULTS = dict(model="minilm-l6", task="synthetic", time_budget="15s", epochs=1.0, lr=5e-5, log_every=1,
                do_eval=False, save_model=False)
DEFAULT_POLICIES = "none,selective,alternate,all"
DEFAULT_ROUNDS = 1
DEFAULT_INTERLEAVED = "90s"
# Batches the interleaved measurement cycles over: those of steps 3 to 10 (batches 2..9 of the
# first epoch; steps 1 and 2 warm up), of many lengths, so no one batch's shape decides the ratio
# (a policy's cost depends on the length: a checkpointing mechanism's fixed time per layer or per
# saved tensor is a larger share of a short batch's step). benchmarks/compare_hf.py policies cross-checks the
# ratios in processes of their own (same seed, sampler and synthetic task; a set of 10 batches
# passed over 3 times, the last pass compared: a fresh process's first steps grow its heap, which
# costs none the most and put its ratios ~5% low).
# About 4 blocks each in the default 90 s: each policy's fastest of ~8 times per batch.
INTERLEAVED_FIRST, INTERLEAVED_BATCHES = 2, 8


def add_options(p: argparse.ArgumentParser) -> None:
    config.add_arguments(p, defaults=DEFAULTS)
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help=f"comma-separated checkpointing policies (default: {DEFAULT_POLICIES})")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                   help=f"time-boxed runs per policy, interleaved (default: {DEFAULT_ROUNDS})")
    p.add_argument("--interleaved", default=DEFAULT_INTERLEAVED, metavar="DURATION",
                   help="time for the interleaved measurement of the policies in one process, whose ratios the "
                        f"table leads with (default: {DEFAULT_INTERLEAVED}; 0 = runs only)")


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


def interleaved_budget(text: str) -> float | None:
    """--interleaved: a duration, or 0 / off for none."""
    if str(text).strip().lower() in ("0", "0s", "off"):
        return None
    return config.parse_duration(text, "interleaved")


def interleaved(base: config.RunConfig, policies: list[str], budget_s: float, out: Path) -> dict:
    """The policies measured in this process on one model, batch by batch (module docstring, 1.).
    `out` becomes a run directory holding config.json and interleaved.json (every measured time)."""
    import torch

    from . import dist, meters, objectives
    from . import policies as pol
    from .data.features import epoch_order, global_batches
    from .runfiles import write_json_atomic
    from .train import Trainer

    # The step of the loop as configured, but eager (a compiled model would recompile at every
    # switch) and with nothing for the loop's end (no time box, evaluation or saved model).
    cfg = base.replace(grad_ckpt="none", out=str(out), compile="off", time_budget=None, do_eval=False,
                       save_model=False)
    d = dist.init(cfg.threads, cfg.dist_timeout)
    if d.world_size > 1:
        raise ValueError("bench: the interleaved measurement runs in one process (start hpcbert bench without "
                         "torchrun; each run of the policies starts its own processes)")
    try:
        tr = Trainer(cfg, d, objectives.get(cfg))
        model = tr.raw

        def use(policy: str) -> None:
            pol.unwrap_layers(model)
            pol.apply_grad_ckpt(model, policy)

        def sync() -> None:
            if d.device.type == "cuda":
                torch.cuda.synchronize(d.device)

        acts = {}
        for p in policies:
            use(p)
            acts[p] = meters.activation_bytes_per_sequence(model, tr._example_loss, d.device)
        batches = global_batches(epoch_order(tr.train_set.lengths, cfg.sampler, cfg.seed, 0, tr.plan.global_batch),
                                 tr.plan.global_batch)

        def timed(policy: str, gb) -> tuple[float, float]:
            use(policy)
            sync()
            t0 = time.perf_counter()
            loss, _, counts = tr.step(gb)
            float(loss)
            sync()
            return time.perf_counter() - t0, counts[0]

        for p in policies:  # first steps pay for lazy initialisation: untimed
            timed(p, batches[0])
        blocks: list[dict] = []
        end = time.perf_counter() + budget_s
        measured = list(range(INTERLEAVED_FIRST, min(len(batches), INTERLEAVED_FIRST + INTERLEAVED_BATCHES))) or [0]
        while not blocks or time.perf_counter() < end:
            k = len(blocks)
            i = measured[k % len(measured)]
            gb = batches[i]
            order = policies[k % len(policies):] + policies[:k % len(policies)]
            times: dict[str, list[float]] = {p: [] for p in policies}
            for p in order + order[::-1]:
                dt, tokens = timed(p, gb)
                times[p].append(dt)
            blocks.append({"batch": i, "sequences": len(gb), "real_tokens": tokens, "order": order, "times": times})
    finally:
        dist.shutdown(d)
    res = summarise_interleaved(blocks, acts)
    res["budget_s"] = budget_s
    write_json_atomic(out / "interleaved.json", {**res, "blocks_measured": blocks})
    return res


def summarise_interleaved(blocks: list[dict], acts: dict[str, int]) -> dict:
    """Per policy from the blocks (each: its batch's index and every policy's times for it): the
    fastest time per batch over all its blocks, summed over the batches, relative to `none`'s sum;
    also the median over batches of the per-batch ratio (to show the first is not carried by one
    batch). A block without a batch index is a batch of its own."""
    import statistics

    groups: dict = {}
    for k, b in enumerate(blocks):
        groups.setdefault(b.get("batch", f"block{k}"), []).append(b)
    best = {p: [min(t for b in g for t in b["times"][p]) for g in groups.values()] for p in acts}
    seqs = sum(g[0]["sequences"] for g in groups.values())
    out: dict = {"blocks": len(blocks), "batches": len(groups), "policies": {}}
    for p in acts:
        row = {"best_step_time_s": sum(best[p]) / len(groups), "seq_per_s": seqs / sum(best[p]),
               "activation_bytes_per_sequence": acts[p]}
        if "none" in acts:
            row["time_vs_none"] = sum(best[p]) / sum(best["none"])
            row["median_batch_ratio"] = statistics.median(x / y for x, y in zip(best[p], best["none"]))
            row["bytes_vs_none"] = acts[p] / acts["none"]
        out["policies"][p] = row
    return out


def render(result: dict) -> str:
    """The table: with an interleaved measurement, its ratios and step times lead and the runs add
    what only a run has; without one (--interleaved 0), the runs' best-of-rounds figures."""
    from .report import markdown_grid

    a, b = result["steps_compared"]
    same = all(p["same_batches"] for p in result["policies"].values())
    rounds = max(len(p["runs"]) for p in result["policies"].values())
    runs_line = (f"Runs: one time-boxed process per policy and round; steps {a}..{b} of every run"
                 + (f", fastest of {rounds} interleaved rounds per step" if rounds > 1 else "")
                 + f" (the same batches in every run: {'checked' if same else 'NOT the same'})"
                 + (f"; left out, no timed step: {', '.join(result['dropped_runs'])}." if result.get("dropped_runs")
                    else "."))
    inter = result.get("interleaved")
    rows = []
    for policy, p in result["policies"].items():
        run_cells = [f"{p['best_seq_per_s']:.1f}", f"{p['peak_memory_bytes'] / 2**30:.2f}",
                     ", ".join(str(x) for x in p["steps_in_budget_per_round"]),
                     ", ".join(f"{x:.1f}" for x in p["startup_s_per_round"])]
        if inter:
            q = inter["policies"][policy]
            rows.append([policy, f"{q.get('time_vs_none', float('nan')):.2f}x", f"{q.get('bytes_vs_none', float('nan')):.2f}x",
                         f"{1000 * q['best_step_time_s']:.0f}", f"{q['seq_per_s']:.1f}",
                         f"{q['activation_bytes_per_sequence'] / 2**20:.2f}", *run_cells])
        else:
            rows.append([policy, f"{p.get('time_vs_none', float('nan')):.2f}x", f"{p.get('bytes_vs_none', float('nan')):.2f}x",
                         f"{1000 * p['best_step_time_s']:.0f}", f"{p['best_seq_per_s']:.1f}",
                         f"{p['activation_bytes_per_sequence'] / 2**20:.2f}", *run_cells[1:]])
    if inter:
        n_batches = inter.get("batches", inter["blocks"])
        head = (f"Interleaved: {inter['blocks']} blocks over {n_batches} batch(es) in one process, each block its "
                f"batch under every policy twice (order P1..Pn Pn..P1, rotating); a policy's fastest time per "
                f"batch, summed over the batches. "
                + runs_line)
        cols = ["grad_ckpt", "time vs none", "bytes vs none", "step ms", "seq/s", "act MiB/seq",
                "run seq/s", "run peak mem GiB", "run steps in box", "run startup s"]
    else:
        head = runs_line
        cols = ["grad_ckpt", "time vs none", "bytes vs none", "step ms", "seq/s", "act MiB/seq",
                "peak mem GiB", "steps in box (per round)", "startup s (per round)"]
    return head + "\n\n" + markdown_grid(cols, rows)


def run(ns: argparse.Namespace) -> int:
    from .report import bench_report
    from .runfiles import read_metrics, read_summary

    policies = [parse_grad_ckpt(p) for p in ns.policies.split(",") if p.strip()]
    if ns.rounds < 1:
        raise ValueError(f"rounds: must be >= 1, got {ns.rounds}")
    budget = interleaved_budget(ns.interleaved)  # a bad value fails before any run
    base = config.from_namespace(ns)
    objectives.refuse_unread(base)  # before the first run, as each run's own check would
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
    if budget:
        print(f"[hpcbert bench] interleaved: {', '.join(policies)} in one process, {budget:.0f} s -> "
              f"{bench_dir / 'interleaved'}", file=sys.stderr, flush=True)
        result["interleaved"] = interleaved(base, policies, budget, bench_dir / "interleaved")
    result["command"] = "hpcbert bench " + " ".join(sys.argv[2:])
    (bench_dir / "bench.json").write_text(json.dumps(result, indent=1))
    (bench_dir / "bench.md").write_text(render(result) + "\n")  # the table printed below, kept with the runs
    html = bench_dir / "report.html"
    bench_report(run_dirs, html)  # every run's figures, for the HTML report
    print(render(result))
    print(f"\nrun directories: {bench_dir}/; bench.json, bench.md (this table) and report.html there")
    return 0
