"""`hpcbert bench`: the embedded default benchmark.

With no arguments: the pretrained minilm-l6 on the synthetic task, one short time-boxed run per
gradient-checkpointing policy (none, alternate, all), each in its own process (so start-up, peak
memory and the time box are each run's own), then a table of throughput, activation memory and
step-time cost per policy, and an HTML report beside the run directories. About 3 minutes on a
2-core CPU. Every train option can be given to change what is benchmarked.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from . import config
from .config import parse_grad_ckpt

# One epoch of the synthetic task (128 steps at batch 32), cut by the 50 s time box on a small CPU:
# the LR schedule (10% warm-up) is that of the epoch, so even a short box trains at full LR.
DEFAULTS = dict(model="minilm-l6", task="synthetic", time_budget="50s", epochs=1.0, lr=5e-5, log_every=5,
                save_model=False)  # measurements: no final model to write
DEFAULT_POLICIES = "none,alternate,all"


def add_options(p: argparse.ArgumentParser) -> None:
    config.add_arguments(p, defaults=DEFAULTS)
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help=f"comma-separated checkpointing policies, one run each (default: {DEFAULT_POLICIES})")


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


def run(ns: argparse.Namespace) -> int:
    from .report import bench_report

    policies = [parse_grad_ckpt(p) for p in ns.policies.split(",") if p.strip()]
    base = config.from_namespace(ns)
    bench_dir = Path(base.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    _measure_peak_once(base)
    run_dirs = []
    for policy in policies:
        cfg = base.replace(grad_ckpt=policy, out=str(bench_dir / policy.replace(":", "")))
        print(f"[hpcbert bench] grad_ckpt={policy} -> {cfg.out}", file=sys.stderr, flush=True)
        proc = subprocess.run([sys.executable, "-m", "hpcbert.cli", "train", *config.to_argv(cfg)], env=env)
        if proc.returncode != 0:
            print(f"[hpcbert bench] run {cfg.out} failed with exit code {proc.returncode}", file=sys.stderr)
            return proc.returncode
        run_dirs.append(Path(cfg.out))
    html = bench_dir / "report.html"
    print(bench_report(run_dirs, html))
    print(f"\nrun directories: {bench_dir}/{{{','.join(d.name for d in run_dirs)}}}; report: {html}")
    return 0
