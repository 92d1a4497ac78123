"""What computing the last layer at the head's rows only buys: a classifier's training step with
the last layer on [CLS] alone (the model as it trains) against the same model computing the last
layer at every token (the encoder before 1b183fc), on the same batches.

    python benchmarks/bench_head_rows.py [--model minilm-l6] [--lengths 14,50] [--steps 36] [--out results/head_rows]
    python benchmarks/bench_head_rows.py --render      # README.md again from the JSON, nothing measured

One process, one model of the named shape (random weights, hpcbert.zoo), dropout on, fp32, AdamW
(fused), batch 32. For each mean length s the batches hold lengths s-1..s+1, sorted longest first
(what the length-grouped sampler gives). Each batch runs a whole training step (forward, backward,
optimizer) both ways, in alternating order (so machine noise hits both alike); the figure is the
median over batches of every-row / head-rows step time within a batch, beside each side's median
step. Torch threads: CPU cores unless --threads says otherwise.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "BERT"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import _small_bench  # noqa: E402
from hpcbert import zoo  # noqa: E402
from hpcbert.model import BertConfig, BertForSequenceClassification, Tokens  # noqa: E402

BATCH = 32


def measure(model_name: str, mean_len: int, steps: int, threads: int) -> dict:
    torch.manual_seed(0)
    src = zoo.resolve(model_name)
    m = BertForSequenceClassification(BertConfig(**{**src.config.to_dict(), "num_labels": 2})).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True)
    rng = np.random.default_rng(mean_len)

    def batch():
        lengths = np.sort(rng.integers(mean_len - 1, mean_len + 2, BATCH))[::-1].copy()
        T = int(lengths.max())
        mask = torch.arange(T)[None] < torch.from_numpy(lengths)[:, None]
        ids = torch.randint(1000, 20000, (BATCH, T)) * mask
        return ids, mask, torch.zeros_like(ids), torch.randint(0, 2, (BATCH,)), lengths

    def step(b, head_rows: bool) -> float:
        ids, mask, types, labels, lengths = b
        t0 = time.perf_counter()
        tokens = Tokens.from_lengths(lengths, mask, ids.device)
        if head_rows:
            logits = m(ids, tokens, types)
        else:  # the full encoder: every row of the last layer, then [CLS] for the pooler
            logits = m.classifier(m.dropout(m.bert(ids, tokens, types)[1]))
        m.loss_sum(logits, labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    batches = [batch() for _ in range(steps + 4)]
    for b in batches[:4]:  # warm-up, both ways
        step(b, True), step(b, False)
    t = {True: [], False: []}
    for i, b in enumerate(batches[4:]):
        for way in ((True, False) if i % 2 else (False, True)):
            t[way].append(step(b, way))
    ratios = [f / h for f, h in zip(t[False], t[True])]
    return {"model": model_name, "mean_length": mean_len, "batch_size": BATCH, "steps": steps,
            "head_rows_step_s": statistics.median(t[True]), "every_row_step_s": statistics.median(t[False]),
            "speedup_median": statistics.median(ratios), "threads": threads}


def render_readme(out: Path) -> str:
    doc = json.loads((out / "bench_head_rows.json").read_text())
    lines = _small_bench.readme_head("bench_head_rows", "The last layer at the head's rows only", (
             "A classifier's training step (minilm-l6 shape unless named, random weights, dropout, fp32, fused AdamW, "
             f"batch {BATCH}, lengths mean-1..mean+1) with the last layer's output projection and feed-forward on "
             "[CLS] alone, against the same model computing them at every token; both ways on every batch, "
             "alternating; speed-up = median over batches of every-row / head-rows step time."), doc) + [
             "| model | mean length | head rows step (ms) | every row step (ms) | speed-up |", "|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['model']} | {r['mean_length']} | {1e3 * r['head_rows_step_s']:.1f} | "
                     f"{1e3 * r['every_row_step_s']:.1f} | **{r['speedup_median']:.3f}x** |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = _small_bench.parser(__doc__, "head_rows", steps=36)
    p.add_argument("--model", default="minilm-l6")
    p.add_argument("--lengths", default="14,50", help="mean lengths (default: %(default)s: SST-2's and MRPC's)")
    a = p.parse_args(argv)
    out = Path(a.out)
    if not a.render:
        alloc = _small_bench.setup(a.threads)
        rows = [measure(a.model, int(s), a.steps, a.threads) for s in a.lengths.split(",")]
        _small_bench.write(out, "bench_head_rows", argv, a.threads, rows, host_allocator=alloc)
    _small_bench.write_readme(out, render_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
