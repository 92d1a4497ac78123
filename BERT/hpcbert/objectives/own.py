"""Classification and regression on a user's own CSV, TSV or JSON Lines files (`--task classify`).

The GLUE objective with other data: the same head ([CLS] pooled -> dropout -> linear), loss,
batches and predictions (`SequenceClassification`), read from --train-file / --dev-file /
--test-file by column name (data/own.py). The class names are the training file's labels, sorted
(integers by value, anything else as text), so a class keeps its index whatever the row order;
they are written into the run directory (labels.json) and the exported config.json (id2label).

Metrics. Classification: accuracy (the headline, as BERT's run_classifier and the Trainer's
text-classification example report it) and macro F1 (the unweighted mean of the per-class F1, the
same for 2 classes or 20 and whichever class is called positive). Regression (--regression):
Pearson and Spearman correlation; "loss" is then the mean squared error.

Predictions. An unlabelled --test-file (its label column may be absent) is predicted when the
run evaluates, into RUN_DIR/predictions.tsv: a header `index, line, prediction`, then one row per
test example in file order: its 0-based position (the Trainer's predict_results `index`), the line
of the test file it starts on, and the predicted class name (or, for regression, the predicted
number). Tab-separated, written by Python's csv module (a class name holding a tab, a quote or a
newline is quoted).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..config import RunConfig
from ..data.features import Features, cached_features, tokenize_examples
from ..data.glue import TaskSpec
from ..data.metrics import accuracy, f1_macro, pearson, spearman
from ..data.own import _fmt, _text_fields, label_set, read_classification
from ..zoo import ModelSource
from . import Evaluation, refuse_unread
from .classification import SequenceClassification

_FILES = ("train_file", "dev_file", "test_file")


@dataclass
class OwnClassification(SequenceClassification):
    """`SequenceClassification` on a user's files; the label set is known once `load` has read
    the training file (the head is built after that)."""

    text_fields: list[str] = field(default_factory=list)
    label_field: str = "label"
    format: str | None = None
    regression: bool = False
    test_lines: np.ndarray | None = None  # file line of every test example, for predictions.tsv

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "OwnClassification":
        spec = TaskSpec(name="classify", folder="", train_file=cfg.train_file or "", dev_files={"dev": ""},
                        labels=None if cfg.regression else (), main_metric="pearson" if cfg.regression else "accuracy")
        return cls(spec, text_fields=[t.strip() for t in (cfg.text_fields or "").split(",")],
                   label_field=cfg.label_field, format=cfg.format, regression=cfg.regression)

    def check(self, cfg: RunConfig) -> None:
        refuse_unread(cfg)
        if not cfg.train_file:
            raise ValueError("train_file: --task classify trains on your own file; pass --train-file FILE (CSV, TSV "
                             "or JSON Lines, with a header row)")
        if not cfg.text_fields:
            raise ValueError("text_fields: name the text column of your files: --text-fields COLUMN, or "
                             "--text-fields A,B for sentence pairs")
        try:
            tf = _text_fields(cfg.text_fields)
        except ValueError as e:
            raise ValueError(f"text_fields: {str(e).removeprefix('text fields: ')}") from None
        if cfg.label_field in tf:
            raise ValueError(f"label_field: {cfg.label_field!r} is also a text field (--text-fields {cfg.text_fields})")
        if cfg.do_eval and not (cfg.dev_file or cfg.test_file):
            raise ValueError("dev_file: --do-eval (the default) scores the model on --dev-file; pass --dev-file FILE, "
                             "--test-file FILE (predictions only) or --no-do-eval")
        if cfg.test_file and not cfg.do_eval:
            raise ValueError("test_file: --test-file is predicted when the run evaluates; drop --no-do-eval")
        for name in _FILES:
            path = getattr(cfg, name)
            if path is None:
                continue
            if not Path(path).is_file():
                raise ValueError(f"{name}: {path} does not exist or is not a file")
            _fmt(Path(path), cfg.format)  # the format must be known (extension or --format)

    def load(self, cfg: RunConfig, src: ModelSource) -> tuple[Features, dict[str, Features]]:
        """Label set from the training file; features of every file (cached; dev labels must be in
        the training label set); the test file's lines, for predictions.tsv."""
        tok = self.tokenizer(cfg, src)
        labels = None
        if not self.regression:
            labels = label_set(cfg.train_file, self.label_field, self.format)
            if len(labels) < 2:
                raise ValueError(f"{cfg.train_file}: {self.label_field}: every row has the label {labels[0]!r}; "
                                 f"classification needs two classes or more (numbers to predict: --regression)")
        self.spec = replace(self.spec, labels=labels)

        def features(path: str, labelled: bool, data=None) -> Features:
            def build() -> Features:
                d = data or read_classification(path, self.text_fields, self.label_field, self.format,
                                                 labels=labels, regression=self.regression)
                return tokenize_examples(tok, d.examples)

            # The same file read with other columns, labels or format gives other features.
            how = json.dumps([self.text_fields, self.label_field, self.format, self.regression, labels, labelled])
            params = {"own": hashlib.sha256(how.encode()).hexdigest()[:12]}
            return cached_features(Path(path), tok, cfg.max_seq_length, build, cfg.cache_dir, params=params)[0]

        train = features(cfg.train_file, True)
        splits: dict[str, Features] = {}
        if cfg.do_eval and cfg.dev_file:
            splits["dev"] = features(cfg.dev_file, True)
        if cfg.do_eval and cfg.test_file:
            test = read_classification(cfg.test_file, self.text_fields, self.label_field, self.format,
                                       labels=labels, regression=self.regression, labelled=False)
            self.test_lines = np.array([e.line for e in test.examples])
            splits["test"] = features(cfg.test_file, False, test)
        return train, splits

    def evaluate(self, split: str, predictions: dict[str, np.ndarray], feats: Features) -> Evaluation:
        pred = predictions["pred"]
        if split == "test":  # unlabelled: predictions only, no metrics
            return Evaluation({}, {"predictions.tsv": self.predictions_tsv(pred)})
        if self.regression:
            metrics = {"pearson": pearson(pred, feats.labels), "spearman": spearman(pred, feats.labels)}
        else:
            metrics = {"accuracy": accuracy(pred, feats.labels), "f1_macro": f1_macro(pred, feats.labels)}
        return Evaluation({**metrics, "loss": float(np.mean(predictions["loss"]))})

    def predictions_tsv(self, pred: np.ndarray) -> str:
        """predictions.tsv (see the module docstring) from predictions in test-file order."""
        buf = io.StringIO()
        w = csv.writer(buf, delimiter="\t", lineterminator="\n")
        w.writerow(["index", "line", "prediction"])
        for i, (line, p) in enumerate(zip(self.test_lines, pred)):
            w.writerow([i, int(line), str(np.float32(p)) if self.regression else self.spec.labels[int(p)]])
        return buf.getvalue()

    def hf_config(self) -> dict[str, Any]:
        cfg = super().hf_config()
        if not self.regression:
            cfg["problem_type"] = "single_label_classification"
        return cfg
