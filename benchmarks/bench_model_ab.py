"""A change to the model file, measured: this checkout's BERT/hpcbert/model.py against the one of
an earlier commit, training on the same batches in one process.

    python benchmarks/bench_model_ab.py --rev 11f30cc~1 [--steps 30] [--out results/model_ab]
    python benchmarks/bench_model_ab.py --render      # README.md again from the JSON, nothing measured

The earlier model file is read with `git show REV:BERT/hpcbert/model.py` and imported beside the
current one (the model file imports nothing of hpcbert's). Both models get the same weights
(minilm-l6 shape, random, the current model's state_dict loaded into the earlier one), dropout on,
fp32 (`--precision bf16`: under bf16 autocast, as a bf16 run trains), AdamW (fused). Three
workloads, the lengths hpcbert's length-grouped sampler gives each task on minilm-l6's vocabulary: SST-2 (classifier, batch 32, lengths 10-20, within 2 of each other),
MRPC (classifier, batch 32, lengths 40-60, within 2) and SQuAD v1.1 (span head, batch 16, windows
of 140-200 tokens, within 7). Each batch runs a whole training step (forward, backward, optimizer)
on both models in alternating order, so machine noise hits both alike; the figure is the median
over batches of earlier / current step time within a batch, beside each side's median step.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "BERT"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import _small_bench  # noqa: E402
from hpcbert import model as current, policies, zoo  # noqa: E402

# name: (head, batch, lowest and highest first length, spread within a batch)
WORKLOADS = {"sst-2": ("classifier", 32, (10, 20), 2), "mrpc": ("classifier", 32, (40, 60), 2),
             "squad": ("span", 16, (140, 200), 7)}


def load_model_file(rev: str, tmp: Path):
    src = subprocess.run(["git", "show", f"{rev}:BERT/hpcbert/model.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    # Its custom operators under a namespace of their own: registering hpcbert::<op> a second time
    # would silently replace the current file's operator, and both sides would run the earlier one.
    src = src.replace('"hpcbert::', '"hpcbert_earlier::').replace("torch.ops.hpcbert.", "torch.ops.hpcbert_earlier.")
    path = tmp / "model_earlier.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("model_earlier", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["model_earlier"] = mod
    spec.loader.exec_module(mod)
    return mod


def build(mod, head: str):
    """The workload's minilm-l6-shaped model from model file `mod`, seed 0, in training mode."""
    torch.manual_seed(0)
    cfg = {**zoo.resolve("minilm-l6").config.to_dict(), "num_labels": 2}
    cls = mod.BertForSequenceClassification if head == "classifier" else mod.BertForQuestionAnswering
    return cls(mod.BertConfig(**cfg)).train()


def measure(earlier, workload: str, steps: int, threads: int, sides: dict | None = None,
            autocast=contextlib.nullcontext) -> dict:
    """`sides`: {"current": (model file, model), "earlier": (model file, model)}, the same weights;
    by default this checkout's model file and `earlier`'s. Each step runs under `autocast()`."""
    head, B, (lo, hi), spread = WORKLOADS[workload]
    if sides is None:
        sides = {"current": (current, build(current, head)), "earlier": (earlier, build(earlier, head))}
        sides["earlier"][1].load_state_dict(sides["current"][1].state_dict())
    mods = {k: mod for k, (mod, _) in sides.items()}
    sides = {k: m for k, (_, m) in sides.items()}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True) for k, m in sides.items()}
    rng = np.random.default_rng(0)

    def batch():
        first = int(rng.integers(lo, hi))
        lengths = np.sort(rng.integers(first, first + spread + 1, B))[::-1].copy()
        T = int(lengths.max())
        mask = torch.arange(T)[None] < torch.from_numpy(lengths)[:, None]
        ids = torch.randint(1000, 20000, (B, T)) * mask
        return ids, mask, torch.zeros_like(ids), lengths

    def step(b, side: str) -> float:
        ids, mask, types, lengths = b
        m = sides[side]
        t0 = time.perf_counter()
        tokens = mods[side].Tokens.from_lengths(lengths, mask, ids.device)
        with autocast():
            if head == "classifier":
                loss = torch.nn.functional.cross_entropy(m(ids, tokens, types).float(), torch.zeros(B, dtype=torch.long))
            else:
                start, end = m(ids, tokens, types)
                target = torch.zeros(B, dtype=torch.long)
                loss = (torch.nn.functional.cross_entropy(start.float(), target)
                        + torch.nn.functional.cross_entropy(end.float(), target + 1))
        loss.backward()
        opts[side].step()
        opts[side].zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    batches = [batch() for _ in range(steps + 3)]
    for b in batches[:3]:  # warm-up, both
        step(b, "current"), step(b, "earlier")
    t = {"current": [], "earlier": []}
    for i, b in enumerate(batches[3:]):
        for side in (("current", "earlier") if i % 2 else ("earlier", "current")):
            t[side].append(step(b, side))
    ratios = [e / c for e, c in zip(t["earlier"], t["current"])]
    return {"workload": workload, "head": head, "batch_size": B, "first_lengths": [lo, hi], "spread": spread,
            "steps": steps, "current_step_s": statistics.median(t["current"]),
            "earlier_step_s": statistics.median(t["earlier"]), "speedup_median": statistics.median(ratios),
            "threads": threads}


def render_readme(out: Path) -> str:
    doc = json.loads((out / "bench_model_ab.json").read_text())
    lines = _small_bench.readme_head("bench_model_ab", "The model file against an earlier commit's", (
             f"Current: commit {doc['current']}; earlier: {doc['rev']} (commit {doc['earlier']}). minilm-l6 shape, "
             f"random weights (the same on both), dropout, {doc.get('precision', 'fp32')}, fused AdamW; every batch "
             "trains both models, "
             "alternating; speed-up = median over batches of earlier / current step time."), doc) + [
             "| workload | head | batch | lengths | current step (ms) | earlier step (ms) | speed-up |",
             "|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lo, hi = r["first_lengths"]
        lines.append(f"| {r['workload']} | {r['head']} | {r['batch_size']} | {lo}-{hi - 1 + r['spread']} | "
                     f"{1e3 * r['current_step_s']:.1f} | {1e3 * r['earlier_step_s']:.1f} | **{r['speedup_median']:.3f}x** |")
    return "\n".join(lines) + "\n"


def git_commit(rev: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short=7", rev], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = _small_bench.parser(__doc__, "model_ab", steps=30)
    p.add_argument("--rev", help="the earlier commit (any git revision)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="(default: %(default)s)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: every step under CPU bf16 autocast (default: %(default)s)")
    a = p.parse_args(argv)
    out = Path(a.out)
    if not a.render:
        if not a.rev:
            p.error("--rev is required unless --render")
        alloc = _small_bench.setup(a.threads)
        with tempfile.TemporaryDirectory() as tmp:
            earlier = load_model_file(a.rev, Path(tmp))
            cast = functools.partial(policies.autocast, a.precision, torch.device("cpu"))
            rows = [measure(earlier, w, a.steps, a.threads, autocast=cast) for w in a.workloads.split(",")]
        dirty = subprocess.run(["git", "status", "--porcelain", "BERT/hpcbert/model.py"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        _small_bench.write(out, "bench_model_ab", argv, a.threads, rows, rev=a.rev, earlier=git_commit(a.rev),
                           current=git_commit("HEAD") + (" + uncommitted model.py" if dirty else ""),
                           precision=a.precision, host_allocator=alloc)
    _small_bench.write_readme(out, render_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
