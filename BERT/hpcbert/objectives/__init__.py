"""Objectives: what a run needs from a task, in one small protocol. The trainer knows no task by name.

An objective provides
    load(cfg, src)            -> train features + dev splits (tokenised once, from the feature cache)
    build_model(model_cfg)    -> the task's head on top of the shared BertModel (`.bert`), HF names
    collate(feats, idx, pad)  -> a Batch (dynamic padding; real-token count for throughput)
    forward(model, batch)     -> the model's outputs (called on the DDP/compiled wrapper)
    loss_sum(model, out, b)   -> the loss summed over the batch's examples (the trainer normalises)
    predict(out, batch)       -> one numpy row per example (dev): the objective's predictions
    metrics(split, preds)     -> the official metrics of the split, from predictions in dataset order
    example_batch(b, T, vocab)-> a batch of b sequences of T tokens, for memory measurements
Throughput is counted in sequences (examples of a batch) and tokens (`Batch.real_tokens`).

`get(cfg)` returns the objective of `cfg.task`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from ..config import RunConfig
    from ..data.features import Batch, Features
    from ..model import BertConfig
    from ..zoo import ModelSource


class Objective(Protocol):
    name: str           # task name in summaries and tables
    main_metric: str    # the dev metric a table leads with

    def load(self, cfg: "RunConfig", src: "ModelSource") -> tuple["Features", dict[str, "Features"]]: ...
    def build_model(self, model_cfg: "BertConfig") -> nn.Module: ...
    def collate(self, feats: "Features", indices: Any, pad_to: int | None = None) -> "Batch": ...
    def forward(self, model: nn.Module, batch: "Batch") -> Any: ...
    def loss_sum(self, model: nn.Module, outputs: Any, batch: "Batch") -> torch.Tensor: ...
    def predict(self, outputs: Any, batch: "Batch") -> np.ndarray: ...
    def metrics(self, split: str, predictions: np.ndarray, feats: "Features") -> dict[str, float]: ...
    def example_batch(self, batch_size: int, seq_len: int, vocab_size: int) -> "Batch": ...


def get(cfg: "RunConfig") -> Objective:
    """The objective that trains `cfg.task`."""
    from .classification import SequenceClassification

    return SequenceClassification.for_task(cfg.task)
