#!/usr/bin/env python
"""What two per-step settings of the training loop buy, on the loop itself (`hpcbert train`): the
host allocator (`dist.tune_host_allocator`: glibc malloc keeps freed memory mapped; without it,
`HPCBERT_HOST_ALLOCATOR=system`) and clipping without the multiplication by 1 (`optim.clip_grad_norm`;
without it, torch's `clip_grad_norm_`, which multiplies every gradient whatever the norm).

    python benchmarks/bench_step_overhead.py                  # measure, write results/step_overhead/
    python benchmarks/bench_step_overhead.py --render         # README.md from the JSON

Each configuration is one `hpcbert train` process (minilm-l6, synthetic task, batch 32, precision
auto, the same seed: the same batches), run at a short and a full maximum length; configurations
interleaved, `--repeats` times. A configuration's step time is each step's fastest over the repeats,
summed (`hpcbert.bench.best_of_repeats`: other work on the machine only ever adds time), relative
to hpcbert as shipped. Minor page faults per step come from the kernel (getrusage) around each step.
A measurement, not a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "BERT"))
RESULTS = ROOT / "results" / "step_overhead"
CONFIGS = {  # name -> (HPCBERT_HOST_ALLOCATOR, clipping)
    "hpcbert": ("retain", "hpcbert"),
    "torch clipping": ("retain", "torch"),
    "system malloc": ("system", "hpcbert"),
    "system malloc, torch clipping": ("system", "torch"),
}

# The child: one run, with page faults counted around each step (Trainer.step wrapped).
CHILD = r"""
import json, resource, sys, torch
from hpcbert import train as T, config
clip, out, length, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if clip == "torch":
    T.clip_grad_norm = lambda ps, m: torch.nn.utils.clip_grad_norm_(ps, m or float("inf"))
faults, step = [], T.Trainer.step
def counted(self, *a, **k):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    r = step(self, *a, **k)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return r
T.Trainer.step = counted
cfg = config.RunConfig(task="synthetic", model="minilm-l6", max_seq_length=length, batch_size=32, max_steps=steps,
                       do_eval=False, save_model=False, log_every=1, out=out, seed=42)
s = T.train(cfg)
print(json.dumps({"faults": faults, "host_allocator": s["host_allocator"], "precision": s["precision"]}))
"""


def say(msg: str) -> None:
    print(f"[step_overhead {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def one_run(name: str, length: int, steps: int, threads: int, work: Path) -> dict:
    from hpcbert.runfiles import read_metrics

    alloc, clip = CONFIGS[name]
    out = work / f"{name.replace(' ', '_').replace(',', '')}-{length}-{time.time_ns()}"
    env = dict(os.environ, HPCBERT_HOST_ALLOCATOR=alloc, OMP_NUM_THREADS=str(threads),
               PYTHONPATH=str(ROOT / "BERT") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", CHILD, clip, str(out), str(length), str(steps)], env=env,
                       capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        sys.exit(f"bench_step_overhead: {name} at {length} failed:\n{p.stderr[-3000:]}")
    child = json.loads(p.stdout.strip().splitlines()[-1])
    times = [m["step_time_s"] for m in read_metrics(out)]
    return {"config": name, "length": length, "step_times": times, "faults_per_step": child["faults"],
            "host_allocator": child["host_allocator"], "precision": child["precision"]}


def measure(a) -> dict:
    from hpcbert.bench import best_of_repeats

    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    runs = []
    for rep in range(a.repeats):
        for length in a.lengths:
            names = list(CONFIGS)
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                r = one_run(name, length, a.steps, a.threads, work)
                r["repeat"] = rep + 1
                runs.append(r)
                say(f"{name} @ {length}: median step {sorted(r['step_times'])[len(r['step_times']) // 2] * 1e3:.1f} ms, "
                    f"faults/step (last) {r['faults_per_step'][-1]}")
    rows = []
    for length in a.lengths:
        best = {}
        for name in CONFIGS:
            rs = [r for r in runs if r["config"] == name and r["length"] == length]
            best[name] = sum(best_of_repeats([r["step_times"] for r in rs], a.warmup, a.steps))
            faults = sorted(f for r in rs for f in r["faults_per_step"][a.warmup:])
            rows.append({"length": length, "config": name, "best_steps_s": best[name],
                         "median_faults_per_step": faults[len(faults) // 2],
                         "host_allocator": rs[0]["host_allocator"], "precision": rs[0]["precision"]})
        for row in rows:
            if row["length"] == length:
                row["time_vs_hpcbert"] = row["best_steps_s"] / best["hpcbert"]
                row["step_ms"] = 1e3 * row["best_steps_s"] / (a.steps - a.warmup)
    import torch

    from hpcbert.meters import cpu_name
    return {"command": ("python benchmarks/bench_step_overhead.py " + shlex.join(sys.argv[1:])).strip(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": a.threads, "torch": torch.__version__,
                        "python": platform.python_version(), "libc": " ".join(platform.libc_ver()),
                        "hpcbert_commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
                                                         capture_output=True, text=True).stdout.strip() or None},
            "settings": {"steps": a.steps, "warmup_excluded": a.warmup, "repeats": a.repeats, "lengths": a.lengths,
                         "batch": 32, "model": "minilm-l6", "task": "synthetic"},
            "rows": rows, "runs": runs}


def render(doc: dict) -> str:
    from hpcbert.report import markdown_grid

    s, m = doc["settings"], doc["machine"]
    out = ["# Per-step overhead: host allocator and clipping", "",
           "Generated by `python benchmarks/bench_step_overhead.py --render` from `step_overhead.json`.", "",
           f"```\n{doc['command']}\n```", "",
           f"Measured {doc['date']} on {m['cpu']}, {m['cores']} cores, {m['threads']} threads; {m['libc']}; torch "
           f"{m['torch']}; hpcbert commit {m['hpcbert_commit']}.", "",
           f"`hpcbert train`, {s['model']}, synthetic task (lengths up to the maximum), batch {s['batch']}, precision "
           f"{doc['rows'][0]['precision']}, {s['steps']} steps per run, first {s['warmup_excluded']} left out, "
           f"{s['repeats']} interleaved repeats; time = each step's fastest over the repeats, summed, relative to "
           f"hpcbert as shipped.", ""]
    rows = [[str(r["length"]), r["config"], r["host_allocator"], f"{r['step_ms']:.1f}",
             f"**{r['time_vs_hpcbert']:.2f}x**", str(r["median_faults_per_step"])] for r in doc["rows"]]
    out += [markdown_grid(["max length", "configuration", "host allocator", "step ms (best of repeats, mean)",
                           "time vs hpcbert", "minor page faults per step (median)"], rows).rstrip("\n"), ""]
    return "\n".join(out) + "\n"


def render_readme(results: Path = RESULTS) -> str:
    return render(json.loads((results / "step_overhead.json").read_text()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=lambda v: [int(x) for x in v.split(",")], default=[16, 128])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--work-dir", default="/tmp/hpcbert-step-overhead")
    p.add_argument("--results-dir", default=str(RESULTS))
    p.add_argument("--render", action="store_true")
    a = p.parse_args(argv)
    results = Path(a.results_dir)
    path = results / "step_overhead.json"
    if not a.render:
        doc = measure(a)
        results.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
    (results / "README.md").write_text(render_readme(results))
    print((results / "README.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
