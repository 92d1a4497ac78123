"""Filler rows (`--token-multiple`), measured: training steps with each padded batch's real-token
rows rounded up to a multiple of N, against the same steps without, on the same batches in one
process.

    python benchmarks/bench_token_multiple.py [--multiples 1,64] [--steps 40] [--out results/token_multiple]
    python benchmarks/bench_token_multiple.py --render    # README.md again from the JSON, nothing measured

One model (random weights of `--model`'s shape; on CUDA bert-base, on CPU minilm-l6 by default),
dropout on, under bf16 autocast (`--precision`), fused AdamW. Each batch holds sequences of lengths
drawn uniformly from 8 to 128 (hpcbert's synthetic task), so its real-token count, the row count
of every token-wise matmul, is new at nearly every step. Every batch trains once per multiple, the
order rotating from batch to batch, so machine noise hits each alike; a step is timed from its
batch's copy to the device (`Batch.to`, as the training loop does it) to the optimizer step, the
device synchronised at both ends. The figure: the median over batches of the step time without
filler (the first multiple) over the step time with each other multiple, within a batch.

Why: on CUDA a matmul at a new row count costs host time a call and can wait for cuBLAS to load a
kernel (`gpu.py hostcost`); with filler the row counts repeat. On CPU the filler rows are work with
nothing to win back, which this measures too.
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
from hpcbert import model as M, policies, zoo  # noqa: E402
from hpcbert.data.features import Batch  # noqa: E402

LENGTHS = (8, 128)  # hpcbert's synthetic task: each sequence's length uniform in this range


def batches(n: int, B: int, vocab: int, lengths_range: tuple[int, int] = LENGTHS, seed: int = 0) -> list[Batch]:
    """`n` host batches of B sequences, lengths uniform in `lengths_range`, longest first (collate's order)."""
    rng = np.random.default_rng(seed)
    out = []
    lo, hi = lengths_range
    for _ in range(n):
        lengths = np.sort(rng.integers(lo, hi + 1, B))[::-1].copy()
        T = int(lengths.max())
        mask = torch.arange(T)[None] < torch.from_numpy(lengths)[:, None]
        ids = torch.from_numpy(rng.integers(1000, vocab, (B, T))) * mask
        labels = torch.from_numpy(rng.integers(0, 2, B))
        out.append(Batch(ids, torch.zeros_like(ids), mask, labels, int(lengths.sum()), lengths))
    return out


def measure(model_name: str, B: int, multiples: list[int], steps: int, device: torch.device,
            precision: str, lengths_range: tuple[int, int] = LENGTHS, warmup: int = 5) -> dict:
    torch.manual_seed(0)
    cfg = {**zoo.resolve(model_name).config.to_dict(), "num_labels": 2}
    model = M.BertForSequenceClassification(M.BertConfig(**cfg)).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows: dict[int, list[int]] = {m: [] for m in multiples}

    def step(b: Batch, multiple: int) -> float:
        sync()
        t0 = time.perf_counter()
        d = b.to(device, multiple)
        with policies.autocast(precision, device):  # fp32: no autocast
            logits = model(d.input_ids, d.padding, d.token_type_ids)
            loss = torch.nn.functional.cross_entropy(logits.float(), d.labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        rows[multiple].append(d.tokens.index.shape[0] if d.tokens.index is not None else b.real_tokens)
        return time.perf_counter() - t0

    data = batches(warmup + steps, B, cfg["vocab_size"], lengths_range)
    for b in data[:warmup]:  # warm-up, every side: the first steps load kernels, build caches
        for m in multiples:
            step(b, m)
    t: dict[int, list[float]] = {m: [] for m in multiples}
    for i, b in enumerate(data[warmup:]):
        k = i % len(multiples)
        for m in multiples[k:] + multiples[:k]:
            t[m].append(step(b, m))
    base = multiples[0]
    real = [b.real_tokens for b in data[warmup:]]
    return {"model": model_name, "batch_size": B, "lengths": list(lengths_range), "steps": steps, "warmup": warmup,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "precision": precision, "real_tokens_per_batch_median": statistics.median(real),
            "distinct_real_token_counts": len(set(real)),
            "sides": [{"token_multiple": m, "step_s_median": statistics.median(t[m]),
                       "rows_per_batch_median": statistics.median(rows[m][warmup:]),
                       "distinct_row_counts": len(set(rows[m][warmup:])),
                       "speedup_median": statistics.median(a / c for a, c in zip(t[base], t[m]))}
                      for m in multiples]}


def render_readme(out: Path) -> str:
    lines = ["# Filler rows (`--token-multiple`) against none", "",
             "Generated by `python benchmarks/bench_token_multiple.py --render` from the JSON files here.", "",
             "Every batch (lengths uniform in a range: 8-128 is hpcbert's synthetic task; a classifier, dropout on, "
             "fused AdamW) "
             "trains once per multiple in rotating order, in one process, the device synchronised around each "
             "step; speed-up = median over batches of the step time without filler over the step time with it.", ""]
    for f in sorted(out.glob("bench_token_multiple*.json")):
        doc = json.loads(f.read_text())
        for r in doc["rows"]:
            lo, hi = r["lengths"]
            lines += [f"## {r['model']}, batch {r['batch_size']}, lengths {lo}-{hi}, {r['precision']}, {r['device']}", "",
                      f"{r['steps']} batches after {r['warmup']} of warm-up; {r['distinct_real_token_counts']} "
                      f"distinct real-token counts among them (median {r['real_tokens_per_batch_median']:.0f}). "
                      f"Measured {doc['date']} on {doc['machine']}, commit {doc['commit']}; command: "
                      f"`{doc['command']}`", "",
                      "| --token-multiple | rows a batch (median) | distinct row counts | step (ms, median) | speed-up |",
                      "|---|---|---|---|---|"]
            lines += [f"| {s['token_multiple']} | {s['rows_per_batch_median']:.0f} | {s['distinct_row_counts']} | "
                      f"{1e3 * s['step_s_median']:.1f} | **{s['speedup_median']:.3f}x** |" for s in r["sides"]]
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = _small_bench.parser(__doc__, "token_multiple", steps=40)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--model", default=None, help="a model name (default: bert-base on CUDA, minilm-l6 on CPU)")
    p.add_argument("--batch-size", type=int, default=None, help="(default: 256 on CUDA, 32 on CPU)")
    p.add_argument("--multiples", default="1,64", help="comma-separated, the first the reference (default: %(default)s)")
    p.add_argument("--lengths", default="8-128", help="LO-HI[,LO-HI...]: each sequence's length uniform in it, a row "
                   "of the table per range (default: %(default)s)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    a = p.parse_args(argv)
    out = Path(a.out)
    if not a.render:
        cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
        device = torch.device("cuda" if cuda else "cpu")
        multiples = [int(m) for m in a.multiples.split(",")]
        if len(multiples) < 2 or min(multiples) < 1:
            p.error(f"--multiples {a.multiples}: two or more positive numbers, the first the reference")
        try:
            ranges = [tuple(int(x) for x in r.split("-")) for r in a.lengths.split(",")]
            assert all(len(r) == 2 and 1 <= r[0] <= r[1] for r in ranges)
        except (ValueError, AssertionError):
            p.error(f"--lengths {a.lengths}: ranges LO-HI, comma-separated, 1 <= LO <= HI")
        alloc = _small_bench.setup(a.threads)
        rows = [measure(a.model or ("bert-base" if cuda else "minilm-l6"), a.batch_size or (256 if cuda else 32),
                        multiples, a.steps, device, a.precision, r) for r in ranges]
        _small_bench.write(out, "bench_token_multiple", argv, a.threads, rows, commit=_small_bench.commit(),
                           host_allocator=alloc)
        for row in rows:
            for s in row["sides"]:
                print(f"lengths {row['lengths']}, token multiple {s['token_multiple']}: "
                      f"{1e3 * s['step_s_median']:.1f} ms a step, {s['speedup_median']:.3f}x")
    _small_bench.write_readme(out, render_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
