#!/usr/bin/env python
"""hpcbert vs the Hugging Face Trainer on ChnSentiCorp with the Chinese BERT vocabulary.

A measurement, not a test. Every figure comes from runs this script starts; results/chinese/README.md
is generated from the JSON files (`render`), never typed.

    python benchmarks/compare_hf_chinese.py accuracy --side hpcbert --seed 1   one accuracy run (in segments)
    python benchmarks/compare_hf_chinese.py throughput --pair dynamic --repeat 1   one repeat of one pair
    python benchmarks/compare_hf_chinese.py render                              results/chinese/README.md

Data: ChnSentiCorp as in ../shared/data/chinese/chnsenticorp (train.tsv: label, text_a; dev.tsv: qid,
label, text_a), tokenised with the bert-base-chinese vocabulary (../shared/data/chinese/bert-base-chinese:
21,128 entries, cased, every CJK character its own token). No Chinese weights are available here, so
every model is trained from random weights on both sides:

- accuracy: bert-mini (Turc et al. 2019: 4 layers, 256 wide, 4 heads, FFN 1024; word embeddings for the
  21,128-entry vocabulary), max length 128, batch 32, lr 3e-4, 2 epochs, seeds 1, 2, 3; dev accuracy.
- throughput: the bert-base shape (bert-base-chinese's config.json: 12 layers, 768 wide), random
  weights, max length 128, batch 8, training sequences/s.

Both sides, always: AdamW (betas 0.9/0.999, eps 1e-8; PyTorch's fused kernel on both sides: the
Trainer's default `adamw_torch_fused`), weight decay 0.01 (not on biases and LayerNorm weights), linear
warm-up over round(0.1 x steps) steps then linear decay to 0, max grad norm 1.0, dropout 0.1, fp32 (the
CPU it was written on has no native bf16, where emulated bf16 is ~100x slower), 2 threads. hpcbert:
`hpcbert train --task classify` with its defaults (dynamic padding, length-grouped sampler). The
Trainer: transformers' text-classification example (run_classification.py) re-implemented in the
hidden `_hf-worker` command: `tokenizer(text, padding=..., max_length=128, truncation=True)`,
`AutoModelForSequenceClassification.from_config` (random init, seeded with `transformers.set_seed`),
`Trainer.train()`, accuracy from `Trainer.predict` on the dev file. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_hf as C  # noqa: E402  (shared: runs, noise, machine info, JSON I/O, the Trainer, pair tables)

ROOT = C.ROOT
CHINESE = ROOT.parent / "shared" / "data" / "chinese"
DATA = CHINESE / "chnsenticorp"
VOCAB = CHINESE / "bert-base-chinese"
DEFAULT_RESULTS = ROOT / "results" / "chinese"
DEFAULT_WORK = ROOT / "runs" / "compare_hf_chinese"
SEQ_LEN, THREADS = 128, 2
# the Trainer's settings shared with compare_hf.py (C.train_resumable uses them)
EVAL_BATCH, WEIGHT_DECAY, WARMUP_RATIO, MAX_GRAD_NORM = C.EVAL_BATCH, C.WEIGHT_DECAY, C.WARMUP_RATIO, C.MAX_GRAD_NORM
PRECISION = "fp32"
SEEDS = (1, 2, 3)
# accuracy: a small shape from scratch
ACC_MODEL, ACC_SHAPE = "bert-mini", (4, 256, 4, 1024)  # layers, hidden, heads, FFN (hpcbert.zoo.RANDOM_SHAPES)
ACC_BATCH, ACC_LR, ACC_EPOCHS = 32, 3e-4, 2.0
# throughput: the bert-base shape with random weights
TP_BATCH = 8
# Steps per run. The Trainer's group_by_length sorts each mega-batch of 50 batches longest first, so
# its first steps are its longest: a dynamic-padding run covers one whole mega-batch (50 steps) to
# time batches of representative lengths on both sides. Padded to 128, every step is the same work.
PAIR_STEPS = {"dynamic": 50, "max": 15}

# Throughput pairs, each run as one interleaved pair per call: (hpcbert label + options, Trainer label + options).
PAIRS = {
    "dynamic": (("hpcbert defaults: dynamic padding, length-grouped sampler", []),
                ("Trainer at its best: dynamic padding (DataCollatorWithPadding), train_sampling_strategy="
                 "group_by_length, adamw_torch_fused", dict(padding="dynamic", group_by_length=True))),
    "max": (("hpcbert --pad-to-max-length (every batch 8 x 128)", ["--pad-to-max-length"]),
            ("Trainer defaults: pad to 128 (run_classification.py pad_to_max_length=True), random sampler, "
             "adamw_torch_fused", dict(padding="max_length", group_by_length=False))),
}


def say(msg: str) -> None:
    print(f"[compare_hf_chinese {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def check_data() -> None:
    for p in (DATA / "train.tsv", DATA / "dev.tsv", VOCAB / "vocab.txt", VOCAB / "config.json"):
        if not p.is_file():
            sys.exit(f"compare_hf_chinese: {p} not found (ChnSentiCorp and bert-base-chinese live in "
                     f"{CHINESE}, beside the project)")


# ----------------------------------------------------------------------------------------------
# the Trainer side (subprocess: this script's hidden `_hf-worker` command)
# ----------------------------------------------------------------------------------------------

def hf_worker(argv: list[str]) -> int:
    """One Trainer run as run_classification.py does it, from random weights; writes one JSON."""
    p = argparse.ArgumentParser(prog="compare_hf_chinese.py _hf-worker")
    p.add_argument("--shape", choices=("mini", "base"), required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    C.add_trainer_worker_options(p, epochs=ACC_EPOCHS, warmup_excluded=3)
    a = p.parse_args(argv)
    t_process = time.perf_counter()

    import numpy as np
    import torch
    import transformers
    from transformers import (AutoModelForSequenceClassification, AutoTokenizer, BertConfig, DataCollatorWithPadding,
                              default_data_collator)

    from hpcbert.data.metrics import accuracy, f1_macro
    from hpcbert.data.own import read_classification

    torch.set_num_threads(THREADS)
    tok = AutoTokenizer.from_pretrained(str(VOCAB))
    train = read_classification(DATA / "train.tsv", "text_a", "label")
    dev = read_classification(DATA / "dev.tsv", "text_a", "label", labels=train.labels)
    pad = "max_length" if a.padding == "max_length" else False

    def to_dataset(examples):  # a list of feature dicts (what `datasets.map` would give the Trainer)
        enc = tok([e.text_a for e in examples], padding=pad, max_length=SEQ_LEN, truncation=True)
        keys = ("input_ids", "token_type_ids", "attention_mask")
        return [{**{k: enc[k][i] for k in keys}, "label": int(e.label)} for i, e in enumerate(examples)]

    train_ds, dev_ds = to_dataset(train.examples), to_dataset(dev.examples)
    collator = default_data_collator if pad else DataCollatorWithPadding(tok)

    cfg = BertConfig.from_pretrained(str(VOCAB), num_labels=len(train.labels))  # vocab 21128, bert-base shape
    if a.shape == "mini":
        L, H, A, I = ACC_SHAPE
        cfg.update(dict(num_hidden_layers=L, hidden_size=H, num_attention_heads=A, intermediate_size=I))
    transformers.set_seed(a.seed)  # the random weights are drawn from this seed
    model = AutoModelForSequenceClassification.from_config(cfg)
    total = a.max_steps or math.ceil(a.epochs * math.ceil(len(train_ds) / a.batch_size))
    args, trainer, timer, train_out, t_train, t_done = C.train_resumable(
        model, tok, train_ds, collator, scratch=a.scratch, batch=a.batch_size, lr=a.lr, epochs=a.epochs,
        max_steps=a.max_steps, total=total, seed=a.seed, group_by_length=a.group_by_length, threads=THREADS,
        deadline=a.deadline)
    if C.trainer_stopped_early(trainer, total, say):
        return 3

    result = C.trainer_result(
        a, args, model, trainer, timer, total, PRECISION, (train_out, t_process, t_train, t_done),
        vocab_size=model.config.vocab_size, num_layers=model.config.num_hidden_layers,
        hidden_size=model.config.hidden_size, train_examples=len(train_ds))
    if a.do_eval:
        pred = trainer.predict(dev_ds)
        preds = np.argmax(pred.predictions, axis=-1)
        labels = np.asarray([x["label"] for x in dev_ds])
        if pred.label_ids is not None and not np.array_equal(np.asarray(pred.label_ids), labels):
            raise SystemExit("compare_hf_chinese: Trainer.predict returned the dev examples in another order")
        result["eval"] = {"dev": {"accuracy": accuracy(preds, labels), "f1_macro": f1_macro(preds, labels),
                                  "loss": float(pred.metrics["test_loss"])}}
    C.write_json(Path(a.out), result)
    return 0


def hf_cmd(name: str, work: Path, out_json: Path, *, shape: str, padding: str, group_by_length: bool, seed: int,
           batch: int, lr: float, max_steps: int | None = None, do_eval: bool = False,
           warmup_excluded: int = 3) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "_hf-worker", "--shape", shape, "--out", str(out_json),
           "--scratch", str(work / "hf-scratch" / name), "--padding", padding, "--seed", str(seed),
           "--batch-size", str(batch), "--lr", str(lr), "--epochs", f"{ACC_EPOCHS:g}",
           "--warmup-steps-excluded", str(warmup_excluded)]
    return cmd + C.trainer_worker_flags(group_by_length=group_by_length, max_steps=max_steps, do_eval=do_eval)


# ----------------------------------------------------------------------------------------------
# the hpcbert side
# ----------------------------------------------------------------------------------------------

def hpcbert_args(model: str, batch: int, lr: float, seed: int, *, max_steps: int | None = None,
                 do_eval: bool = False, extra: list[str] | None = None) -> list[str]:
    a = ["--task", "classify", "--train-file", str(DATA / "train.tsv"), "--dev-file", str(DATA / "dev.tsv"),
         "--text-fields", "text_a", "--label-field", "label", "--model", model, "--tokenizer", str(VOCAB),
         "--max-seq-length", str(SEQ_LEN), "--batch-size", str(batch), "--lr", str(lr), "--optimizer", "adamw",
         "--weight-decay", str(WEIGHT_DECAY), "--warmup-ratio", str(WARMUP_RATIO), "--max-grad-norm",
         str(MAX_GRAD_NORM), "--precision", PRECISION, "--seed", str(seed), "--eval-batch-size", str(EVAL_BATCH),
         "--no-save-model"]
    a += ["--max-steps", str(max_steps)] if max_steps else ["--epochs", f"{ACC_EPOCHS:g}"]
    a += ["--do-eval" if do_eval else "--no-do-eval", *(extra or [])]
    return a


# ----------------------------------------------------------------------------------------------
# accuracy: one (side, seed) per call, in resumable segments
# ----------------------------------------------------------------------------------------------

def accuracy_segment(side: str, seed: int, work: Path, segment_s: float) -> dict | None:
    """One segment of the (side, seed) run (C.accuracy_segment_run: at most `segment_s` of training, then
    a checkpoint); the finished run's figures, or None while it is not finished."""
    name = f"acc-{side}-seed{seed}"
    out_json = work / "hf-json" / f"{name}.json"
    args = hpcbert_args(ACC_MODEL, ACC_BATCH, ACC_LR, seed, do_eval=True)

    def build_cmd(folder: Path, deadline: str) -> list[str]:
        if side == "hpcbert":
            return [sys.executable, "-m", "hpcbert.cli", "train", *args, "--threads", str(THREADS), "--out",
                    str(folder), "--resume", "auto", "--log-every", "50"]
        return hf_cmd(name, work, out_json, shape="mini", padding="dynamic", group_by_length=True, seed=seed,
                      batch=ACC_BATCH, lr=ACC_LR, do_eval=True) + ["--deadline", deadline]

    rc, segments, out = C.accuracy_segment_run(name, side, work, segment_s, THREADS, build_cmd, say)
    wall = sum(x["wall_s"] for x in segments)
    busy = sum(x["other_cores_during"] * x["wall_s"] for x in segments) / wall
    base = {"side": side, "seed": seed, "segments": len(segments), "wall_s": wall,
            "other_cores_during": busy}
    if side == "hpcbert":
        done = C.finished_hpcbert_accuracy_run(out, args, THREADS)
        if done is None:
            return None
        s, shared = done
        ev = s["eval"]["dev"]
        return {**base, "accuracy": ev["accuracy"], "f1_macro": ev["f1_macro"], "eval_loss": ev["loss"],
                "final_loss": s["final_loss"], "steps": s["steps"], **shared}
    if rc == 3:
        return None
    r = C.read_json(out_json)
    ev = r["eval"]["dev"]
    return {**base, "accuracy": ev["accuracy"], "f1_macro": ev["f1_macro"], "eval_loss": ev["loss"],
            "final_loss": r["final_loss"], "steps": r["total_steps"], "optim": r["optim"], "sampler": r["sampler"],
            "padding": r["padding"], "warmup_steps": r["warmup_steps"]}


