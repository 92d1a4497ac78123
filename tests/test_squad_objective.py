"""The SQuAD objective (`--task squad`): the span head against transformers, the loss, the feature
cache key, end-to-end runs of the real CLI on small constructed SQuAD files (v1.1 and v2.0), the
files the official evaluation scripts read, 1 vs 2 processes, and bad input.

Expected values come from transformers (logits, loss), from the files' own questions (ids, answers)
and from the rules the official scripts apply when they read predictions. The data SQuAD code
itself (reader, windows, metrics by hand, the real dev file) is tested in test_squad_data.py."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_env
from hpcbert import objectives
from hpcbert.config import RunConfig
from hpcbert.data.squad import read_squad
from hpcbert.data.squad_metrics import evaluate_v1, evaluate_v2
from hpcbert.objectives import get
from hpcbert.runfiles import read_summary

slow = pytest.mark.slow

COUNTRIES = ["france", "germany", "spain", "italy", "austria", "portugal", "greece", "ireland", "norway", "poland"]
CAPITALS = ["paris", "berlin", "madrid", "rome", "vienna", "lisbon", "athens", "dublin", "oslo", "warsaw"]
FILLER = ["the", "river", "flows", "north", "and", "many", "people", "live", "near", "old", "town", "hills"]


def squad_doc(seed: int, articles: int, impossible: bool = False) -> dict:
    """Paragraphs of filler around 'the capital of X is Y .' (40-125 words: one to five windows at
    length 64); a question per paragraph, and with `impossible` one about a country not in it."""
    rng = random.Random(seed)
    data, n = [], 0
    for a in range(articles):
        paras = []
        for _ in range(3):
            i = rng.randrange(len(COUNTRIES))
            before = " ".join(rng.choice(FILLER) for _ in range(rng.randrange(20, 80)))
            after = " ".join(rng.choice(FILLER) for _ in range(rng.randrange(10, 40)))
            context = f"{before} . the capital of {COUNTRIES[i]} is {CAPITALS[i]} . {after} ."
            qas = [{"id": f"s{seed}q{n}", "question": f"what is the capital of {COUNTRIES[i]} ?",
                    "answers": [{"text": CAPITALS[i], "answer_start": context.index(f" is {CAPITALS[i]} ") + 4}]}]
            n += 1
            if impossible:
                j = (i + 1) % len(COUNTRIES)
                qas[0]["is_impossible"] = False
                plausible = [{"text": CAPITALS[i], "answer_start": qas[0]["answers"][0]["answer_start"]}]
                qas.append({"id": f"s{seed}q{n}", "question": f"what is the capital of {COUNTRIES[j]} ?",
                            "answers": [], "is_impossible": True, "plausible_answers": plausible})
                n += 1
            paras.append({"context": context, "qas": qas})
        data.append({"title": f"article {a}", "paragraphs": paras})
    return {"version": "v2.0" if impossible else "1.1", "data": data}


@pytest.fixture(scope="module")
def squad_files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("squad")
    for name, seed, arts, imp in (("train", 1, 8, False), ("dev", 2, 3, False),
                                  ("train2", 3, 8, True), ("dev2", 4, 3, True)):
        (d / f"{name}.json").write_text(json.dumps(squad_doc(seed, arts, imp)))
    words = sorted(set(COUNTRIES + CAPITALS + FILLER + ["what", "is", "capital", "of", ".", "?"]))
    (d / "vocab").mkdir()
    (d / "vocab" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    return d


def tiny_args(d: Path, train="train", dev="dev") -> list[str]:
    # bert-tiny (random weights) with the small vocabulary; windows of 64 with starts 16 apart.
    return ["--task", "squad", "--train-file", str(d / f"{train}.json"), "--dev-file", str(d / f"{dev}.json"),
            "--model", "bert-tiny", "--tokenizer", str(d / "vocab"), "--max-seq-length", "64", "--doc-stride", "16",
            "--max-query-length", "16", "--lr", "1e-3", "--dropout", "0", "--precision", "fp32", "--threads", "1",
            "--log-every", "1", "--eval-batch-size", "16", "--dist-timeout", "60"]


def hpcbert(args: list[str], nproc: int = 1, cwd: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hpcbert.cli"] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
         "hpcbert.cli"]
    env = run_env()
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([*cmd, "train", *map(str, args)], env=env, capture_output=True, text=True, timeout=180,
                          cwd=cwd)


# --- the head against transformers -----------------------------------------------------------------

def _hf_pair(tmp_path):
    from transformers import BertConfig as HFConfig, BertForQuestionAnswering as HFQA

    from hpcbert.model import BertConfig, BertForQuestionAnswering, load_pretrained

    torch.manual_seed(0)
    hf = HFQA(HFConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=37, max_position_embeddings=64)).eval()
    hf.save_pretrained(tmp_path)
    ours = BertForQuestionAnswering(BertConfig.from_json(tmp_path / "config.json")).eval()
    report = load_pretrained(ours, tmp_path)
    return hf, ours, report


def test_hf_qa_checkpoint_loads_with_the_same_logits_and_loss(tmp_path):
    hf, ours, report = _hf_pair(tmp_path)
    assert (report.missing, report.unexpected, report.mismatched) == ([], [], [])  # qa_outputs by name, no pooler
    assert not any(k.startswith("bert.pooler") for k in ours.state_dict())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 99, (3, 20), generator=g)
    types = torch.zeros_like(ids)
    types[:, 8:] = 1
    mask = torch.ones_like(ids)
    mask[1, 14:] = 0
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
        start, end = ours(ids, mask.bool(), types)
    real = mask.bool()
    assert torch.allclose(start[real], ref.start_logits[real], atol=1e-5)
    assert torch.allclose(end[real], ref.end_logits[real], atol=1e-5)

    # The objective's loss: HF's (CE(start) + CE(end)) / 2 where nothing is padded ...
    from hpcbert.data.features import Batch

    obj = get(RunConfig(task="squad", max_seq_length=20))
    full = [0, 2]
    y = torch.tensor([[9, 11], [0, 0]])
    batch = Batch(ids[full], types[full], None, y, 40)
    with torch.no_grad():
        want = hf(input_ids=ids[full], token_type_ids=types[full], start_positions=y[:, 0], end_positions=y[:, 1]).loss
        got = obj.loss(ours, obj.forward(ours, batch), batch, {"examples": 2.0})
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    # ... and padding does not change it (padded positions are out of the softmax): the first
    # 14 tokens of row 1 alone, then padded with 6 positions of any id.
    short = Batch(ids[1:2, :14], types[1:2, :14], None, y[:1], 14)
    padded_ids = torch.cat([ids[1:2, :14], torch.full((1, 6), 7)], 1)
    padded = Batch(padded_ids, types[1:2], mask[1:2].bool(), y[:1], 14)
    with torch.no_grad():
        a = obj.loss(ours, obj.forward(ours, short), short, {"examples": 1.0})
        b = obj.loss(ours, obj.forward(ours, padded), padded, {"examples": 1.0})
        rows = objectives.to_host(obj.predict(obj.forward(ours, padded), padded))
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    assert rows["start_logits"].shape == (1, 20) and (rows["start_logits"][0, 14:] <= -1e4).all()


# --- options, files and the feature cache ----------------------------------------------------------

def _check(**kw):
    cfg = RunConfig(task="squad", **kw)
    get(cfg).check(cfg)


def test_check_refuses_missing_files_wrong_versions_and_other_tasks_options(squad_files):
    d = squad_files
    with pytest.raises(ValueError, match=r"^train_file: .*--train-file"):
        _check()
    with pytest.raises(ValueError, match=r"^dev_file: .*--dev-file"):
        _check(train_file=str(d / "train.json"))
    _check(train_file=str(d / "train.json"), do_eval=False)
    with pytest.raises(ValueError, match=r"train_file: .*nope\.json does not exist"):
        _check(train_file=str(d / "nope.json"), do_eval=False)
    # a v1.1 run given a v2.0 file is refused, naming the file: asked for, or from the training file
    v2_file = rf"{d / 'train2.json'} is a SQuAD v2\.0 file"
    with pytest.raises(ValueError, match=rf"^train_file: {v2_file}.*--squad-version 1\.1"):
        _check(train_file=str(d / "train2.json"), dev_file=str(d / "dev2.json"), squad_version="1.1")
    with pytest.raises(ValueError, match=rf"^dev_file: {d / 'dev2.json'} is a SQuAD v2\.0 file.*--train-file"):
        _check(train_file=str(d / "train.json"), dev_file=str(d / "dev2.json"))
    _check(train_file=str(d / "train.json"), dev_file=str(d / "dev.json"), squad_version="2.0")  # v1.1 files: fine
    with pytest.raises(ValueError, match=r"^data_dir: an option of GLUE tasks"):
        _check(train_file=str(d / "train.json"), dev_file=str(d / "dev.json"), data_dir="glue")
    with pytest.raises(ValueError, match=r"^text_fields: an option of classify"):
        _check(train_file=str(d / "train.json"), dev_file=str(d / "dev.json"), text_fields="a,b")


def test_feature_cache_is_keyed_by_stride_and_query_length(squad_files, tmp_path):
    from hpcbert import zoo

    d = squad_files

    def load(**kw):
        cfg = RunConfig(task="squad", train_file=str(d / "train.json"), do_eval=False, tokenizer=str(d / "vocab"),
                        max_seq_length=64, cache_dir=str(tmp_path), model="bert-tiny", **kw)
        obj = get(cfg)
        obj.check(cfg)
        return obj.load(cfg, zoo.resolve("bert-tiny"))[0]

    a, b, c = load(doc_stride=16), load(doc_stride=32), load(doc_stride=16, max_query_length=4)
    assert len(list(tmp_path.glob("*.npz"))) == 3
    assert len(a) > len(b)  # starts 16 apart make more windows than 32 apart
    head = lambda f: np.add.reduceat(f.type_ids == 0, f.offsets[:-1])  # noqa: E731 - [CLS] question [SEP]
    assert head(c).max() == 4 + 2 < head(a).max()  # questions cut to 4 tokens
    again = load(doc_stride=16)  # a cache hit gives the same windows and read-back arrays
    assert again.fingerprint() == a.fingerprint()
    assert (again.char_offsets == a.char_offsets).all() and (again.example_index == a.example_index).all()
    assert len(again.examples) == 24 and len(a) == len(a.labels) == len(a.example_index)


# --- end to end ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def v1_run(squad_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("v1") / "run"
    r = hpcbert([*tiny_args(squad_files), "--batch-size", 8, "--max-steps", 12, "--out", out])
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _official_v1_reads(dev: Path, pred_file: Path) -> dict:
    """What evaluate-v1.1.py does with a prediction file: json.load it, then for every question of
    the dataset look its id up and normalise the prediction as a string."""
    dataset = json.loads(dev.read_text())["data"]
    preds = json.loads(pred_file.read_text())
    assert isinstance(preds, dict)
    for art in dataset:
        for para in art["paragraphs"]:
            for qa in para["qas"]:
                assert qa["id"] in preds and isinstance(preds[qa["id"]], str)
    return preds


def _nbest_ok(nbest: dict, preds: dict, n_best: int) -> None:
    assert set(nbest) == set(preds)
    for qid, cands in nbest.items():
        assert 1 <= len(cands) <= n_best + 1
        for c in cands:
            assert set(c) == {"text", "probability", "start_logit", "end_logit"}
            assert isinstance(c["text"], str) and all(isinstance(c[k], float) for k in ("probability", "start_logit",
                                                                                         "end_logit"))
        assert sum(c["probability"] for c in cands) == pytest.approx(1.0)
        totals = [c["start_logit"] + c["end_logit"] for c in cands if c["text"]]
        assert totals == sorted(totals, reverse=True)  # best first


@slow
def test_v1_run_writes_official_prediction_files(v1_run, squad_files):
    dev = squad_files / "dev.json"
    preds = _official_v1_reads(dev, v1_run / "predictions.json")
    nbest = json.loads((v1_run / "nbest_predictions.json").read_text())
    _nbest_ok(nbest, preds, 20)
    assert all(preds[q] == nbest[q][0]["text"] for q in preds)
    _, examples = read_squad(dev)
    for e in examples:  # every answer is a piece of its own context
        assert preds[e.id] in e.context
    s = read_summary(v1_run)
    ev = s["eval"]["dev"]
    want = evaluate_v1(examples, preds)
    assert (ev["exact_match"], ev["f1"]) == (pytest.approx(want["exact_match"]), pytest.approx(want["f1"]))
    assert s["task"] == "squad" and s["main_metric"] == "f1" and ev["unrecoverable_answers"] == 0
    assert not (v1_run / "null_odds.json").exists()
    cfg = json.loads((v1_run / "config.json").read_text())
    assert (cfg["doc_stride"], cfg["max_query_length"]) == (16, 16)


@slow
def test_two_processes_give_the_predictions_of_one(v1_run, squad_files, tmp_path):
    """Same global batch (8 = 2 x 4), dropout 0, fp32: the same training, and every dev window scored
    once (windows of one question may land on different ranks) and combined once."""
    out = tmp_path / "run"
    r = hpcbert([*tiny_args(squad_files), "--batch-size", 4, "--max-steps", 12, "--out", out], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    one = json.loads((v1_run / "predictions.json").read_text())
    two = json.loads((out / "predictions.json").read_text())
    assert one == two
    n1 = json.loads((v1_run / "nbest_predictions.json").read_text())
    n2 = json.loads((out / "nbest_predictions.json").read_text())
    assert [[c["text"] for c in n1[q]] for q in n1] == [[c["text"] for c in n2[q]] for q in n1]
    # Logits agree closely, not bit for bit: padding differs per rank (other SDPA shapes), and Adam
    # turns float noise in near-zero gradients into lr-sized steps.
    assert np.allclose([c["start_logit"] for q in n1 for c in n1[q]], [c["start_logit"] for q in n1 for c in n2[q]],
                       rtol=1e-2, atol=1e-3)
    s1, s2 = read_summary(v1_run), read_summary(out)
    assert s2["world_size"] == 2 and s1["global_batch_size"] == s2["global_batch_size"] == 8
    assert s2["eval"]["dev"]["f1"] == pytest.approx(s1["eval"]["dev"]["f1"])
    # the dev file really has questions spread over several windows
    from hpcbert.data.features import load_tokenizer
    from hpcbert.data.squad import build_features

    _, ex = read_squad(squad_files / "dev.json")
    f = build_features(ex, load_tokenizer(squad_files / "vocab", 64), 64, 16, 16)
    assert len(f) > 2 * len(ex) and np.bincount(f.example_index).max() >= 4


@slow
def test_v2_run_with_unanswerable_questions(squad_files, tmp_path):
    out = tmp_path / "run"
    r = hpcbert([*tiny_args(squad_files, "train2", "dev2"), "--batch-size", 8, "--max-steps", 12,
                 "--out", out])
    assert r.returncode == 0, r.stderr[-3000:]
    dev = squad_files / "dev2.json"
    version, examples = read_squad(dev)
    assert version == "2.0" and sum(e.is_impossible for e in examples) == len(examples) // 2
    preds = _official_v1_reads(dev, out / "predictions.json")  # the v2.0 script reads them the same way
    nbest = json.loads((out / "nbest_predictions.json").read_text())
    _nbest_ok(nbest, preds, 20)
    # evaluate-v2.0.py --na-prob-file: a float for every question id
    odds = json.loads((out / "null_odds.json").read_text())
    assert set(odds) == set(preds) and all(isinstance(v, float) for v in odds.values())
    for q in preds:
        # exactly one null ("") candidate; "" is predicted exactly when the null odds beat the threshold (0)
        assert sum(c["text"] == "" for c in nbest[q]) == 1
        best_span = next(c for c in nbest[q] if c["text"])
        assert preds[q] == ("" if odds[q] > 0.0 else best_span["text"])
    ev = read_summary(out)["eval"]["dev"]
    want = evaluate_v2(examples, preds, odds, na_prob_thresh=float("inf"))
    for k in ("exact", "f1", "HasAns_exact", "HasAns_f1", "NoAns_exact", "NoAns_f1", "best_exact", "best_f1",
              "best_exact_thresh", "best_f1_thresh"):
        assert ev[k] == pytest.approx(want[k]), k
    assert (ev["HasAns_total"], ev["NoAns_total"]) == (len(examples) // 2, len(examples) // 2)


@slow
def test_bad_input_exits_2_with_one_line_naming_the_file(squad_files, tmp_path):
    d = squad_files
    args = tiny_args(d, "train2", "dev2") + ["--squad-version", "1.1", "--out", tmp_path / "run"]
    r = hpcbert(args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(d / "train2.json") in lines[0] and "v2.0" in lines[0], r.stderr
    assert not (tmp_path / "run").exists()  # a run that cannot start leaves no directory
    r = hpcbert(["--task", "squad", "--model", "bert-tiny", "--out", tmp_path / "run"])
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "train_file" in r.stderr, r.stderr


@slow
def test_exported_qa_run_loads_in_transformers_and_reproduces_its_predictions(v1_run, squad_files, tmp_path):
    """hpcbert export RUN_DIR -> transformers' BertForQuestionAnswering: its logits on the dev
    windows (tokenised with the exported vocabulary) give the run's own predictions.json, and the
    start/end logits the run wrote in nbest_predictions.json within 1e-4."""
    from transformers import BertForQuestionAnswering as HFQA

    from hpcbert.data.features import load_tokenizer
    from hpcbert.data.squad import build_features, predict_answers

    hf_dir = tmp_path / "hf"
    r = subprocess.run([sys.executable, "-m", "hpcbert.cli", "export", str(v1_run), "--out", str(hf_dir)],
                       env=run_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == ["BertForQuestionAnswering"]
    model = HFQA.from_pretrained(hf_dir).eval()
    _, examples = read_squad(squad_files / "dev.json")
    f = build_features(examples, load_tokenizer(hf_dir, 64), 64, 16, 16)
    T = max(map(len, f.input_ids))
    ids = torch.zeros(len(f), T, dtype=torch.long)
    types = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for w, (x, t) in enumerate(zip(f.input_ids, f.type_ids)):
        ids[w, :len(x)], types[w, :len(x)], mask[w, :len(x)] = torch.from_numpy(x.astype(np.int64)), \
            torch.from_numpy(t.astype(np.int64)), 1
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, token_type_ids=types)
    preds, nbest, _ = predict_answers(examples, f, out.start_logits.numpy(), out.end_logits.numpy(), version="1.1")
    assert preds == json.loads((v1_run / "predictions.json").read_text())
    theirs = json.loads((v1_run / "nbest_predictions.json").read_text())
    for q in preds:
        assert [c["text"] for c in nbest[q]] == [c["text"] for c in theirs[q]]
        for k in ("start_logit", "end_logit"):
            assert np.allclose([c[k] for c in nbest[q]], [c[k] for c in theirs[q]], atol=1e-4), (q, k)
