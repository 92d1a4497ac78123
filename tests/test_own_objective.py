"""--task classify end to end on CSV, TSV and JSON Lines files (pairs, single sentences,
regression), checked against transformers on the run's own exported model; every kind of bad
input is one line naming file, line and field; random models sized to a user's vocabulary; the
Chinese vocabulary against the reference (Python) BERT tokenizer."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest

from conftest import ROOT
from own_fixtures import FORMATS, MAX_LEN, read_labels, read_texts, write_data, write_model, write_rows
from hpcbert import zoo
from hpcbert.cli import main
from hpcbert.runfiles import read_summary

CHINESE = ROOT.parent / "shared" / "data" / "chinese"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model") / "tiny")


def train_args(files: dict, kind: str, model_dir, out, *extra) -> list[str]:
    _, text_fields, label = FORMATS[kind]
    args = ["train", "--task", "classify", "--train-file", files["train"], "--text-fields", text_fields,
            "--label-field", label, "--model", model_dir, "--max-seq-length", MAX_LEN, "--batch-size", 8,
            "--lr", "1e-3", "--threads", 1, "--log-every", 1, "--out", out,
            # fp32: the run's figures are recomputed with transformers in fp32 (`auto` is bf16 on a CPU
            # with native bf16, and a random model's near-constant outputs then score differently).
            "--precision", "fp32", *extra]
    if kind == "regression":
        args.append("--regression")
    return [str(a) for a in args]


def hf_outputs(model_path, records: list[tuple]) -> np.ndarray:
    """Logits of transformers' BertForSequenceClassification and BertTokenizer, both loaded from
    `model_path`, for (line, text_a[, text_b]) records."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    model = AutoModelForSequenceClassification.from_pretrained(str(model_path)).eval()
    a = [r[1] for r in records]
    b = [r[2] for r in records] if len(records[0]) > 2 else None
    enc = tok(a, b, truncation=True, max_length=MAX_LEN, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).logits.numpy()


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(FORMATS))
def test_classify_end_to_end(tmp_path, model_dir, kind, capsys):
    """Train, score the dev file, predict the unlabelled test file. The dev metrics and every
    prediction are recomputed with transformers from the run's final model (RUN_DIR/model) on the
    texts read with csv/json directly, and scored with scikit-learn / scipy."""
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import accuracy_score, f1_score

    files = write_data(tmp_path / "data", kind)
    out = tmp_path / "run"
    assert main(train_args(files, kind, model_dir, out, "--dev-file", files["dev"], "--test-file", files["test"],
                           "--max-steps", 6)) == 0
    err = capsys.readouterr().err
    s = read_summary(out)
    assert s["task"] == "classify" and s["model_is_random"] is True and "RANDOM weights" in err
    assert "word embeddings sized to the vocabulary" in err and "test" not in s["eval"]
    _, text_fields, label = FORMATS[kind]
    dev = read_texts(files["dev"], text_fields)
    dev_logits = hf_outputs(out / "model", dev)
    test = read_texts(files["test"], text_fields)
    test_logits = hf_outputs(out / "model", test)
    with open(out / "predictions.tsv", newline="") as f:
        pred_rows = list(csv.reader(f, delimiter="\t"))
    assert pred_rows[0] == ["index", "line", "prediction"]
    assert [(int(i), int(line)) for i, line, _ in pred_rows[1:]] == [(i, r[0]) for i, r in enumerate(test)]
    if kind == "regression":
        gold = [float(v) for v in read_labels(files["dev"], label)]
        assert s["main_metric"] == "pearson" and set(s["eval"]["dev"]) == {"pearson", "spearman", "loss"}
        assert s["eval"]["dev"]["pearson"] == pytest.approx(pearsonr(dev_logits[:, 0], gold)[0], abs=1e-4)
        assert s["eval"]["dev"]["spearman"] == pytest.approx(spearmanr(dev_logits[:, 0], gold)[0], abs=1e-4)
        assert s["eval"]["dev"]["loss"] == pytest.approx(np.mean((dev_logits[:, 0] - gold) ** 2), rel=1e-4)
        assert [float(p) for *_, p in pred_rows[1:]] == pytest.approx(test_logits[:, 0].tolist(), abs=1e-4)
        assert not (out / "labels.json").exists()
        assert json.loads((out / "model" / "config.json").read_text())["problem_type"] == "regression"
        return
    names = sorted(set(read_labels(files["train"], label)))  # sorted as text (none is an integer)
    assert json.loads((out / "labels.json").read_text()) == names
    id2label = json.loads((out / "model" / "config.json").read_text())["id2label"]
    assert id2label == {str(i): n for i, n in enumerate(names)}
    gold = [names.index(v) for v in read_labels(files["dev"], label)]
    pred = dev_logits.argmax(-1)
    assert s["main_metric"] == "accuracy" and set(s["eval"]["dev"]) == {"accuracy", "f1_macro", "loss"}
    assert s["eval"]["dev"]["accuracy"] == pytest.approx(accuracy_score(gold, pred), abs=1e-12)
    assert s["eval"]["dev"]["f1_macro"] == pytest.approx(f1_score(gold, pred, average="macro"), abs=1e-12)
    assert [p for *_, p in pred_rows[1:]] == [names[i] for i in test_logits.argmax(-1)]


