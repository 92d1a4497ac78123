"""The masked-LM loss, measured against torch's: hpcbert's CrossEntropySum (objectives/mlm.py)
against F.cross_entropy(logits.float(), labels, reduction="sum"), the loss it replaced and what
a transformers user computes, in one process on the same batches.

    python benchmarks/bench_mlm_loss.py [--model minilm-l6] [--steps 30] [--device cpu] [--out results/mlm_loss]
    python benchmarks/bench_mlm_loss.py --render      # README.md again from the JSON, nothing measured

One model (the named shape from hpcbert.zoo, random weights, dropout on) trains masked-LM batches of
full sequences (--batch x --length, 15% of the positions masked, as the objective's memory probes
mask them) under --precision autocast with fused AdamW, the host allocator set as hpcbert train
sets it (dist.tune_host_allocator: freed memory kept, not unmapped); each batch runs a whole training step
(forward, the loss, backward, optimizer) once with each loss, in alternating order, so machine
noise hits both alike. Figures: the median over batches of torch / hpcbert step time within a
batch; the same for the loss alone (its forward and backward on the step's logits); and the bytes
each loss keeps for backward (saved-tensor hooks, each storage once), which add to a step's peak.
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

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import _small_bench  # noqa: E402
from hpcbert import objectives, policies, zoo  # noqa: E402
from hpcbert.config import RunConfig  # noqa: E402
from hpcbert.model import BertConfig  # noqa: E402
from hpcbert.objectives.mlm import CrossEntropySum  # noqa: E402

LOSSES = {"torch": lambda logits, labels: F.cross_entropy(logits.float(), labels, reduction="sum"),
          "hpcbert": CrossEntropySum.apply}


def saved_bytes(loss_fn, logits: torch.Tensor, labels: torch.Tensor) -> int:
    """Bytes of the storages `loss_fn` keeps for its backward, each once (the logits' own too, where
    it keeps them: nothing else in a step keeps a projection's output)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(logits.detach().requires_grad_(), labels)
    return sum(seen.values())


def measure(model: str, batch: int, length: int, steps: int, precision: str, device: torch.device) -> dict:
    torch.manual_seed(0)
    cfg = RunConfig(task="mlm", data_dir="unread", model=model, max_seq_length=length, precision=precision)
    obj = objectives.get(cfg)
    m = obj.build_model(BertConfig(**zoo.resolve(model).config.to_dict())).to(device).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(b, side: str) -> tuple[float, float]:
        """(the whole step's seconds, the loss's: its forward and its backward to the logits)"""
        sync()
        t0 = time.perf_counter()
        with policies.autocast(precision, device):
            logits = obj.forward(m, b)
        labels = b.labels["mlm_labels"]
        sync()
        t1 = time.perf_counter()
        grad, = torch.autograd.grad(LOSSES[side](logits, labels) / len(labels), logits)
        sync()
        t2 = time.perf_counter()
        logits.backward(grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t0, t2 - t1

    batches = [obj.example_batch(batch, length, m.config.vocab_size)[0].to(device) for _ in range(steps + 3)]
    for b in batches[:3]:  # warm-up, both
        step(b, "torch"), step(b, "hpcbert")
    t: dict[str, list[tuple[float, float]]] = {"torch": [], "hpcbert": []}
    for i, b in enumerate(batches[3:]):
        for side in (("torch", "hpcbert") if i % 2 else ("hpcbert", "torch")):
            t[side].append(step(b, side))
    with policies.autocast(precision, device):
        logits = obj.forward(m, batches[0]).detach()
    labels = batches[0].labels["mlm_labels"]
    row = {"model": model, "batch": batch, "length": length, "masked_rows": len(labels), "vocab": m.config.vocab_size,
           "logits_dtype": str(logits.dtype).removeprefix("torch."), "steps": steps}
    for k, part in (("step", 0), ("loss", 1)):
        for side in LOSSES:
            row[f"{side}_{k}_s"] = statistics.median(x[part] for x in t[side])
        row[f"{k}_speedup_median"] = statistics.median(a[part] / b[part] for a, b in zip(t["torch"], t["hpcbert"]))
    for side, fn in LOSSES.items():
        row[f"{side}_saved_bytes"] = saved_bytes(fn, logits, labels)
    return row


def render_readme(out: Path) -> str:
    doc = json.loads((out / "bench_mlm_loss.json").read_text())
    lines = ["# The masked-LM loss against torch's", "",
             "Generated by `python benchmarks/bench_mlm_loss.py --render` from `bench_mlm_loss.json`.", "",
             f"hpcbert's `CrossEntropySum` (commit {doc['commit']}) against `F.cross_entropy(logits.float(), labels, "
             f"reduction=\"sum\")` on the same batches, one model trained with both alternately ({doc['precision']} "
             f"autocast, {doc['device']}); speed-up = median over batches of torch / hpcbert time within a batch: "
             "the whole training step, and the loss alone (its forward and its backward to the logits). Kept: "
             "the bytes the loss keeps for backward. The host allocator is set as `hpcbert train` sets it.", "",
             f"Measured {doc['date']} on {doc['machine']}; command: `{doc['command'].strip()}`", "",
             "| model | batch x length | masked rows x vocabulary | step ms, torch / hpcbert | step speed-up "
             "| loss ms, torch / hpcbert | loss speed-up | kept MiB, torch / hpcbert |",
             "|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['model']} | {r['batch']} x {r['length']} | {r['masked_rows']} x {r['vocab']} | "
                     f"{1e3 * r['torch_step_s']:.1f} / {1e3 * r['hpcbert_step_s']:.1f} | **{r['step_speedup_median']:.3f}x** | "
                     f"{1e3 * r['torch_loss_s']:.1f} / {1e3 * r['hpcbert_loss_s']:.1f} | **{r['loss_speedup_median']:.2f}x** | "
                     f"{r['torch_saved_bytes'] / 2**20:.1f} / {r['hpcbert_saved_bytes'] / 2**20:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = _small_bench.parser(__doc__, "mlm_loss", steps=20)
    p.add_argument("--models", default="minilm-l6,bert-base", help="(default: %(default)s)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    out = Path(a.out)
    if not a.render:
        device = torch.device(a.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            print("benchmarks/bench_mlm_loss.py: needs a CUDA device (--device cuda)", file=sys.stderr)
            return 2
        alloc = _small_bench.setup(a.threads)  # the host allocator as hpcbert train sets it (results/step_overhead/)
        rows = [measure(model, a.batch, a.length, a.steps, a.precision, device) for model in a.models.split(",")]
        _small_bench.write(out, "bench_mlm_loss", argv, a.threads, rows, commit=_small_bench.commit(),
                           precision=a.precision, device=torch.cuda.get_device_name(device) if device.type == "cuda"
                           else "cpu", host_allocator=alloc)
    _small_bench.write_readme(out, render_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