def cmd_accuracy(a) -> int:
    work = Path(a.work_dir)
    return C.accuracy_calls(
        a, SEEDS, THREADS, lambda side, seed: accuracy_segment(side, seed, work, a.segment_minutes * 60),
        lambda r: f"accuracy {r['accuracy']:.4f}", say)


# ----------------------------------------------------------------------------------------------
# throughput: one interleaved pair per call (short: run it with no other jobs on the machine)
# ----------------------------------------------------------------------------------------------

def cmd_throughput(a) -> int:
    results, work = Path(a.results_dir), Path(a.work_dir)
    path = results / "throughput.json"
    steps = a.steps or PAIR_STEPS[a.pair]
    doc = C.read_json(path) if path.is_file() else {
        "kind": "throughput", "settings": {"steps": dict(PAIR_STEPS), "warmup_steps_excluded": a.warmup_excluded,
                                           "batch_size": TP_BATCH, "max_seq_length": SEQ_LEN, "threads": THREADS,
                                           "precision": PRECISION, "seed": 42, "lr": 2e-5,
                                           "model": str(os.path.relpath(VOCAB, ROOT))}, "calls": [], "runs": []}
    s = doc["settings"]
    if not doc["runs"]:  # the first run of the file sets what every later run must use
        s["warmup_steps_excluded"] = a.warmup_excluded
    if not any(r["pair"] == a.pair for r in doc["runs"]):  # and the first run of a pair, its steps
        s["steps"][a.pair] = steps
    if (s["steps"][a.pair], s["warmup_steps_excluded"]) != (steps, a.warmup_excluded):
        sys.exit(f"compare_hf_chinese: {path} was measured with --steps {s['steps'][a.pair]} --warmup-excluded "
                 f"{s['warmup_steps_excluded']}; use those (or another --results-dir)")
    (hp_label, hp_extra), (hf_label, hf_how) = PAIRS[a.pair]

    def run_side(side: str, name: str) -> dict:
        if side == "hpcbert":
            return C.hpcbert_record(C.hpcbert_run(name, work, THREADS, hpcbert_args(
                str(VOCAB), TP_BATCH, s["lr"], s["seed"], max_steps=steps,
                extra=["--warmup-steps-excluded", str(a.warmup_excluded), "--log-every", "1", *hp_extra])))
        out_json = work / "hf-json" / f"{name}.json"
        cmd = hf_cmd(name, work, out_json, shape="base", seed=s["seed"], batch=TP_BATCH, lr=s["lr"],
                     max_steps=steps, warmup_excluded=a.warmup_excluded, **hf_how)
        say(f"trainer {name}: {hf_how}")
        noise = C.run_logged(cmd, work / "logs" / f"hf-{name}.log", THREADS)
        return {**C.read_json(out_json), "wall_s": noise["wall_s"], "noise": noise}

    return C.pair_call(a, path, doc, (hp_label, hf_label), THREADS, run_side, say)