# --- bad input: one line naming the file, the line and the field; no run directory ------------------

def _corrupt(files: dict, kind: str, fault: str) -> tuple[str, str]:
    """Rewrite one file of a good data set with one fault; returns (file:line: prefix, words)."""
    ext, text_fields, label = FORMATS[kind]
    text = text_fields.split(",")[0]
    if fault == "unseen dev label":
        path = files["dev"]
        lines = path.read_text().splitlines(keepends=True)
        n = 3 if ext != "jsonl" else 2  # the second record (after the header)
        if ext == "jsonl":
            rec = json.loads(lines[n - 1])
            rec[label] = "meh"
            lines[n - 1] = json.dumps(rec) + "\n"
        else:
            sep = "," if ext == "csv" else "\t"
            cols = lines[0].rstrip("\n").split(sep)
            cells = next(csv.reader([lines[n - 1]], delimiter=sep))
            cells[cols.index(label)] = "meh"
            buf = io.StringIO()
            csv.writer(buf, delimiter=sep, lineterminator="\n").writerow(cells)
            lines[n - 1] = buf.getvalue()
        path.write_text("".join(lines))
        return f"{path}:{n}: {label}: label 'meh' is not in the training label set", "label"
    if fault == "missing column":
        path = files["dev"]
        if ext == "jsonl":
            recs = [json.loads(x) for x in path.read_text().splitlines()]
            del recs[0][text]
            path.write_text("".join(json.dumps(r) + "\n" for r in recs))
            return f"{path}:1: {text}: no such column", text
        with open(path, newline="") as f:
            recs = list(csv.DictReader(f, delimiter="," if ext == "csv" else "\t"))
        cols = [c for c in recs[0] if c != text]
        write_rows(path, recs, cols)
        return f"{path}:2: {text}: no such column", text
    if fault == "empty text":
        path = files["train"]
        if ext == "jsonl":
            recs = [json.loads(x) for x in path.read_text().splitlines()]
            recs[4][text] = "   "
            path.write_text("".join(json.dumps(r) + "\n" for r in recs))
            return f"{path}:5: {text}: empty text", text
        with open(path, newline="") as f:
            recs = list(csv.DictReader(f, delimiter="," if ext == "csv" else "\t"))
        recs[3][text] = ""
        write_rows(path, recs, list(recs[0]))
        return f"{path}:5: {text}: empty text", text
    assert fault == "malformed line"
    path = files["train"]
    lines = path.read_text().splitlines(keepends=True)
    if ext == "jsonl":
        lines[6] = lines[6].rstrip("\n}") + ",\n"  # unterminated object
        path.write_text("".join(lines))
        return f"{path}:7: malformed JSON", "JSON"
    sep = "," if ext == "csv" else "\t"
    lines[6] = lines[6].rstrip("\n") + sep + "extra\n"
    path.write_text("".join(lines))
    width = len(lines[0].split(sep))
    return f"{path}:7: {width + 1} fields, the header has {width}", "fields"


@pytest.mark.parametrize("kind", list(FORMATS))
@pytest.mark.parametrize("fault", ["unseen dev label", "missing column", "empty text", "malformed line"])
def test_bad_input_is_one_line_naming_file_line_and_field(tmp_path, model_dir, kind, fault, capsys):
    if fault == "unseen dev label" and kind == "regression":
        pytest.skip("regression has no label set")
    files = write_data(tmp_path / "data", kind, n_train=12, n_dev=4, n_test=2)
    prefix, words = _corrupt(files, kind, fault)
    out = tmp_path / "run"
    rc = main(train_args(files, kind, model_dir, out, "--dev-file", files["dev"], "--max-steps", 1))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert rc == 2 and "Traceback" not in err and len(errors) == 1, err
    assert errors[0].startswith(f"hpcbert train: error: {prefix}") and words in errors[0]
    assert not out.exists()  # a failed start leaves nothing behind


