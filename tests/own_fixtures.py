"""Tiny own-file data sets (CSV pairs, TSV single sentences, JSON Lines regression) and a tiny
random model with its own vocabulary (config.json + vocab.txt, no weights), for --task classify."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

POS = ["good", "great", "fine", "nice", "happy", "love"]
NEG = ["bad", "awful", "poor", "sad", "hate", "ugly"]
FILLER = ["the", "a", "movie", "film", "was", "is", "it", "this", "plot"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"
MAX_LEN = 32  # --max-seq-length of the tests (the model has 64 positions)


def write_model(d: Path) -> Path:
    """A Hugging Face-format directory with a config and a vocabulary but no weights: a 1-layer,
    32-wide BERT trained from random weights. vocab_size deliberately disagrees with vocab.txt: a
    random model's embeddings are sized to the vocabulary."""
    d.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *POS, *NEG, *FILLER, ",", ".", "!", '"',
             *LETTERS, *("##" + c for c in LETTERS)]
    vocab = list(dict.fromkeys(vocab))  # "a" is a word and a letter: each entry once
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (d / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    (d / "config.json").write_text(json.dumps(dict(
        model_type="bert", architectures=["BertForMaskedLM"], hidden_size=32, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=64, vocab_size=30522, max_position_embeddings=64)))
    return d


def _sentence(rng: random.Random, words: list[str]) -> str:
    return " ".join(rng.choice(FILLER) for _ in range(rng.randint(1, 4))) + " " + rng.choice(words)


def rows(kind: str, n: int, seed: int) -> list[dict]:
    """kind pairs: premise, hypothesis, label in {neg, pos}; single: text, label in {negative,
    neutral, positive}; regression: text, score (a float)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        s = rng.random()
        words = POS if s > 0.5 else NEG
        if kind == "pairs":
            # quoting matters in CSV: commas and doubled quotes inside fields
            out.append({"id": str(i), "premise": _sentence(rng, words) + ", " + rng.choice(FILLER),
                        "hypothesis": f'"{rng.choice(FILLER)}" {rng.choice(FILLER)}',
                        "label": "pos" if s > 0.5 else "neg"})
        elif kind == "single":
            out.append({"text": _sentence(rng, FILLER if 0.35 < s < 0.65 else words),
                        "label": "positive" if s >= 0.65 else "negative" if s <= 0.35 else "neutral"})
        else:
            out.append({"text": _sentence(rng, words), "score": round(5 * s, 2)})
    return out


FORMATS = {  # kind -> (extension, text fields, label field)
    "pairs": ("csv", "premise,hypothesis", "label"),
    "single": ("tsv", "text", "label"),
    "regression": ("jsonl", "text", "score"),
}


def write_rows(path: Path, records: list[dict], columns: list[str]) -> Path:
    fmt = path.suffix[1:]
    with open(path, "w", newline="", encoding="utf-8") as f:
        if fmt == "jsonl":
            for r in records:
                f.write(json.dumps({c: (float(r[c]) if c == "score" else r[c]) for c in columns if c in r}) + "\n")
        else:
            w = csv.writer(f, delimiter="," if fmt == "csv" else "\t", lineterminator="\n",
                           quoting=csv.QUOTE_MINIMAL if fmt == "csv" else csv.QUOTE_NONE)
            w.writerow(columns)
            for r in records:
                w.writerow([r[c] for c in columns])
    return path


def write_data(d: Path, kind: str, n_train: int = 48, n_dev: int = 20, n_test: int = 9) -> dict[str, Path]:
    """train/dev/test files of one kind; the test file has no label column."""
    ext, text_fields, label = FORMATS[kind]
    texts = text_fields.split(",")
    d.mkdir(parents=True, exist_ok=True)
    train_cols = (["id"] if kind == "pairs" else []) + texts + [label]
    dev_cols = [label] + texts + (["id"] if kind == "pairs" else [])  # other order than train: found by name
    return {"train": write_rows(d / f"train.{ext}", rows(kind, n_train, 1), train_cols),
            "dev": write_rows(d / f"dev.{ext}", rows(kind, n_dev, 2), dev_cols),
            "test": write_rows(d / f"test.{ext}", rows(kind, n_test, 3), texts)}


def read_texts(path: Path, text_fields: str) -> list[tuple]:
    """(line, texts...) of every record, read with csv / json directly (not hpcbert's reader)."""
    fields = text_fields.split(",")
    if path.suffix == ".jsonl":
        return [(i, *(json.loads(line)[c] for c in fields))
                for i, line in enumerate(path.read_text().splitlines(), 1)]
    with open(path, newline="", encoding="utf-8") as f:
        r = csv.reader(f, delimiter="," if path.suffix == ".csv" else "\t")
        header = next(r)
        out = []
        start = 2
        for row in r:
            out.append((start, *(row[header.index(c)] for c in fields)))
            start = r.line_num + 1
        return out


def read_labels(path: Path, label: str) -> list:
    if path.suffix == ".jsonl":
        return [json.loads(line)[label] for line in path.read_text().splitlines()]
    with open(path, newline="", encoding="utf-8") as f:
        return [row[label] for row in csv.DictReader(f, delimiter="," if path.suffix == ".csv" else "\t")]