def throughput_summary(doc: dict) -> list[dict]:
    """Per comparison: the per-repeat ratio hpcbert / Trainer of training sequences/s, and its median."""
    return C.pair_summary(doc, [("dynamic", "dynamic", "equal batches, each side at its best (headline)"),
                                ("max", "max", "equal batches, both padded to 128"),
                                ("dynamic", "max", "hpcbert defaults vs Trainer defaults")])


# ----------------------------------------------------------------------------------------------
# render
# ----------------------------------------------------------------------------------------------

def render_accuracy(runs: list[dict]) -> str:
    from hpcbert.report import markdown_grid, mean_std
    rows, means = [], {}
    for side, label in (("hpcbert", "hpcbert (dynamic padding, length-grouped sampler)"),
                        ("hf", "transformers.Trainer (run_classification.py processing; dynamic padding, "
                               "group_by_length, adamw_torch_fused)")):
        rs = sorted((r for r in runs if r["side"] == side), key=lambda r: r["seed"])
        if not rs:
            continue
        acc = [100 * r["accuracy"] for r in rs]
        f1 = [100 * r["f1_macro"] for r in rs]
        (acc_m, acc_s), (f1_m, f1_s) = mean_std(acc), mean_std(f1)
        means[side] = acc_m
        rows.append([label, ", ".join(str(r["seed"]) for r in rs), C._fmt_list(acc), f"**{C.mean_pm(acc_m, acc_s)}**",
                     f"{C.mean_pm(f1_m, f1_s)}", f"{statistics.mean(r['steps'] for r in rs):.0f}",
                     f"{statistics.mean(r['wall_s'] for r in rs) / 60:.1f}"])
    lines = [markdown_grid(["side", "seeds", "dev accuracy % per seed", "accuracy mean ± std", "macro F1 mean ± std",
                            "optimizer steps", "wall min (mean)"], rows).rstrip("\n")]
    if len(means) == 2:
        lines += ["", f"Dev accuracy hpcbert − Trainer: **{means['hpcbert'] - means['hf']:+.2f} points** (std: the "
                      f"sample std over seeds; the same seed is not the same run on the two sides: different "
                      f"generators draw the weights and the order)."]
    stuck = [r for r in runs if r.get("final_loss") is not None and abs(r["final_loss"] - math.log(2)) < 0.01 * math.log(2)]
    if stuck:
        names = ", ".join(f"{'hpcbert' if r['side'] == 'hpcbert' else 'Trainer'} seed {r['seed']} (final training "
                          f"loss {r['final_loss']:.4f}, dev accuracy {100 * r['accuracy']:.2f}%)" for r in stuck)
        learned = {side: [100 * r["accuracy"] for r in runs if r["side"] == side and r not in stuck]
                   for side in ("hpcbert", "hf")}
        lines += ["", f"Did not learn: {names}: the training loss stayed at ln 2 = 0.6931, a constant prediction's "
                      f"loss on two balanced classes (a from-scratch post-LN BERT at this learning rate can fail to "
                      f"leave it; the run is kept in the table). Over the runs that learned: "
                      + "; ".join(f"{'hpcbert' if side == 'hpcbert' else 'Trainer'} {C.mean_pm(*mean_std(a))} ({len(a)} "
                                  f"seed(s))" for side, a in learned.items() if a) + "."]
    lines += ["", "Commands (one segment of at most 20 minutes of training each, repeated until the run is done; "
                  "accuracy does not depend on other work on the machine, so these ran at low priority beside "
                  "other jobs):", ""]
    lines += [f"- `{r['command']}` ({r['date']}): accuracy {100 * r['accuracy']:.2f}%, final training loss "
              f"{'—' if r.get('final_loss') is None else format(r['final_loss'], '.4f')}, {r['segments']} segment(s), "
              f"other work {r['other_cores_during']:.2f} cores" for r in sorted(runs, key=lambda r: (r["seed"], r["side"]))]
    return "\n".join(lines)


