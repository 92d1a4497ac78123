"""Masked-LM pre-training (`--task mlm`) on the output of `hpcbert prepare-pretraining`.

Samples (data/packing.py): RoBERTa's FULL-SENTENCES by default (whole lines packed up to
--max-seq-length across documents, a [SEP] between documents), or BERT's sentence pairs with
--nsp. Masks (data/masking.py): drawn on the fly from (seed, epoch, sequence), 80% [MASK] / 10%
random / 10% unchanged, --mask-prob of the candidate tokens, --whole-word-masking; evaluation uses a
fixed mask that does not depend on the run's seed, so runs are scored on the same targets.

Model: HF's BertForMaskedLM (BertForPreTraining with --nsp), whose vocabulary projection runs only
at the masked positions. Loss: cross-entropy summed over the masked tokens of a micro-batch divided
by the masked tokens of the whole global batch (`norm`, computed by every rank from the global
batch's indices), so it is the mean over the global batch's masked tokens for any number of ranks
and micro-batches; with --nsp, plus the next-sentence cross-entropy averaged over the global batch's
sequences (HF BertForPreTraining's sum of the two means).

Evaluation: masked-LM loss and accuracy (argmax at the masked positions) over the held-out documents
of --data-dir (its `eval` split), or every document of --eval-data; NSP accuracy with --nsp.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config import RunConfig
from ..data import masking
from ..data.features import Batch, load_tokenizer
from ..data.packing import EVAL_PAIR_SEED, Sequences, Stream
from ..data.pretrain import load_prepared, tokenizer_sha256
from ..model import BertConfig, BertForMaskedLM, BertForPreTraining, linear_flops
from ..zoo import ModelSource
from . import Evaluation, refuse_unread


# The masked rows' fp32 (log-)probabilities are computed this many parts of the rows at a time, by
# the loss each way and by predict: taken whole, an fp32 copy of the logits and their fp32
# log-probabilities are 4x the bf16 logits (bert-base, length 512, 64 sequences: 0.6 GB each); in
# sixteenths at most 0.25x (on CPU log_softmax and softmax first copy a part to fp32; CUDA's kernels
# read the bf16). A fixed number of parts keeps the operations the same at every batch (the plan fits
# each one's bytes to the batch, meters.StepMemory).
CHUNKS = 16


def _chunks(logits: torch.Tensor, labels: torch.Tensor):
    return zip(logits.tensor_split(CHUNKS), labels.tensor_split(CHUNKS))


class CrossEntropySum(torch.autograd.Function):
    """sum over rows of -log softmax(logits)[label], in fp32, as F.cross_entropy(logits.float(),
    labels, reduction="sum") computes it, for (m, V) logits at the masked rows. It keeps for backward
    the logits as they came (bf16 under autocast: 2 bytes an entry) where F.cross_entropy keeps its
    fp32 log-probabilities (4), and backward makes the gradient, softmax minus the label's one, a
    part of the rows at a time with one fused softmax each (CHUNKS); F.cross_entropy makes a
    zero-filled fp32 gradient of every entry first, then three more passes over them. Every label
    counts (no ignore_index: the objective passes the masked rows alone)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logits, labels)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        with torch.autocast(logits.device.type, enabled=False):
            for part, target in _chunks(logits, labels):
                total += F.nll_loss(F.log_softmax(part, dim=-1, dtype=torch.float32), target, reduction="sum")
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, labels = ctx.saved_tensors
        out = torch.empty_like(logits)
        for (part, target), into in zip(_chunks(logits, labels), out.tensor_split(CHUNKS)):
            p = torch.softmax(part, dim=-1, dtype=torch.float32)
            p[torch.arange(len(target), device=p.device), target] -= 1.0
            torch.mul(p, grad, out=into)  # in fp32, written at the logits' dtype
        return out, None


