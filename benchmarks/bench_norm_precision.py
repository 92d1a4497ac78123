"""LayerNorm precision under bf16 autocast, measured: `--norm-precision low` (the LayerNorms and the
residual stream in bf16, the default) against `fp32` (autocast's own rule, as Hugging Face's BERT
runs), the same model file, the same batches, in one process.

    python benchmarks/bench_norm_precision.py [--steps 30]
    python benchmarks/bench_norm_precision.py --render      # README.md again from the JSON

The workloads, batches and step are bench_model_ab.py's (SST-2 and MRPC lengths with a classifier,
SQuAD windows with a span head; minilm-l6 shape, random weights, the same on both sides; dropout
on; fused AdamW), under bf16 autocast: every batch trains both models in alternating order, and
the speed-up is the median over batches of the fp32-LayerNorm step time over the low one. Bytes:
the activations each side keeps for backward per sequence at the workload's longest length
(hpcbert.meters.activation_bytes_per_sequence, as a run's summary counts them).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "BERT"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import _small_bench  # noqa: E402
import bench_model_ab as AB  # noqa: E402
from hpcbert import meters, model as M, policies  # noqa: E402

CPU = torch.device("cpu")


def autocast():
    return policies.autocast("bf16", CPU)


def bytes_per_sequence(m, head: str, T: int) -> int:
    def loss_of(b: int) -> torch.Tensor:
        ids = torch.randint(1000, 20000, (b, T))
        with autocast():
            out = m(ids, None, torch.zeros_like(ids))
        return sum(o.float().sum() for o in (out if head == "span" else (out,)))
    return meters.activation_bytes_per_sequence(m, loss_of, CPU)


def measure(workload: str, steps: int, threads: int) -> dict:
    head, _, (_, hi), spread = AB.WORKLOADS[workload]
    sides = {}
    for side, norms in (("current", "low"), ("earlier", "fp32")):
        m = AB.build(M, head)
        policies.norm_precision(m, norms)
        sides[side] = (M, m)
    row = AB.measure(None, workload, steps, threads, sides=sides, autocast=autocast)
    T = hi - 1 + spread
    row.update(low_step_s=row.pop("current_step_s"), fp32_step_s=row.pop("earlier_step_s"), bytes_length=T,
               low_bytes=bytes_per_sequence(sides["current"][1], head, T),
               fp32_bytes=bytes_per_sequence(sides["earlier"][1], head, T))
    return row


def render_readme(out: Path) -> str:
    import json

    doc = json.loads((out / "bench_norm_precision.json").read_text())
    lines = _small_bench.readme_head("bench_norm_precision", "LayerNorm precision under bf16: low against fp32", (
             f"Commit {doc['commit']}. minilm-l6 shape, random weights (the same on both sides), dropout, bf16 "
             "autocast, fused AdamW; every batch trains both models, alternating; speed-up = median over batches "
             "of the fp32-LayerNorm step time / the low one's. Bytes: activations kept for backward per "
             "sequence at the longest length of the workload."), doc) + [
             "| workload | head | batch | lengths | low step (ms) | fp32 step (ms) | speed-up | low MiB/seq | "
             "fp32 MiB/seq | bytes, low / fp32 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lo, hi = r["first_lengths"]
        lines.append(f"| {r['workload']} | {r['head']} | {r['batch_size']} | {lo}-{hi - 1 + r['spread']} | "
                     f"{1e3 * r['low_step_s']:.1f} | {1e3 * r['fp32_step_s']:.1f} | **{r['speedup_median']:.3f}x** | "
                     f"{r['low_bytes'] / 2**20:.2f} | {r['fp32_bytes'] / 2**20:.2f} | "
                     f"**{r['low_bytes'] / r['fp32_bytes']:.2f}x** |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = _small_bench.parser(__doc__, "norm_precision", steps=30)
    p.add_argument("--workloads", default=",".join(AB.WORKLOADS), help="(default: %(default)s)")
    a = p.parse_args(argv)
    out = Path(a.out)
    if not a.render:
        alloc = _small_bench.setup(a.threads)
        rows = [measure(w, a.steps, a.threads) for w in a.workloads.split(",")]
        for r in rows:
            print(f"{r['workload']}: speed-up {r['speedup_median']:.3f}x, bytes {r['low_bytes'] / r['fp32_bytes']:.2f}x",
                  file=sys.stderr)
        _small_bench.write(out, "bench_norm_precision", argv, a.threads, rows, commit=AB.git_commit("HEAD"),
                           host_allocator=alloc)
    _small_bench.write_readme(out, render_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
