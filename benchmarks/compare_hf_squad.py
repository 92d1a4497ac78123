#!/usr/bin/env python
"""hpcbert vs the Hugging Face Trainer on SQuAD v1.1: the same model, split, lengths, epochs and precision.

A measurement, not a test. Every figure comes from runs this script starts; results/squad/README.md
is generated from the JSON files (`render`), never typed.

    python benchmarks/compare_hf_squad.py prepare                          the by-article split + its counts
    python benchmarks/compare_hf_squad.py accuracy --side hpcbert --seed 1 one accuracy run (skipped if done)
    python benchmarks/compare_hf_squad.py throughput --repeat 1 --pair dynamic   one repeat of one pair
    python benchmarks/compare_hf_squad.py render                           results/squad/README.md

Data: the official SQuAD v1.1 dev file (../shared/data/squad/v1.1/dev-v1.1.json) split by article as
its README says: the first 24 articles for training, the last 24 for evaluation.
Both sides: minilm-l6 (pretrained BertModel; the span head `qa_outputs` newly initialised), max
length 384, doc stride 128, per-device batch 16, 2 threads, lr 5e-5, AdamW (betas 0.9/0.999, eps
1e-8, PyTorch's fused kernel on both sides), weight decay 0.01 (not on biases and LayerNorm
weights), linear warm-up over round(0.1 x steps) steps then linear decay to 0, max grad norm 1.0,
2 epochs, fp32 (the CPU these were first measured on has no native bf16), n-best 20, answers of at most 30 tokens.
Each side prepares windows as its own users expect: hpcbert as Google's run_squad.py (question cut
to 64 tokens, window starts 128 tokens apart); the Trainer as transformers' question-answering example
(run_qa.py's prepare_train_features / prepare_validation_features and utils_qa.py's
postprocess_qa_predictions, re-implemented below since the examples are not installed: the
tokenizer's overflow windows with `stride=128`, i.e. 128 tokens of *overlap*, the question not cut).
Both are scored with the official v1.1 metric (hpcbert.data.squad_metrics, a re-implementation of
evaluate-v1.1.py; the example's `evaluate.load("squad")` is that script).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_hf as C  # noqa: E402  (shared: runs, noise, machine info, JSON I/O, the Trainer, pair tables)

ROOT = C.ROOT
SQUAD_DEV = ROOT.parent / "shared" / "data" / "squad" / "v1.1" / "dev-v1.1.json"
DEFAULT_RESULTS = ROOT / "results" / "squad"
DEFAULT_WORK = ROOT / "runs" / "compare_hf_squad"
TRAIN_ARTICLES = 24
MODEL = "minilm-l6"
SEQ_LEN, STRIDE, QUERY_LEN = 384, 128, 64
BATCH, THREADS, LR = 16, 2, 5e-5
# the Trainer's settings shared with compare_hf.py (C.train_resumable uses them)
EVAL_BATCH, WEIGHT_DECAY, WARMUP_RATIO, MAX_GRAD_NORM = C.EVAL_BATCH, C.WEIGHT_DECAY, C.WARMUP_RATIO, C.MAX_GRAD_NORM
EPOCHS = 2.0
N_BEST, MAX_ANSWER = 20, 30
SEEDS = (1, 2, 3)
PRECISION = "fp32"  # the first CPU these ran on had no native bf16 (emulated ~100x slower): fp32 on both sides, on every machine
F1_TARGET = 1.5     # hpcbert's mean F1 within this many points of the Trainer's
SPEED_TARGET = 1.1  # hpcbert >= 1.1x the Trainer's training sequences/s

# Throughput pairs, each run as one interleaved pair per call: (hpcbert label + options, Trainer label + options).
PAIRS = {
    "dynamic": (("hpcbert defaults: dynamic padding, length-grouped sampler", []),
                ("Trainer tuned: dynamic padding (DataCollatorWithPadding), train_sampling_strategy="
                 "group_by_length, adamw_torch_fused", dict(padding="dynamic", group_by_length=True))),
    "max": (("hpcbert --pad-to-max-length (every batch 16 x 384)", ["--pad-to-max-length"]),
            ("Trainer defaults: pad to 384 (run_qa.py pad_to_max_length=True), random sampler, adamw_torch_fused",
             dict(padding="max_length", group_by_length=False))),
}


def say(msg: str) -> None:
    print(f"[compare_hf_squad {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# data: the by-article split
# ----------------------------------------------------------------------------------------------

def split_files(work: Path) -> tuple[Path, Path]:
    """train.json (first 24 articles) and dev.json (last 24) of the shared dev file, written once
    (same bytes every time, so hpcbert's feature cache hits)."""
    if not SQUAD_DEV.is_file():
        sys.exit(f"compare_hf_squad: {SQUAD_DEV} not found (the official SQuAD v1.1 dev file, in ../shared)")
    doc = json.loads(SQUAD_DEV.read_text(encoding="utf-8"))
    data = doc["data"]
    assert len(data) == 2 * TRAIN_ARTICLES, len(data)
    out = work / "data"
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, arts in (("train", data[:TRAIN_ARTICLES]), ("dev", data[TRAIN_ARTICLES:])):
        p = out / f"{name}.json"
        text = json.dumps({"version": doc.get("version", "1.1"), "data": arts}, ensure_ascii=False)
        if not p.is_file() or p.read_text(encoding="utf-8") != text:
            p.write_text(text, encoding="utf-8")
        paths.append(p)
    return paths[0], paths[1]


def cmd_prepare(a) -> int:
    """Counts of the split, and of the windows each side makes (no training)."""
    from hpcbert.data.features import load_tokenizer
    from hpcbert.data.squad import build_features, read_squad
    from hpcbert.zoo import minilm_dir

    train, dev = split_files(Path(a.work_dir))
    doc = C.header("data", THREADS)
    tok = load_tokenizer(minilm_dir(), SEQ_LEN)
    doc["splits"] = {}
    for name, path in (("train", train), ("dev", dev)):
        _, ex = read_squad(path)
        f = build_features(ex, tok, SEQ_LEN, STRIDE, QUERY_LEN)
        hf = hf_features(ex, train=name == "train")
        doc["splits"][name] = {
            "file": os.path.relpath(path, ROOT), "articles": len({e.title for e in ex}), "questions": len(ex),
            "hpcbert_windows": len(f), "hf_windows": len(hf["input_ids"]),
            "hpcbert_real_tokens_per_window": sum(map(len, f.input_ids)) / len(f),
            "hf_real_tokens_per_window": sum(map(len, hf["input_ids"])) / len(hf["input_ids"]),
            "truncated": len(f.truncated), "unmatched": len(f.unmatched), "unrecoverable": len(f.unrecoverable),
        }
        if name == "train":  # the example's targets: windows whose answer lies inside them
            doc["splits"][name]["hf_windows_with_answer"] = sum(1 for s in hf["start_positions"] if s != 0)
            doc["splits"][name]["hpcbert_windows_with_answer"] = int((f.start_positions != 0).sum())
        say(f"{name}: {doc['splits'][name]}")
    C.write_json(Path(a.results_dir) / "data.json", doc)
    return 0


# ----------------------------------------------------------------------------------------------
# the Trainer side: run_qa.py's pre- and post-processing, re-implemented
# ----------------------------------------------------------------------------------------------

def _hf_tokenizer():
    from transformers import AutoTokenizer
    from hpcbert.zoo import minilm_dir
    return AutoTokenizer.from_pretrained(str(minilm_dir()))


def hf_features(examples, train: bool, tok=None, padding=False) -> dict:
    """run_qa.py prepare_train_features (train=True) / prepare_validation_features, over
    hpcbert's parsed examples (the same questions, contexts and first answers)."""
    tok = tok or _hf_tokenizer()
    max_len = min(SEQ_LEN, tok.model_max_length)
    enc = tok([e.question.lstrip() for e in examples], [e.context for e in examples], truncation="only_second",
              max_length=max_len, stride=STRIDE, return_overflowing_tokens=True, return_offsets_mapping=True,
              padding="max_length" if padding else False)
    sample_mapping = enc.pop("overflow_to_sample_mapping")
    offset_mapping = enc.pop("offset_mapping")
    out = {k: list(v) for k, v in enc.items()}
    if train:
        out["start_positions"], out["end_positions"] = [], []
        for i, offsets in enumerate(offset_mapping):
            input_ids = out["input_ids"][i]
            cls_index = input_ids.index(tok.cls_token_id)
            sequence_ids = enc.sequence_ids(i)
            ex = examples[sample_mapping[i]]
            if not ex.answers:
                out["start_positions"].append(cls_index)
                out["end_positions"].append(cls_index)
                continue
            start_char = ex.answers[0].answer_start
            end_char = start_char + len(ex.answers[0].text)
            token_start_index = 0
            while sequence_ids[token_start_index] != 1:
                token_start_index += 1
            token_end_index = len(input_ids) - 1
            while sequence_ids[token_end_index] != 1:
                token_end_index -= 1
            if not (offsets[token_start_index][0] <= start_char and offsets[token_end_index][1] >= end_char):
                out["start_positions"].append(cls_index)
                out["end_positions"].append(cls_index)
            else:
                while token_start_index < len(offsets) and offsets[token_start_index][0] <= start_char:
                    token_start_index += 1
                out["start_positions"].append(token_start_index - 1)
                while offsets[token_end_index][1] >= end_char:
                    token_end_index -= 1
                out["end_positions"].append(token_end_index + 1)
    else:
        out["example_id"], out["offset_mapping"] = [], []
        for i in range(len(out["input_ids"])):
            sequence_ids = enc.sequence_ids(i)
            out["example_id"].append(examples[sample_mapping[i]].id)
            out["offset_mapping"].append([o if sequence_ids[k] == 1 else None
                                          for k, o in enumerate(offset_mapping[i])])
    return out


def postprocess_qa_predictions(examples, features: dict, start_logits, end_logits, n_best_size: int = N_BEST,
                               max_answer_length: int = MAX_ANSWER) -> dict[str, str]:
    """utils_qa.py postprocess_qa_predictions for v1.1 (version_2_with_negative=False)."""
    import numpy as np

    example_id_to_index = {e.id: i for i, e in enumerate(examples)}
    features_per_example = collections.defaultdict(list)
    for i, eid in enumerate(features["example_id"]):
        features_per_example[example_id_to_index[eid]].append(i)
    all_predictions = collections.OrderedDict()
    for example_index, example in enumerate(examples):
        prelim = []
        for feature_index in features_per_example[example_index]:
            s, e = start_logits[feature_index], end_logits[feature_index]
            offset_mapping = features["offset_mapping"][feature_index]
            start_indexes = np.argsort(s)[-1: -n_best_size - 1: -1].tolist()
            end_indexes = np.argsort(e)[-1: -n_best_size - 1: -1].tolist()
            for si in start_indexes:
                for ei in end_indexes:
                    if (si >= len(offset_mapping) or ei >= len(offset_mapping) or offset_mapping[si] is None
                            or len(offset_mapping[si]) < 2 or offset_mapping[ei] is None
                            or len(offset_mapping[ei]) < 2):
                        continue
                    if ei < si or ei - si + 1 > max_answer_length:
                        continue
                    prelim.append({"offsets": (offset_mapping[si][0], offset_mapping[ei][1]),
                                   "score": s[si] + e[ei]})
        preds = sorted(prelim, key=lambda x: x["score"], reverse=True)[:n_best_size]
        context = example.context
        texts = [context[p["offsets"][0]:p["offsets"][1]] for p in preds]
        if not texts or (len(texts) == 1 and texts[0] == ""):
            texts.insert(0, "empty")
        all_predictions[example.id] = texts[0]
    return all_predictions


def hf_worker(argv: list[str]) -> int:
    """One Trainer run as run_qa.py does it; writes one JSON of measurements (and predictions)."""
    p = argparse.ArgumentParser(prog="compare_hf_squad.py _hf-worker")
    p.add_argument("--train-file", required=True)
    p.add_argument("--dev-file", required=True)
    p.add_argument("--threads", type=int, default=THREADS)
    C.add_trainer_worker_options(p, epochs=EPOCHS, warmup_excluded=5)
    a = p.parse_args(argv)
    t_process = time.perf_counter()

    import torch
    import transformers
    from transformers import AutoModelForQuestionAnswering, DataCollatorWithPadding, default_data_collator

    from hpcbert.data.squad import read_squad
    from hpcbert.data.squad_metrics import evaluate_v1
    from hpcbert.zoo import minilm_dir

    torch.set_num_threads(a.threads)
    tok = _hf_tokenizer()
    pad = a.padding == "max_length"
    _, train_ex = read_squad(a.train_file)
    tf = hf_features(train_ex, train=True, tok=tok, padding=pad)
    keys = ("input_ids", "token_type_ids", "attention_mask", "start_positions", "end_positions")
    train_ds = [{k: tf[k][i] for k in keys} for i in range(len(tf["input_ids"]))]
    # run_qa.py: default_data_collator when pad_to_max_length, else DataCollatorWithPadding (no multiple of 8 in fp32)
    collator = default_data_collator if pad else DataCollatorWithPadding(tok)

    transformers.set_seed(a.seed)  # the new span head is drawn from this seed
    model = AutoModelForQuestionAnswering.from_pretrained(str(minilm_dir()))
    total = a.max_steps or math.ceil(a.epochs * math.ceil(len(train_ds) / BATCH))
    args, trainer, timer, train_out, t_train, t_done = C.train_resumable(
        model, tok, train_ds, collator, scratch=a.scratch, batch=BATCH, lr=LR, epochs=a.epochs,
        max_steps=a.max_steps, total=total, seed=a.seed, group_by_length=a.group_by_length, threads=a.threads,
        deadline=a.deadline)
    if C.trainer_stopped_early(trainer, total, say):
        return 3

    result = C.trainer_result(a, args, model, trainer, timer, total, PRECISION,
                              (train_out, t_process, t_train, t_done), train_windows=len(train_ds))
    if a.do_eval:
        t0 = time.perf_counter()
        _, dev_ex = read_squad(a.dev_file)
        vf = hf_features(dev_ex, train=False, tok=tok, padding=pad)
        inputs = [{k: vf[k][i] for k in ("input_ids", "token_type_ids", "attention_mask")}
                  for i in range(len(vf["input_ids"]))]
        start, end = trainer.predict(inputs).predictions  # (n, T) each, padded with -100 across batches
        preds = postprocess_qa_predictions(dev_ex, vf, start, end)
        r = evaluate_v1(dev_ex, preds)
        result["eval"] = {"dev": {"exact_match": r["exact_match"], "f1": r["f1"], "windows": len(inputs)}}
        result["eval_s"] = time.perf_counter() - t0
        (Path(a.scratch) / "predictions.json").write_text(json.dumps(preds, indent=4) + "\n")
    C.write_json(Path(a.out), result)
    return 0


def hf_cmd(name: str, work: Path, train: Path, dev: Path, out_json: Path, *, padding: str, group_by_length: bool,
           seed: int, max_steps: int | None = None, do_eval: bool = False, warmup_excluded: int = 5) -> list[str]:
    """The `_hf-worker` command of one Trainer run (its checkpoints in work/hf-scratch/NAME)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "_hf-worker", "--train-file", str(train), "--dev-file",
           str(dev), "--out", str(out_json), "--scratch", str(work / "hf-scratch" / name), "--padding", padding,
           "--seed", str(seed), "--threads", str(THREADS), "--warmup-steps-excluded", str(warmup_excluded)]
    return cmd + C.trainer_worker_flags(group_by_length=group_by_length, max_steps=max_steps, do_eval=do_eval)


def hf_run(name: str, work: Path, train: Path, dev: Path, out_json: Path, *, padding: str, group_by_length: bool,
           seed: int, max_steps: int | None = None, warmup_excluded: int = 5) -> dict:
    cmd = hf_cmd(name, work, train, dev, out_json, padding=padding, group_by_length=group_by_length, seed=seed,
                 max_steps=max_steps, warmup_excluded=warmup_excluded)
    say(f"trainer {name}: padding={padding} group_by_length={group_by_length} seed={seed}")
    noise = C.run_logged(cmd, work / "logs" / f"hf-{name}.log", THREADS)
    r = C.read_json(out_json)
    r.update(wall_s=noise["wall_s"], noise=noise)
    return r


# ----------------------------------------------------------------------------------------------
# the hpcbert side
# ----------------------------------------------------------------------------------------------

def hpcbert_args(train: Path, dev: Path, seed: int, *, max_steps: int | None = None, do_eval: bool = False,
                 extra: list[str] | None = None) -> list[str]:
    a = ["--task", "squad", "--train-file", str(train), "--dev-file", str(dev), "--model", MODEL,
         "--max-seq-length", str(SEQ_LEN), "--doc-stride", str(STRIDE), "--max-query-length", str(QUERY_LEN),
         "--batch-size", str(BATCH), "--lr", str(LR), "--optimizer", "adamw", "--weight-decay", str(WEIGHT_DECAY),
         "--warmup-ratio", str(WARMUP_RATIO), "--max-grad-norm", str(MAX_GRAD_NORM), "--precision", PRECISION,
         "--seed", str(seed), "--eval-batch-size", str(EVAL_BATCH), "--n-best-size", str(N_BEST),
         "--max-answer-length", str(MAX_ANSWER)]
    a += ["--max-steps", str(max_steps)] if max_steps else ["--epochs", f"{EPOCHS:g}"]
    a += ["--do-eval" if do_eval else "--no-do-eval", *(extra or [])]
    return a


# ----------------------------------------------------------------------------------------------
# accuracy: one (side, seed) per call, in resumable segments
# ----------------------------------------------------------------------------------------------

def accuracy_segment(side: str, seed: int, work: Path, train: Path, dev: Path, segment_s: float) -> dict | None:
    """One segment of the (side, seed) accuracy run (C.accuracy_segment_run: at most `segment_s` of
    training, then a checkpoint); the finished run's figures, or None while it is not finished."""
    name = f"acc-{side}-seed{seed}"
    out_json = work / "hf-json" / f"{name}.json"
    args = hpcbert_args(train, dev, seed, do_eval=True)

    def build_cmd(folder: Path, deadline: str) -> list[str]:
        if side == "hpcbert":
            return [sys.executable, "-m", "hpcbert.cli", "train", *args, "--threads", str(THREADS), "--out",
                    str(folder), "--resume", "auto"]
        return hf_cmd(name, work, train, dev, out_json, padding="dynamic", group_by_length=True, seed=seed,
                      do_eval=True) + ["--deadline", deadline]

    rc, segments, out = C.accuracy_segment_run(name, side, work, segment_s, THREADS, build_cmd, say)
    wall = sum(x["wall_s"] for x in segments)
    known = [x for x in segments if x["other_cores_during"] is not None]
    busy = sum(x["other_cores_during"] * x["wall_s"] for x in known) / sum(x["wall_s"] for x in known)
    noise_all = {"other_cores_during": busy, "wall_s": wall, "waited_for_quiet_s": 0.0, "other_cores_before": None}
    base = {"side": side, "seed": seed, "segments": len(segments), "wall_s": wall, "noise": noise_all}
    if side == "hpcbert":
        done = C.finished_hpcbert_accuracy_run(out, args, THREADS)
        if done is None:
            return None
        s, shared = done
        ev = s["eval"]["dev"]
        return {**base, "exact_match": ev["exact_match"], "f1": ev["f1"], "eval_loss": ev["loss"],
                "unrecoverable_answers": ev.get("unrecoverable_answers"), "final_loss": s["final_loss"],
                "steps": s["steps"], "train_windows": round(s["sequences"] / s["epochs_done"]),
                "steady_sequences_per_sec": s["steady_sequences_per_sec"], **shared}
    if rc == 3:
        return None
    r = C.read_json(out_json)
    ev = r["eval"]["dev"]
    return {**base, "exact_match": ev["exact_match"], "f1": ev["f1"], "final_loss": r["final_loss"],
            "steps": r["total_steps"], "train_windows": r["train_windows"], "optim": r["optim"],
            "sampler": r["sampler"], "padding": r["padding"], "warmup_steps": r["warmup_steps"],
            "predictions": os.path.relpath(out / "predictions.json", ROOT)}


def cmd_accuracy(a) -> int:
    work = Path(a.work_dir)
    train, dev = split_files(work)
    return C.accuracy_calls(
        a, SEEDS, THREADS, lambda side, seed: accuracy_segment(side, seed, work, train, dev, a.segment_minutes * 60),
        lambda r: f"EM {r['exact_match']:.2f}, F1 {r['f1']:.2f}", say)


# ----------------------------------------------------------------------------------------------
# throughput: one interleaved pair per call (short: run it with no other jobs on the machine)
# ----------------------------------------------------------------------------------------------

def cmd_throughput(a) -> int:
    results, work = Path(a.results_dir), Path(a.work_dir)
    train, dev = split_files(work)
    path = results / "throughput.json"
    doc = C.read_json(path) if path.is_file() else {
        "kind": "throughput", "settings": {"steps": a.steps, "warmup_steps_excluded": a.warmup_excluded,
                                           "batch_size": BATCH, "max_seq_length": SEQ_LEN, "threads": THREADS,
                                           "precision": PRECISION, "seed": 42}, "calls": [], "runs": []}
    s = doc["settings"]
    if (s["steps"], s["warmup_steps_excluded"]) != (a.steps, a.warmup_excluded):
        sys.exit(f"compare_hf_squad: {path} was measured with --steps {s['steps']} --warmup-excluded "
                 f"{s['warmup_steps_excluded']}; use those (or another --results-dir)")
    (hp_label, hp_extra), (hf_label, hf_how) = PAIRS[a.pair]

    def run_side(side: str, name: str) -> dict:
        if side == "hpcbert":
            return C.hpcbert_record(C.hpcbert_run(name, work, THREADS, hpcbert_args(
                train, dev, s["seed"], max_steps=a.steps,
                extra=["--warmup-steps-excluded", str(a.warmup_excluded), "--log-every", "1", *hp_extra])))
        return hf_run(name, work, train, dev, work / "hf-json" / f"{name}.json", seed=s["seed"],
                      max_steps=a.steps, warmup_excluded=a.warmup_excluded, **hf_how)

    return C.pair_call(a, path, doc, (hp_label, hf_label), THREADS, run_side, say)


def throughput_summary(doc: dict) -> list[dict]:
    """Per pair (and hpcbert defaults vs Trainer defaults across pairs): the per-repeat ratio of
    training sequences/s, and its median."""
    return C.pair_summary(doc, [("dynamic", "dynamic", "equal batches, each side's best (headline)"),
                                ("max", "max", "equal batches, padded to 384"),
                                ("dynamic", "max", "hpcbert defaults vs Trainer defaults")])


# ----------------------------------------------------------------------------------------------
# render
# ----------------------------------------------------------------------------------------------

def render_data(doc: dict) -> str:
    from hpcbert.report import markdown_grid
    rows = []
    for name, s in doc["splits"].items():
        rows.append([name, s["file"], str(s["articles"]), str(s["questions"]), str(s["hpcbert_windows"]),
                     str(s["hf_windows"]),
                     f"{s['hpcbert_real_tokens_per_window']:.1f} / {s['hf_real_tokens_per_window']:.1f}",
                     f"{s['unrecoverable']} ({s['truncated']} cut by windowing, {s['unmatched']} not on token "
                     f"boundaries)"])
    lines = [markdown_grid(["split", "file", "articles", "questions", "hpcbert windows (stride = step 128)",
                            "Trainer windows (stride = overlap 128)", "tokens/window hpcbert / Trainer",
                            "unrecoverable answers (hpcbert)"], rows).rstrip("\n")]
    lines += ["", "Unrecoverable: answerable questions whose gold answer no window's target reproduces exactly "
                  "(hpcbert's count, `SquadFeatures.unrecoverable`): an answer no window holds whole, or one "
                  "annotated inside a word piece (e.g. 'gold' in 'golden'), which reads back as the whole token. "
                  "The same questions are scored normally at evaluation (a prediction can still match another "
                  "reference answer)."]
    return "\n".join(lines)


def render_accuracy(runs: list[dict]) -> str:
    from hpcbert.report import markdown_grid, mean_std
    rows, stats = [], {}
    for side, label in (("hpcbert", "hpcbert (dynamic padding, length-grouped sampler)"),
                        ("hf", "transformers.Trainer (run_qa.py processing; dynamic padding, group_by_length, "
                               "adamw_torch_fused)")):
        rs = sorted((r for r in runs if r["side"] == side), key=lambda r: r["seed"])
        if not rs:
            continue
        em_m, em_s = mean_std([r["exact_match"] for r in rs])
        f1_m, f1_s = mean_std([r["f1"] for r in rs])
        stats[side] = f1_m
        rows.append([label, ", ".join(str(r["seed"]) for r in rs), C._fmt_list([r["exact_match"] for r in rs]),
                     C._fmt_list([r["f1"] for r in rs]), f"{C.mean_pm(em_m, em_s)}", f"**{C.mean_pm(f1_m, f1_s)}**",
                     f"{statistics.mean(r['steps'] for r in rs):.0f}",
                     f"{statistics.mean(r['wall_s'] for r in rs) / 60:.1f}"])
    lines = [markdown_grid(["side", "seeds", "exact match per seed", "F1 per seed", "EM mean ± std",
                            "F1 mean ± std", "optimizer steps", "wall min (mean)"], rows).rstrip("\n")]
    if len(stats) == 2:
        d = stats["hpcbert"] - stats["hf"]
        ok = abs(d) <= F1_TARGET or d > 0
        n = min(len([r for r in runs if r["side"] == side]) for side in stats)
        verdict = ("MET" if ok else "NOT MET") if n >= len(SEEDS) else \
            f"{'within' if ok else 'outside'} it on {n} of the {len(SEEDS)} seeds asked; no verdict until all have run"
        lines += ["", f"F1 hpcbert − Trainer: **{d:+.2f} points** (target: within {F1_TARGET} points of the "
                      "Trainer's "
                      f"mean): **{verdict}**. std is the sample std over seeds."]
    lines += ["", "Commands (one run each; accuracy does not depend on other work on the machine, so these ran "
                  "at low priority beside other jobs):", ""]
    lines += [f"- `{r['command']}` ({r['date']}): EM {r['exact_match']:.2f}, F1 {r['f1']:.2f}"
              for r in sorted(runs, key=lambda r: (r["seed"], r["side"]))]
    lines += ["", "hpcbert's run directories (config.json, summary.json, predictions.json, nbest_predictions.json) "
                  "and the Trainer's predictions.json are under `runs/compare_hf_squad/` (not committed). The "
                  "same seed is not the same run on the two sides (different generators draw the head and the "
                  "order): compare means and spreads."]
    return "\n".join(lines)


def render_throughput(doc: dict) -> str:
    s = doc["settings"]
    intro = (f"Training sequences/s (windows/s), {MODEL}, batch {s['batch_size']}, max length {s['max_seq_length']}, "
             f"{s['threads']} threads, {s['precision']}; {s['steps']} steps per run, the first "
             f"{s['warmup_steps_excluded']} excluded, on both sides timed from the step's batch fetch to the end "
             f"of its optimizer step (compare_hf.py's span). Ratio = hpcbert / Trainer within a repeat (the two "
             f"runs of a pair ran back to back in one call), median over repeats.")
    return C.render_pair_throughput(doc, intro, throughput_summary(doc), "{:.2f}", SPEED_TARGET)


def render_readme(results: Path) -> str:
    results = Path(results)
    out = ["# SQuAD v1.1: hpcbert vs the Hugging Face Trainer", "",
           "Generated by `python benchmarks/compare_hf_squad.py render` from the JSON files in this folder; every "
           "figure comes from the runs the commands below started.", "",
           f"Both sides: {MODEL} (pretrained BertModel, new span head), the official SQuAD v1.1 dev file split by "
           f"article (first {TRAIN_ARTICLES} articles train, last {TRAIN_ARTICLES} evaluate), max length {SEQ_LEN}, "
           f"doc stride {STRIDE}, batch {BATCH}, lr {LR:g}, AdamW (fused, both sides), weight decay {WEIGHT_DECAY}, "
           f"linear warm-up {WARMUP_RATIO:g} then decay, {EPOCHS:g} epochs, {PRECISION} (the first machine these ran "
           f"on had no native bf16, where emulated bf16 is ~100x slower; every later run keeps fp32 so that all "
           f"seeds compare), n-best {N_BEST}, answers ≤ "
           f"{MAX_ANSWER} tokens, {THREADS} threads. Each side windows the contexts as its users expect: hpcbert as "
           f"Google's run_squad.py (question ≤ {QUERY_LEN} tokens, window starts {STRIDE} tokens apart), the "
           f"Trainer as transformers' run_qa.py (the tokenizer's overflow windows, {STRIDE} tokens of overlap); "
           "its pre- and post-processing (prepare_train_features, prepare_validation_features, "
           "postprocess_qa_predictions) are re-implemented in the script from the example. Both are scored with "
           "the official v1.1 exact match and F1.", ""]
    sections = [("Data", "data.json", render_data),
                ("Throughput", "throughput.json", render_throughput)]
    out += C.render_sections(results, sections)
    out += ["## Accuracy", ""] + C.accuracy_section(results, render_accuracy)
    return "\n".join(out)


def add_commands(sub) -> None:
    def common(sp):
        C.add_dir_options(sp, DEFAULT_RESULTS, DEFAULT_WORK, "split files, run directories, logs")

    sp = sub.add_parser("prepare", help="write the by-article split and count its windows (data.json)")
    common(sp)
    sp.set_defaults(fn=cmd_prepare)
    sp = sub.add_parser("accuracy", help="EM/F1 after 2 epochs; one (side, seed) per call, done ones skipped")
    common(sp)
    C.add_accuracy_options(sp, SEEDS)
    sp.set_defaults(fn=cmd_accuracy)
    sp = sub.add_parser("throughput", help="one repeat of one interleaved pair (hpcbert, Trainer)")
    common(sp)
    C.add_pair_options(sp, PAIRS, steps=40, warmup_excluded=5, steps_help="steps per run (default: %(default)s)")
    sp.set_defaults(fn=cmd_throughput)


def main(argv: list[str] | None = None) -> int:
    return C.script_main(argv, description=__doc__, hf_worker=hf_worker, add_commands=add_commands,
                         results=DEFAULT_RESULTS, render=render_readme)


if __name__ == "__main__":
    sys.exit(main())