@pytest.mark.parametrize("change, expected", [
    ({"--train-file": None}, "train_file: --task classify trains on your own file"),
    ({"--text-fields": None}, "text_fields: name the text column"),
    ({"--text-fields": "a,b,c"}, "text_fields: 'a,b,c'; expected one column name"),
    ({"--label-field": "premise"}, "label_field: 'premise' is also a text field"),
    ({"--dev-file": None}, "dev_file: --do-eval (the default) scores the model on --dev-file"),
    ({"--no-do-eval": True, "--test-file": "TEST"}, "test_file: --test-file is predicted when the run evaluates"),
    ({"--dev-file": "nowhere.csv"}, "dev_file: nowhere.csv does not exist"),
    ({"--data-dir": "glue"}, "data_dir: an option of GLUE tasks and mlm, not used by --task classify (which reads "
                             "--train-file"),
    ({"--doc-stride": "64"}, "doc_stride: an option of squad, not used by --task classify"),
    ({"--whole-word-masking": True}, "whole_word_masking: an option of mlm, not used by --task classify"),
    ({"--format": "parquet"}, "format: 'parquet' is not accepted; choose one of csv, tsv, jsonl"),
])
def test_options_the_task_needs_are_named(tmp_path, model_dir, change, expected, capsys):
    files = write_data(tmp_path / "data", "pairs", n_train=4, n_dev=2, n_test=1)
    opts = {"--train-file": files["train"], "--dev-file": files["dev"], "--text-fields": "premise,hypothesis"}
    opts.update({k: (files["test"] if v == "TEST" else v) for k, v in change.items()})
    args = ["train", "--task", "classify", "--model", str(model_dir), "--out", str(tmp_path / "run")]
    for k, v in opts.items():
        if v is True:
            args.append(k)
        elif v is not None:
            args += [k, str(v)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"hpcbert train: error: {expected}" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_a_training_file_with_one_class_is_refused(tmp_path, model_dir, capsys):
    path = write_rows(tmp_path / "one.csv", [{"text": "good film", "label": "pos"}] * 3, ["text", "label"])
    assert main(["train", "--task", "classify", "--train-file", str(path), "--text-fields", "text", "--no-do-eval",
                 "--model", str(model_dir), "--out", str(tmp_path / "run")]) == 2
    assert f"{path}: label: every row has the label 'pos'; classification needs two classes" in capsys.readouterr().err


# --- models: named small shapes, random models sized to the user's vocabulary ------------------------

def test_small_named_shapes_are_turc_et_al():
    # Turc et al. 2019, "Well-Read Students Learn Better", Table 6: (layers, hidden); heads = hidden / 64, FFN 4h
    for name, (L, H) in {"bert-tiny": (2, 128), "bert-mini": (4, 256), "bert-small": (4, 512),
                         "bert-medium": (8, 512), "bert-base": (12, 768)}.items():
        c = zoo.resolve(name).config
        assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.intermediate_size) == (L, H, H // 64, 4 * H)


def test_random_models_take_the_vocabulary_size_of_the_tokenizer(tmp_path, model_dir):
    n = len((model_dir / "vocab.txt").read_text().splitlines())
    own = zoo.resolve(str(model_dir))  # config.json says 30522; its vocab.txt has n entries
    assert own.is_random and own.config.vocab_size == n and str(n) in own.vocab_note
    mini = zoo.resolve("bert-mini", str(model_dir))
    assert mini.is_random and mini.config.vocab_size == n and mini.config.hidden_size == 256
    # a run directory is not a model: its config.json holds hpcbert's options
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"task": "classify"}))
    (run / "model" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=f"not a Hugging Face BERT config.*its final model is {run / 'model'}"):
        zoo.resolve(str(run))


# --- Chinese: the bert-base-chinese vocabulary against the reference tokenizer ------------------------

def test_chinese_tokenisation_matches_the_reference_tokenizer_on_hard_cases():
    """Every CJK character its own token, accents kept (the vocabulary is cased: do_lower_case
    false), full-width punctuation and forms, CJK extension characters, emoji, control and
    zero-width characters: hpcbert's ids equal those of transformers' Python port of Google's
    tokenization.py (BertTokenizerLegacy) and of its fast tokenizer. The whole of ChnSentiCorp is
    compared in test_own_data.py."""
    transformers = pytest.importorskip("transformers")
    src = CHINESE / "bert-base-chinese"
    if not (src / "vocab.txt").is_file():
        pytest.skip(f"bert-base-chinese vocabulary not found at {src}")
    from hpcbert.data.features import load_tokenizer

    texts = ["酒店环境很好，服务也不错！", "Café résumé naïve ÀÉÎ", "ＡＢＣ１２３，。！？【】（）“”‘’",
             "这本书《三体》真的好看～～", "𠀀𪜀 丗 㐀", "iPhone XP 手机😀 好", "tab\there\u200bzero\u00a0nbsp",
             "混合English和中文123abc", "ﬁ ligature ½ ²", "Ｗｉｎｄｏｗｓ　全角空格"]
    ours = [e.ids for e in load_tokenizer(src, 512).encode_batch(texts)]
    legacy = getattr(transformers, "BertTokenizerLegacy", None) or transformers.BertTokenizer
    ref = legacy(str(src / "vocab.txt"), do_lower_case=False)
    fast = transformers.AutoTokenizer.from_pretrained(str(src))
    assert ours == ref(texts)["input_ids"]
    assert ours == fast(texts)["input_ids"]


def test_a_file_to_predict_needs_no_label_column_but_its_texts_are_checked(tmp_path):
    from hpcbert.data.own import read_classification

    p = write_rows(tmp_path / "test.csv", [{"text": "good film"}, {"text": "bad plot"}], ["text"])
    d = read_classification(p, "text", "label", labels=("neg", "pos"), labelled=False)
    assert [(e.text_a, e.label, e.line) for e in d.examples] == [("good film", 0, 2), ("bad plot", 0, 3)]
    p = write_rows(tmp_path / "bad.csv", [{"text": "good film"}, {"text": " "}], ["text"])
    with pytest.raises(ValueError, match=rf"^{p}:3: text: empty text"):
        read_classification(p, "text", "label", labelled=False)
