"""Objectives: what a run needs from a task, in one small protocol. The trainer knows no task by name.

An objective provides
    check(cfg)                 -> None; refuses options the task cannot use, naming the field (before
                                  any data or model is loaded)
    load(cfg, src)             -> train data + dev/test splits (tokenised once, cached): `Dataset`s
    build_model(model_cfg)     -> the task's head on top of the shared BertModel (`.bert`), HF names
    collate(data, idx, pad_to, epoch)
                               -> a Batch. `epoch` is the training epoch (an objective that draws
                                  random targets, such as masked-LM, draws them from (seed, epoch,
                                  example) so every pass is fresh and any rank count sees the same
                                  ones); None means evaluation: fixed, reproducible targets
    norm(data, idx, epoch)     -> the global batch's normalisers (host numbers, e.g. {"examples": 32},
                                  {"masked": 611, "examples": 32}); computed by every rank from the
                                  whole global batch, so no collective is needed
    forward(model, batch)      -> the model's outputs (called on the DDP/compiled wrapper)
    head_rows(batch)           -> how many positions of the batch the head reads from the last layer
                                  (the model computes its last layer there only), None = every token;
                                  for the FLOPs a step counts (model.batch_flops)
    head_flops(batch, model_cfg)
                               -> training FLOPs of the head's matrix products on this batch
                                  (model.linear_flops), added to the encoder's in the FLOPs a step
                                  counts (model FLOPs: MFU)
    loss(model, out, b, norm)  -> this micro-batch's share of the global batch's loss: its sums divided
                                  by `norm` (the trainer only scales for DDP's averaging)
    predict(out, batch)        -> {name: array with one row per example} (dev/test): predictions,
                                  per-example loss terms, whatever `evaluate` needs
    evaluate(split, preds, data)-> Evaluation: the split's official metrics (and "loss") from `preds`
                                  in dataset order, and files for the run directory (predictions)
    example_batch(b, T, vocab) -> (Batch, norm) of b sequences of T tokens, for memory measurements
    hf_config()                -> extra keys of an exported Hugging Face config.json (architectures,
                                  id2label, ...); architectures[0] is the name of the model.py class
                                  build_model returns (hpcbert export rebuilds it from a checkpoint)
Throughput is counted in sequences (examples of a batch) and tokens (`Batch.real_tokens`).

A `Dataset` is anything with `len()`, `.lengths` (tokens per example, for the sampler and for
evaluation order) and `.fingerprint()` (changes when the token ids or targets change: resume
refuses other data); `data.features.Features` is the common one.

`get(cfg)` returns the objective of `cfg.task`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from ..config import RunConfig
    from ..data.features import Batch
    from ..model import BertConfig
    from ..zoo import ModelSource


class Dataset(Protocol):
    lengths: np.ndarray

    def __len__(self) -> int: ...
    def fingerprint(self) -> str: ...


@dataclass
class Evaluation:
    """What evaluating one split gives: metrics (floats, the split's official ones and "loss" where
    the split has targets) and files to write into the run directory ({file name: text})."""

    metrics: dict[str, float]
    files: dict[str, str] = field(default_factory=dict)


class Objective(Protocol):
    name: str           # task name in summaries and tables
    main_metric: str    # the dev metric a table leads with

    def check(self, cfg: "RunConfig") -> None: ...
    def load(self, cfg: "RunConfig", src: "ModelSource") -> tuple[Dataset, dict[str, Dataset]]: ...
    def build_model(self, model_cfg: "BertConfig") -> nn.Module: ...
    def collate(self, data: Dataset, indices: Any, pad_to: int | None = None,
                epoch: int | None = None) -> "Batch": ...
    def norm(self, data: Dataset, indices: np.ndarray, epoch: int | None) -> dict[str, float]: ...
    def forward(self, model: nn.Module, batch: "Batch") -> Any: ...
    def head_rows(self, batch: "Batch") -> int | None: ...
    def head_flops(self, batch: "Batch", model_cfg: "BertConfig") -> float: ...
    def loss(self, model: nn.Module, outputs: Any, batch: "Batch", norm: dict[str, float]) -> torch.Tensor: ...
    def predict(self, outputs: Any, batch: "Batch") -> dict[str, torch.Tensor]: ...  # on the device
    def evaluate(self, split: str, predictions: dict[str, np.ndarray], data: Dataset) -> Evaluation: ...
    def example_batch(self, batch_size: int, seq_len: int, vocab_size: int) -> tuple["Batch", dict[str, float]]: ...
    def hf_config(self) -> dict[str, Any]: ...


def to_host(predictions: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """An objective's predictions for one batch (tensors on the device, rows in the batch's order),
    as its evaluate() takes them once gathered. Objectives compute them on the device, so what an
    evaluation's batch holds there is its forward's and predict's alone (hpcbert plan counts both)."""
    return {name: t.cpu().numpy() for name, t in predictions.items()}