@dataclass
class MaskedLM:
    cfg: RunConfig
    name: str = "mlm"
    main_metric: str = "mlm_accuracy"
    spec: masking.MaskSpec | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "MaskedLM":
        return cls(cfg)

    def check(self, cfg: RunConfig) -> None:
        refuse_unread(cfg)
        if not cfg.data_dir:
            raise ValueError("data_dir: --task mlm trains on prepared data; run hpcbert prepare-pretraining "
                             "TEXT... --tokenizer DIR --out DATA_DIR, then pass --data-dir DATA_DIR")
        if cfg.max_seq_length < 8:
            raise ValueError(f"max_seq_length: {cfg.max_seq_length} is too short for pre-training "
                             f"([CLS] ... [SEP]{' ... [SEP]' if cfg.nsp else ''}); give at least 8")

    # --- data ------------------------------------------------------------------------------------

    def load(self, cfg: RunConfig, src: ModelSource) -> tuple[Sequences, dict[str, Sequences]]:
        tok_path = cfg.tokenizer or src.vocab_dir
        if tok_path is None:
            raise ValueError(f"tokenizer: model {cfg.model!r} has no vocabulary of its own; pass --tokenizer DIR, "
                             f"the one the data was prepared with")
        tok = load_tokenizer(tok_path, cfg.max_seq_length)
        sha = tokenizer_sha256(tok)
        self.spec = masking.MaskSpec.from_tokenizer(tok, cfg.mask_prob, cfg.whole_word_masking)

        def read(path: str, field_name: str):
            if not (Path(path) / "metadata.json").is_file() and not Path(path).is_dir():
                raise ValueError(f"{field_name}: {path} does not exist; give the --out directory of "
                                 f"hpcbert prepare-pretraining")
            try:
                prep = load_prepared(path, tokenizer_sha256=sha)
            except ValueError as e:
                if "another tokenizer" in str(e):
                    raise ValueError(f"{field_name}: {e}; pass --tokenizer with the vocabulary it was prepared "
                                     f"with (tokenizer.path in its metadata.json: "
                                     f"{_meta_tokenizer_path(path)})") from None
                raise
            vocab = prep.metadata["tokenizer"]["vocab_size"]
            if vocab > src.config.vocab_size:
                raise ValueError(f"{field_name}: {path} holds ids of a {vocab}-entry vocabulary, model {cfg.model!r} "
                                 f"has {src.config.vocab_size} word embeddings")
            return prep

        prep = read(cfg.data_dir, "data_dir")
        ids = prep.metadata["tokenizer"]
        special = np.flatnonzero(self.spec.special)

        def sequences(shards, origin: str, seed: int) -> Sequences:
            stream = Stream(shards, special)
            if cfg.nsp:
                return Sequences.pairs(stream, cfg.max_seq_length, ids, seed, origin)
            return Sequences.packed(stream, cfg.max_seq_length, ids, origin)

        def sha_of(p, split: str) -> str:  # the split's shards, for the data fingerprint
            return ",".join(s["tokens"]["sha256"][:16] for s in p.metadata["splits"][split]["shards"])
        train = sequences(prep.splits["train"], f"train {sha_of(prep, 'train')}", cfg.seed)
        if not cfg.do_eval:
            return train, {}
        if cfg.eval_data:
            other = read(cfg.eval_data, "eval_data")  # none of it was trained on: every document
            shards = other.splits["train"] + other.splits["eval"]
            origin = f"eval_data {sha_of(other, 'train')};{sha_of(other, 'eval')}"
        else:
            shards = prep.splits["eval"]
            origin = f"eval {sha_of(prep, 'eval')}"
            if not shards:
                if cfg.eval_every or cfg.target_mlm_accuracy is not None:
                    raise ValueError(f"data_dir: {cfg.data_dir} holds no held-out documents (prepared with "
                                     f"--eval-docs 0); --eval-every and --target-mlm-accuracy need them: prepare "
                                     f"it again with --eval-docs, or pass --eval-data DIR")
                return train, {}
        return train, {"eval": sequences(shards, origin, EVAL_PAIR_SEED)}

    def build_model(self, model_cfg: BertConfig) -> nn.Module:
        return BertForPreTraining(model_cfg) if self.cfg.nsp else BertForMaskedLM(model_cfg)

    def _keys(self, indices: np.ndarray, epoch: int | None) -> np.ndarray:
        return masking.sequence_keys(self.cfg.seed, epoch, indices)

    def collate(self, data: Sequences, indices: Any, pad_to: int | None = None, epoch: int | None = None) -> Batch:
        """A masked batch: labels {"mlm_positions": (m,) flat indices b*T + t, "mlm_labels": (m,)
        their original ids, with --nsp "nsp": (B,) 1 = random next}."""
        idx = np.asarray(indices, dtype=np.int64)
        ids, types, content, lengths, nsp = data.assemble(idx, pad_to)
        masked, positions, labels = masking.mask(self.spec, ids, content, self._keys(idx, epoch))
        B, T = ids.shape
        mask = None if (lengths == T).all() else torch.from_numpy(np.arange(T)[None, :] < lengths[:, None])
        targets = {"mlm_positions": torch.from_numpy(positions), "mlm_labels": torch.from_numpy(labels)}
        if nsp is not None:
            targets["nsp"] = torch.from_numpy(nsp)
        return Batch(torch.from_numpy(masked), torch.from_numpy(types), mask, targets, int(lengths.sum()), lengths)

    def norm(self, data: Sequences, indices: np.ndarray, epoch: int | None) -> dict[str, float]:
        """{"masked": selected tokens of the global batch, "examples": its sequences}. Token masking
        counts from the candidate counts alone; whole-word masking draws the global batch's masks."""
        idx = np.asarray(indices, dtype=np.int64)
        if self.spec.continuation is None:
            masked = int(masking.count(self.spec, data.candidates[idx], self._keys(idx, epoch)).sum())
        else:
            ids, _, content, _, _ = data.assemble(idx)
            masked = len(masking.mask(self.spec, ids, content, self._keys(idx, epoch))[1])
        return {"masked": float(masked), "examples": float(len(idx))}

    # --- model, loss, predictions ----------------------------------------------------------------

    def forward(self, model: nn.Module, batch: Batch):
        return model(batch.input_ids, batch.padding, batch.token_type_ids, batch.labels["mlm_positions"])

    def head_rows(self, batch: Batch) -> int:
        # the masked tokens, and [CLS] for next-sentence prediction
        return len(batch.labels["mlm_positions"]) + (len(batch) if self.cfg.nsp else 0)

    def head_flops(self, batch: Batch, model_cfg: BertConfig) -> float:
        # the transform and the vocabulary projection at the masked tokens; the next-sentence head
        # (pooler and output layer) at each sequence's [CLS]
        h, masked = model_cfg.hidden_size, len(batch.labels["mlm_positions"])
        nsp = linear_flops(len(batch), (h, h), (h, 2)) if self.cfg.nsp else 0.0
        return linear_flops(masked, (h, h), (h, model_cfg.vocab_size)) + nsp

    def loss(self, model: nn.Module, outputs, batch: Batch, norm: dict[str, float]) -> torch.Tensor:
        logits, nsp_logits = outputs if self.cfg.nsp else (outputs, None)
        loss = CrossEntropySum.apply(logits, batch.labels["mlm_labels"]) / max(norm["masked"], 1.0)
        if nsp_logits is not None:
            loss = loss + F.cross_entropy(nsp_logits.float(), batch.labels["nsp"], reduction="sum") / norm["examples"]
        return loss

    def predict(self, outputs, batch: Batch) -> dict[str, torch.Tensor]:
        """Per sequence: masked tokens, correct predictions, summed loss (and NSP terms)."""
        logits, nsp_logits = outputs if self.cfg.nsp else (outputs, None)
        B, T = batch.input_ids.shape
        labels = batch.labels["mlm_labels"]
        row = torch.div(batch.labels["mlm_positions"], T, rounding_mode="floor")
        # a part of the rows at a time (CHUNKS); bf16 -> fp32 is exact, so the argmax is the fp32 one
        per_token, correct = [], []
        for part, target in _chunks(logits.detach(), labels):
            per_token.append(F.nll_loss(F.log_softmax(part, dim=-1, dtype=torch.float32), target, reduction="none"))
            correct.append(part.argmax(-1) == target)
        per_token, correct = torch.cat(per_token), torch.cat(correct)
        def sums(v: torch.Tensor) -> torch.Tensor:  # (m,) per masked token -> (B,) per sequence
            return torch.zeros(B, dtype=torch.float64, device=v.device).index_add_(0, row, v.double())
        out = {"masked": sums(torch.ones_like(per_token)), "correct": sums(correct.float()), "loss": sums(per_token)}
        if nsp_logits is not None:
            nl = nsp_logits.detach().float()
            out["nsp_correct"] = (nl.argmax(-1) == batch.labels["nsp"]).double()
            out["nsp_loss"] = F.cross_entropy(nl, batch.labels["nsp"], reduction="none").double()
        return out

    def evaluate(self, split: str, predictions: dict[str, np.ndarray], data: Sequences) -> Evaluation:
        masked = float(predictions["masked"].sum())
        m = {"mlm_accuracy": float(predictions["correct"].sum()) / max(masked, 1.0),
             "mlm_loss": float(predictions["loss"].sum()) / max(masked, 1.0),
             "masked_tokens": masked}
        loss = m["mlm_loss"]
        if "nsp_correct" in predictions:
            m["nsp_accuracy"] = float(predictions["nsp_correct"].mean())
            m["nsp_loss"] = float(predictions["nsp_loss"].mean())
            loss += m["nsp_loss"]
        return Evaluation({**m, "loss": loss})

    def example_batch(self, batch_size: int, seq_len: int, vocab_size: int) -> tuple[Batch, dict[str, float]]:
        """b full sequences with 15% of their positions masked (memory probes)."""
        ids = torch.randint(5, vocab_size, (batch_size, seq_len))
        n = max(1, round(0.15 * seq_len))
        positions = (torch.arange(n) * (seq_len // n))[None, :] + seq_len * torch.arange(batch_size)[:, None]
        positions = positions.reshape(-1)
        targets = {"mlm_positions": positions, "mlm_labels": ids.reshape(-1)[positions]}
        if self.cfg.nsp:
            targets["nsp"] = torch.zeros(batch_size, dtype=torch.long)
        batch = Batch(ids, torch.zeros_like(ids), None, targets, batch_size * seq_len)
        return batch, {"masked": float(len(positions)), "examples": float(batch_size)}

    def hf_config(self) -> dict[str, Any]:
        return {"architectures": ["BertForPreTraining" if self.cfg.nsp else "BertForMaskedLM"]}


def _meta_tokenizer_path(path: str) -> str:
    import json

    try:
        return str(json.loads((Path(path) / "metadata.json").read_text())["tokenizer"]["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown"
