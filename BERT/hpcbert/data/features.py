"""Tokenised features, their on-disk cache, batching with dynamic padding, and samplers.

Features are ragged: all token ids of a split concatenated in one int32 array plus offsets, so a
split of any size is three arrays, cached as one .npz keyed by (file contents, tokenizer, length).

Samplers work on *global* batches: for every optimizer step they yield the indices of all the
sequences that step consumes, over all ranks and accumulation steps. `shard` then gives one rank
its micro-batches. The same seed gives the same global order for 1 or N processes, which is what
makes 1-vs-N runs comparable step by step.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..runfiles import sha256_file

FEATURE_VERSION = 1  # bump when the feature layout or tokenisation rules change


@dataclass
class Features:
    ids: np.ndarray        # (total_tokens,) int32: every sequence's token ids, concatenated
    type_ids: np.ndarray   # (total_tokens,) int8: segment (token type) ids
    offsets: np.ndarray    # (n + 1,) int64: sequence i is ids[offsets[i]:offsets[i+1]]
    labels: np.ndarray     # (n,) int64 class index or float32 score

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def fingerprint(self) -> str:
        """Token ids and labels: a different vocabulary or data set changes it (resume refuses)."""
        h = hashlib.sha256(np.ascontiguousarray(self.ids).tobytes())
        h.update(np.ascontiguousarray(self.offsets).tobytes())
        h.update(np.ascontiguousarray(self.labels).tobytes())
        return h.hexdigest()[:16]

    @classmethod
    def from_lists(cls, ids: list, type_ids: list, labels) -> "Features":
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter((t for x in ids for t in x), dtype=np.int32, count=int(offsets[-1]))
        flat_t = np.fromiter((t for x in type_ids for t in x), dtype=np.int8, count=int(offsets[-1]))
        return cls(flat, flat_t, offsets, np.asarray(labels))

    def save(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
        np.savez(tmp, ids=self.ids, type_ids=self.type_ids, offsets=self.offsets, labels=self.labels)
        os.replace(tmp, path)  # atomic: concurrent readers see the old file or the new one

    @classmethod
    def load(cls, path: Path) -> "Features":
        with np.load(path, allow_pickle=False) as z:
            return cls(z["ids"], z["type_ids"], z["offsets"], z["labels"])


# --- tokenisation --------------------------------------------------------------------------------

def load_tokenizer(path: str | os.PathLike, max_seq_length: int):
    """A `tokenizers.Tokenizer` from a directory (tokenizer.json preferred, else vocab.txt) or a
    file, with truncation to max_seq_length (longest first, as BERT's run_classifier) and no
    padding (batches pad themselves)."""
    from tokenizers import Tokenizer
    from tokenizers.implementations import BertWordPieceTokenizer

    p = Path(path)
    tj = p / "tokenizer.json" if p.is_dir() else p
    vocab = p / "vocab.txt" if p.is_dir() else p
    if tj.name.endswith(".json") and tj.is_file():
        tok = Tokenizer.from_file(str(tj))
    elif vocab.is_file():
        lower = True
        cfg = vocab.parent / "tokenizer_config.json"
        if cfg.is_file():
            lower = bool(json.loads(cfg.read_text()).get("do_lower_case", True))
        tok = BertWordPieceTokenizer(str(vocab), lowercase=lower)
    else:
        raise ValueError(f"tokenizer: {p} has neither tokenizer.json nor vocab.txt")
    tok.no_padding()
    tok.enable_truncation(max_length=max_seq_length, strategy="longest_first")
    return tok


def tokenizer_fingerprint(tok) -> str:
    return hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]


def tokenize_examples(tok, examples) -> Features:
    """Examples (text_a, text_b, label) -> Features, in one batched call to the Rust tokenizer."""
    pairs = [(e.text_a, e.text_b) if e.text_b is not None else e.text_a for e in examples]
    enc = tok.encode_batch(pairs)
    return Features.from_lists([e.ids for e in enc], [e.type_ids for e in enc], [e.label for e in examples])


def default_cache_dir() -> Path:
    return Path(os.environ.get("HPCBERT_CACHE") or Path.home() / ".cache" / "hpcbert") / "features"


def cached_features(source: Path, tok, max_seq_length: int, build, cache_dir: str | None, *,
                    params: dict | None = None, kind: type = Features) -> tuple[Features, bool]:
    """Features for `source`, built with `build()` on a cache miss. Key: sha256 of the file's
    bytes, the tokenizer's serialised form, the length, FEATURE_VERSION and any other settings
    the features depend on (`params`, e.g. SQuAD's doc_stride). `kind` is the Features type whose
    `load` reads the file back (one with extra arrays saves them itself). Returns (features, hit)."""
    key = f"{sha256_file(source)[:16]}-{tokenizer_fingerprint(tok)}-L{max_seq_length}-v{FEATURE_VERSION}"
    if params:
        key += "-" + "-".join(f"{k}{v}" for k, v in sorted(params.items()))
    cdir = Path(cache_dir) if cache_dir else default_cache_dir()
    path = cdir / f"{source.parent.name}-{source.stem}-{key}.npz"
    if path.is_file():
        try:
            return kind.load(path), True
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache file is rebuilt, never trusted
    feats = build()
    cdir.mkdir(parents=True, exist_ok=True)
    feats.save(path)
    return feats, False


# --- batching ------------------------------------------------------------------------------------

@dataclass
class Batch:
    input_ids: torch.Tensor              # (B, T) int64
    token_type_ids: torch.Tensor         # (B, T) int64
    attention_mask: torch.Tensor | None  # (B, T) bool, None when nothing is padded
    labels: torch.Tensor | dict[str, torch.Tensor]  # (B,) for classification; an objective's targets by name
    real_tokens: int                     # non-pad tokens in the batch
    lengths: np.ndarray | None = None    # (B,) host: real tokens per row, which come first in the row
    tokens: Any = None                   # model.Tokens, built by to() from `lengths`

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def padding(self):
        """What the model takes as its attention mask: the `Tokens` built on the host (no device read
        in the step), else the (B, T) mask."""
        return self.tokens if self.tokens is not None else self.attention_mask

    def to(self, device: torch.device, token_multiple: int = 1, always_index: bool = False,
           own_storage: bool = False) -> "Batch":
        """On `device`, with the unpadded layout (`model.Tokens`) built from the host lengths, its
        rows rounded up to a multiple of `token_multiple` (`Tokens.host_layout`; `always_index`: a
        batch without padding gets an index and an all-true mask too, one layout for a compiled
        model). To a GPU, every tensor of the batch goes in one copy from pinned memory (`to_device`);
        `own_storage` (a compiled model's) then copies each out of the one buffer on the device: as
        views of it, inputs whose offsets move with the batch's size meet torch.compile's guards on
        them (pytorch/pytorch#104563; on an H100 at 0071d95 an epoch's short last batch failed
        `token_type_ids._base.size()[0] == token_type_ids.storage_offset()` and recompiled, 35 s)."""
        from ..model import Tokens

        labels = list(self.labels.values()) if isinstance(self.labels, dict) else [self.labels]
        B, T = self.input_ids.shape
        index, cu = (None, None) if self.lengths is None else Tokens.host_layout(self.lengths, T, token_multiple,
                                                                                 always_index)
        mask = self.attention_mask
        if mask is None and index is not None:
            mask = torch.ones(B, T, dtype=torch.bool)
        ids, types, mask, index, cu, *labels = to_device(
            [self.input_ids, self.token_type_ids, mask, index, cu, *labels], device)
        if own_storage:
            ids, types, mask, index, cu, *labels = (t.clone() if t is not None and t._base is not None else t
                                                    for t in (ids, types, mask, index, cu, *labels))
        labels = dict(zip(self.labels, labels)) if isinstance(self.labels, dict) else labels[0]
        tokens = None if self.lengths is None else Tokens.build(
            [int(L) for L in self.lengths], B, T, None if index is None else mask.bool(), index, cu)
        return Batch(ids, types, mask, labels, self.real_tokens, self.lengths, tokens)


def to_device(tensors: list[torch.Tensor | None], device: torch.device, pack: bool | None = None) -> list:
    """The tensors (None stays None) on `device`. To a GPU (`pack`, by default on CUDA), all of
    them in one copy: packed into one pinned host buffer, copied without blocking, and read back
    as views of the one device buffer. A copy from pageable memory makes the host wait for the
    GPU's queued work first (CUDA's "API synchronization behavior"), six times a step if each
    tensor of a batch went on its own; from pinned memory the host goes on queueing the step.
    Fake tensors (`hpcbert plan`) are moved as they are: there is no copy to spare."""
    if pack is None:
        pack = device.type == "cuda" and not any(isinstance(t, FakeTensor) for t in tensors)
    if not pack:
        return [None if t is None else t.to(device) for t in tensors]
    flat = [None if t is None else t.contiguous().reshape(-1) for t in tensors]
    nbytes = [0 if t is None else t.numel() * t.element_size() for t in flat]
    offsets, total = [], 0
    for n in nbytes:
        offsets.append(total)
        total += -(-n // 16) * 16  # every part 16-byte aligned
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    for t, o, n in zip(flat, offsets, nbytes):
        if n:
            host[o:o + n].copy_(t.view(torch.uint8))
    dev = host.to(device, non_blocking=True)
    return [None if t is None else dev[o:o + n].view(t.dtype).view(s.shape)
            for t, s, o, n in zip(flat, tensors, offsets, nbytes)]


def collate(feats: Features, indices, pad_to: int | None = None, pad_id: int = 0) -> Batch:
    """Pad the chosen sequences to the longest among them (dynamic padding), or to `pad_to`."""
    idx = np.asarray(indices, dtype=np.int64)
    lengths = feats.lengths[idx]
    T = int(pad_to or lengths.max())
    B = len(idx)
    ids = np.full((B, T), pad_id, dtype=np.int64)
    types = np.zeros((B, T), dtype=np.int64)
    for row, (i, n) in enumerate(zip(idx, lengths)):
        s = feats.offsets[i]
        ids[row, :n] = feats.ids[s:s + n]
        types[row, :n] = feats.type_ids[s:s + n]
    mask = None if (lengths == T).all() else torch.from_numpy(np.arange(T)[None, :] < lengths[:, None])
    return Batch(torch.from_numpy(ids), torch.from_numpy(types), mask,
                 torch.from_numpy(feats.labels[idx]), int(lengths.sum()), lengths)


def epoch_order(lengths: np.ndarray, sampler: str, seed: int, epoch: int, global_batch: int) -> np.ndarray:
    """The order in which one epoch visits the examples (every index exactly once).

    length-grouped: a random permutation cut into mega-batches of 50 global batches, each sorted
    by length (longest first), so a batch holds similar lengths and pads little, while batches
    stay random in content and order (as HF's LengthGroupedSampler and fairseq's bucketing)."""
    n = len(lengths)
    if sampler == "sequential":
        return np.arange(n)
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(n)
    if sampler == "random":
        return perm
    mega = 50 * global_batch
    chunks = [perm[i:i + mega] for i in range(0, n, mega)]
    chunks = [c[np.argsort(-lengths[c], kind="stable")] for c in chunks]
    batches = [b for c in chunks for b in np.split(c, range(global_batch, len(c), global_batch))]
    # Shuffle whole batches so long and short batches interleave.
    order = rng.permutation(len(batches))
    return np.concatenate([batches[i] for i in order]) if batches else perm


def global_batches(order: np.ndarray, global_batch: int) -> list[np.ndarray]:
    """Cut an epoch's order into global batches; the last one may be smaller (kept: every
    example is seen exactly once per epoch)."""
    return [order[i:i + global_batch] for i in range(0, len(order), global_batch)]


def shard(batch: np.ndarray, per_rank: list[int], rank: int, grad_accum: int) -> list[np.ndarray]:
    """One rank's micro-batches of a global batch.

    The global batch is laid out as grad_accum rounds; in each round rank r takes per_rank[r]
    consecutive indices. A short last batch is shared in proportion to per_rank."""
    full = sum(per_rank) * grad_accum
    n = len(batch)
    if n == full:
        sizes = [list(per_rank) for _ in range(grad_accum)]
    else:  # proportional split of a short batch: largest-remainder rounding, deterministic
        share = np.array(per_rank, dtype=np.float64) / sum(per_rank)
        per_round = [n // grad_accum + (1 if a < n % grad_accum else 0) for a in range(grad_accum)]
        sizes = []
        for m in per_round:
            raw = share * m
            base = np.floor(raw).astype(int)
            rest = np.argsort(-(raw - base), kind="stable")[: m - base.sum()]
            base[rest] += 1
            sizes.append(base.tolist())
    out, pos = [], 0
    for round_sizes in sizes:
        start = pos + sum(round_sizes[:rank])
        out.append(batch[start:start + round_sizes[rank]])
        pos += sum(round_sizes)
    return out