# task name -> "module:Class"; the class's `from_config(cfg)` builds it. Other names: GLUE or synthetic.
_REGISTRY = {
    "mlm": "mlm:MaskedLM",
    "squad": "squad:QuestionAnswering",
    "classify": "own:OwnClassification",
}
TASKS_HELP = ("a GLUE task (cola, sst-2, mrpc, sts-b, qqp, mnli, qnli, rte, wnli), squad, classify (your "
              "own CSV/TSV/JSONL files), mlm (masked-LM pre-training) or synthetic (no files needed)")

# RunConfig fields that only some tasks read -> those tasks ("glue": the GLUE tasks). Each objective's
# check() refuses one set away from its default for a task that does not read it (refuse_unread):
# an option given is used or refused, never silently ignored. (--target-mlm-accuracy: the trainer
# refuses it for a task without a masked-LM accuracy.)
TASK_OPTIONS: dict[str, tuple[str, ...]] = {
    "data_dir": ("glue", "mlm"),
    "train_file": ("squad", "classify"), "dev_file": ("squad", "classify"),
    "cache_dir": ("glue", "squad", "classify"),  # tokenised features; mlm's data is prepared once, synthetic's drawn
    **dict.fromkeys(("test_file", "text_fields", "label_field", "format", "regression"), ("classify",)),
    **dict.fromkeys(("doc_stride", "max_query_length", "n_best_size", "max_answer_length",
                     "null_score_diff_threshold", "squad_version"), ("squad",)),
    **dict.fromkeys(("mask_prob", "whole_word_masking", "nsp", "eval_data"), ("mlm",)),
    **dict.fromkeys(("synthetic_train_size", "synthetic_dev_size"), ("synthetic",)),
}
_TASK_WORDS = {"glue": "GLUE tasks", "squad": "squad", "classify": "classify", "mlm": "mlm", "synthetic": "synthetic"}
_TASK_READS = {"glue": "which reads the GLUE files in --data-dir", "squad": "which reads --train-file and --dev-file",
               "classify": "which reads --train-file, --dev-file and --test-file",
               "mlm": "which reads the prepared data in --data-dir", "synthetic": "which generates its data"}


def _kind(task: str) -> str:
    task = task.lower()
    return task if task in _TASK_WORDS else "glue"


def task_reads(task: str, name: str) -> bool:
    """Whether a run of `task` reads the RunConfig field `name` (every field not in TASK_OPTIONS)."""
    return name not in TASK_OPTIONS or _kind(task) in TASK_OPTIONS[name]


def refuse_unread(cfg: "RunConfig") -> None:
    """ValueError naming the first option of TASK_OPTIONS that `cfg` sets (away from RunConfig's
    default) and `cfg.task` does not read. Reads no file: `hpcbert submit` calls it before the
    queue wait, each objective's check() before anything is loaded."""
    from dataclasses import fields

    defaults = {f.name: f.default for f in fields(cfg)}
    for name, kinds in TASK_OPTIONS.items():
        if not task_reads(cfg.task, name) and getattr(cfg, name) != defaults[name]:
            words = [_TASK_WORDS[k] for k in kinds]
            tasks = " and ".join([", ".join(words[:-1]), words[-1]] if len(words) > 1 else words)
            raise ValueError(f"{name}: an option of {tasks}, not used by --task {cfg.task} "
                             f"({_TASK_READS[_kind(cfg.task)]}); leave it out")


def get(cfg: "RunConfig") -> Objective:
    """The objective that trains `cfg.task`."""
    import importlib

    if cfg.task in _REGISTRY:
        module, cls = _REGISTRY[cfg.task].split(":")
        return getattr(importlib.import_module(f".{module}", __name__), cls).from_config(cfg)
    from .classification import SequenceClassification

    return SequenceClassification.from_config(cfg)
