#!/usr/bin/env python
"""Attention kernels on one BERT batch, forward and backward, on a GPU: the path hpcbert trains with
(`model.attention`: FlashAttention-2 over the unpadded rows, `model._FlashVarlen`) against PyTorch's
SDPA backends on the padded layout (`model.padded_attention` under `sdpa_kernel`: memory-efficient,
cuDNN, math) and, without dropout, `torch.nn.attention.varlen.varlen_attn`. In one process, the
variants in rotating order each round, CUDA events around forward + backward; the ratio is each
variant's median time over the training path's. One variant is the training path's kernel on copies
of Q, K and V, as the training path ran it up to 0071d95: since then it takes them as views of the
fused rows, which on an H100 took 0.79-0.85x the copies' time with the same output and gradients.
Attention took 21% of a compiled bert-base step's device time at batch 256 on an H200
(flash backward alone 17%) for about 2% of its FLOPs (results/gpu/profile.json): this says whether
another kernel would take less.

    python benchmarks/gpu_attention.py                      # bert-base heads, batch 256, lengths 8-128
    python benchmarks/gpu_attention.py --out results/gpu/attention.json

On a machine without CUDA it runs the math backend against itself on a tiny batch, a check that the
script runs, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "BERT"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _small_bench  # noqa: E402
from hpcbert import model as M  # noqa: E402
from hpcbert.model import Tokens  # noqa: E402


def variants(cuda: bool, p: float) -> dict:
    """name -> fn(qkv, tokens, heads, p) -> (n, H)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def padded(backend):
        def run(qkv, tokens, heads, p):
            with sdpa_kernel(backend):
                return M.padded_attention(qkv, tokens, heads, p).reshape(qkv.shape[0], -1)
        return run

    if not cuda:
        return {"math (padded)": padded(SDPBackend.MATH), "math again (padded)": padded(SDPBackend.MATH)}
    def copies(qkv, tokens, heads, p):
        # the training path's kernel on contiguous copies of Q, K and V (model.attention up to 0071d95;
        # since, views of the fused rows, row stride 3H): what the copies cost
        n, H = qkv.shape[0], qkv.shape[1] // 3
        q, k, v = (t.contiguous() for t in qkv.view(n, 3, heads, H // heads).unbind(1))
        return M._FlashVarlen.apply(q, k, v, tokens.cu_seqlens, tokens.max_len, p).reshape(n, H)

    out = {"flash varlen (hpcbert)": lambda qkv, tokens, heads, p: M.attention(qkv, tokens, heads, p),
           "flash varlen, Q/K/V copies": copies,
           "efficient (padded)": padded(SDPBackend.EFFICIENT_ATTENTION),
           "cudnn (padded)": padded(SDPBackend.CUDNN_ATTENTION),
           "math (padded)": padded(SDPBackend.MATH)}
    if p == 0.0:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            varlen_attn = None
        if varlen_attn is not None:
            def varlen(qkv, tokens, heads, p):
                n, H = qkv.shape[0], qkv.shape[1] // 3
                q, k, v = (t.contiguous() for t in qkv.view(n, 3, heads, H // heads).unbind(1))
                return varlen_attn(q, k, v, tokens.cu_seqlens, tokens.cu_seqlens, tokens.T, tokens.T).reshape(n, H)
            out["varlen_attn (torch)"] = varlen
    return out


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of at least 1")
    return int(text)


def dropouts(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0.0 <= v < 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated probabilities in [0, 1), e.g. 0.1,0.0")
    return values


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=positive, default=256)
    ap.add_argument("--heads", type=positive, default=12)
    ap.add_argument("--head-dim", type=positive, default=64)
    ap.add_argument("--min-len", type=positive, default=8)
    ap.add_argument("--max-len", type=positive, default=128)
    ap.add_argument("--dropouts", type=dropouts, default="0.1,0.0", help="attention dropout values, each a table")
    ap.add_argument("--rounds", type=positive, default=20)
    ap.add_argument("--out", default=None, help="JSON file for the figures")
    a = ap.parse_args(argv)
    if a.min_len > a.max_len:
        ap.error(f"--min-len {a.min_len} is above --max-len {a.max_len}")
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if not cuda:  # a check that the script runs
        a.batch, a.heads, a.head_dim, a.max_len, a.rounds = 4, 2, 16, 24, 2
    dtype = torch.bfloat16 if cuda else torch.float32
    rng = np.random.default_rng(0)
    lengths = np.sort(rng.integers(a.min_len, a.max_len + 1, a.batch))[::-1]  # collate's order: longest first
    T = int(lengths.max())
    mask = torch.from_numpy(np.arange(T)[None] < lengths[:, None]).to(dev)
    tokens = Tokens.from_lengths(lengths, mask, dev)
    n, H = int(lengths.sum()), a.heads * a.head_dim
    qkv0 = torch.randn(n, 3 * H, device=dev, dtype=dtype, generator=torch.Generator(dev).manual_seed(0))
    grad = torch.randn(n, H, device=dev, dtype=dtype, generator=torch.Generator(dev).manual_seed(1))

    def once(fn, p):
        qkv = qkv0.detach().requires_grad_()
        out = fn(qkv, tokens, a.heads, p)
        out.backward(grad)
        return out.detach(), qkv.grad

    def timed(fn, p) -> float:
        if not cuda:
            t0 = time.perf_counter()
            once(fn, p)
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        once(fn, p)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    doc = {"command": "python benchmarks/gpu_attention.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "commit": _small_bench.commit() or None,
           "device": torch.cuda.get_device_name() if cuda else "cpu (a check that it runs, not a measurement)",
           "batch": a.batch, "heads": a.heads, "head_dim": a.head_dim, "lengths": [a.min_len, a.max_len],
           "real_tokens": n, "padded_tokens": a.batch * T, "dtype": str(dtype).removeprefix("torch."), "tables": []}
    if hasattr(torch.nn.attention, "list_flash_attention_impls"):
        doc["flash_impls"] = list(torch.nn.attention.list_flash_attention_impls())
    for p in a.dropouts:
        vs = variants(cuda, p)
        ref_name = next(iter(vs))
        usable, errors, diffs = {}, {}, {}
        ref_out, ref_grad = once(vs[ref_name], 0.0)
        for name, fn in vs.items():
            try:
                for _ in range(3):  # warm-up: kernel choice, lazy loading
                    once(fn, p)
                out, g = once(fn, 0.0)  # without dropout every variant computes the same function
                diffs[name] = max(float((out - ref_out).abs().max()), float((g - ref_grad).abs().max()))
                usable[name] = fn
            except Exception as e:  # noqa: BLE001 - a backend that refuses these inputs is a finding
                errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        times = {name: [] for name in usable}
        names = list(usable)
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(timed(usable[name], p))
        ref = statistics.median(times[ref_name]) if ref_name in times else None
        rows = [{"variant": k, "median_ms": 1e3 * statistics.median(v),
                 "ratio_to_training_path": statistics.median(v) / ref if ref else None,
                 "max_abs_diff_without_dropout": diffs[k]} for k, v in times.items()]
        doc["tables"].append({"dropout": p, "rows": rows, "refused": errors})
        print(f"\ndropout {p}: forward + backward, median of {a.rounds} rounds ({doc['device']}, {n} real of "
              f"{a.batch * T} padded tokens)")
        for row in rows:
            ratio = row["ratio_to_training_path"]
            print(f"  {row['variant']:24s} {row['median_ms']:8.3f} ms  {ratio:5.2f}x  "
                  f"(max |diff| at p=0: {row['max_abs_diff_without_dropout']:.2e})")
        for name, err in errors.items():
            print(f"  {name:24s} refused: {err}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