def render_throughput(doc: dict) -> str:
    s = doc["settings"]
    intro = (f"Training sequences/s, the bert-base shape with random weights ({s['model']}: 12 layers, 768 wide, "
             f"21,128-entry vocabulary), batch {s['batch_size']}, max length {s['max_seq_length']}, {s['threads']} "
             f"threads, {s['precision']}; steps per run: {', '.join(f'{k} pair {v}' for k, v in s['steps'].items())}, "
             f"the first {s['warmup_steps_excluded']} excluded (the Trainer's group_by_length sorts each "
             f"mega-batch of 50 batches longest first, so a dynamic run covers a whole mega-batch), on both sides timed from the step's batch fetch to the end of its optimizer step "
             f"(compare_hf.py's span). Ratio = hpcbert / Trainer within a repeat (the two runs of a pair ran back "
             f"to back in one call), median over repeats.")
    return C.render_pair_throughput(doc, intro, throughput_summary(doc), "{:.3f}")


def render_readme(results: Path) -> str:
    results = Path(results)
    L, H, A, I = ACC_SHAPE
    out = ["# ChnSentiCorp with the Chinese BERT vocabulary: hpcbert vs the Hugging Face Trainer", "",
           "Generated by `python benchmarks/compare_hf_chinese.py render` from the JSON files in this folder; every "
           "figure comes from the runs the commands below started.", "",
           "Data: ChnSentiCorp (train.tsv: 9,600 reviews, `label, text_a`; dev.tsv: 1,200, `qid, label, text_a`), "
           "tokenised with the bert-base-chinese vocabulary (21,128 entries, cased; every CJK character its own "
           "token). No Chinese weights are available here: every model on both sides is trained **from random "
           f"weights**. Both sides: AdamW (PyTorch's fused kernel), weight decay {WEIGHT_DECAY}, linear warm-up "
           f"{WARMUP_RATIO:g} then linear decay to 0, max grad norm {MAX_GRAD_NORM}, dropout 0.1, max length "
           f"{SEQ_LEN}, {PRECISION} on every machine (the first one these ran on had no native bf16, where "
           f"emulated bf16 is ~100x slower; the machine line of each section says whether its CPU has it), "
           f"{THREADS} threads. The Trainer side is transformers' text-classification example "
           "(run_classification.py) re-implemented in the script: `tokenizer(text, max_length=128, "
           "truncation=True)`, `AutoModelForSequenceClassification.from_config`, `Trainer.train()`.", ""]
    out += ["## Accuracy: a small shape from scratch", "",
            f"{ACC_MODEL} (Turc et al. 2019: {L} layers, {H} wide, {A} heads, FFN {I}; word embeddings for the 21,128-"
            f"entry vocabulary), batch {ACC_BATCH}, lr {ACC_LR:g}, {ACC_EPOCHS:g} epochs, seeds "
            f"{', '.join(map(str, SEEDS))}; dev accuracy (the headline) and macro F1. The Trainer runs with dynamic "
            "padding and group_by_length here (the same maths as padding to 128, in less time).", ""]
    out += C.accuracy_section(results, render_accuracy)
    out += C.render_sections(results, [("Throughput: the bert-base shape", "throughput.json", render_throughput)])
    return "\n".join(out)


def add_commands(sub) -> None:
    def common(sp):
        C.add_dir_options(sp, DEFAULT_RESULTS, DEFAULT_WORK, "run directories, logs, Trainer scratch")

    sp = sub.add_parser("accuracy", help="dev accuracy of bert-mini from scratch; one (side, seed) per call")
    common(sp)
    C.add_accuracy_options(sp, SEEDS)
    sp.set_defaults(fn=cmd_accuracy)
    sp = sub.add_parser("throughput", help="one repeat of one interleaved pair (hpcbert, Trainer), bert-base shape")
    common(sp)
    C.add_pair_options(sp, PAIRS, steps=None, warmup_excluded=3,
                       steps_help=f"steps per run (default: {', '.join(f'{k} {v}' for k, v in PAIR_STEPS.items())})")
    sp.set_defaults(fn=cmd_throughput)


def check_data_unless_render(p, a) -> None:
    if a.command != "render":
        check_data()


def main(argv: list[str] | None = None) -> int:
    return C.script_main(argv, description=__doc__, hf_worker=hf_worker, add_commands=add_commands,
                         results=DEFAULT_RESULTS, render=render_readme, check=check_data_unless_render)


if __name__ == "__main__":
    sys.exit(main())
