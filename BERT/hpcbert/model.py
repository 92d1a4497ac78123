"""BERT encoder with a pooler and classification / regression heads, in one file.

Parameter names follow Hugging Face's BertModel so that HF-format checkpoints (config.json +
model.safetensors / pytorch_model.bin) load without a conversion table. This file knows nothing
about launching, distribution, logging or gradient checkpointing: those are applied from outside
(see policies.py), which wraps `encoder.layer[i]` in place.

Shapes: B batch, T tokens, H hidden, N heads, D = H / N head width.
"""

from __future__ import annotations

import itertools
import json
import math
import weakref
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.flop_counter import register_flop_formula


@dataclass
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    pad_token_id: int = 0
    num_labels: int = 2  # 1 = regression (MSE loss)
    classifier_dropout: float | None = None  # dropout before the classifier; None = hidden_dropout_prob (HF)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.hidden_act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act {self.hidden_act!r}: only gelu, gelu_new and gelu_pytorch_tanh are supported")

    @classmethod
    def from_json(cls, path: str | Path, **overrides) -> "BertConfig":
        return cls.read_json(path, **overrides)[0]

    @classmethod
    def read_json(cls, path: str | Path, **overrides) -> tuple["BertConfig", list[str]]:
        """An HF config.json -> (config, names of the keys it holds that this model does not use).

        Keys that would change the maths in a way this model does not implement are refused,
        naming the key; the others it does not know (architectures, model_type, torch_dtype, ...)
        are returned so the caller can say they were ignored."""
        raw = json.loads(Path(path).read_text())
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: position_embedding_type {raw['position_embedding_type']!r} "
                             f"is not supported (only 'absolute')")
        for key in ("is_decoder", "add_cross_attention"):
            if raw.get(key):
                raise ValueError(f"{path}: {key}=true is not supported (an encoder-only BERT)")
        if "num_labels" not in raw and isinstance(raw.get("id2label"), dict):
            raw["num_labels"] = len(raw["id2label"])  # HF keeps the label count only as id2label
        known = {f.name for f in fields(cls)}
        cfg = {k: v for k, v in raw.items() if k in known}
        harmless = {"position_embedding_type", "is_decoder", "add_cross_attention", "id2label", "label2id"}
        ignored = sorted(k for k in raw if k not in known and k not in harmless)
        cfg.update(overrides)
        return cls(**cfg), ignored

    def to_dict(self) -> dict:
        return asdict(self)


# --- the encoder, on real tokens only ------------------------------------------------------------
#
# Token-wise work (embeddings, Q/K/V and output projections, feed-forward, LayerNorms, dropout) runs
# on the n real tokens of a batch as one (n, H) matrix; attention runs per sequence; the (B, T, H)
# sequence output is padded back once, for the heads (a head that reads a few positions gets those
# alone, and the last layer does its token-wise work there only: BertEncoder). This is the unpadded
# layout of NVIDIA's and MosaicBERT's BERTs (bert_padding.py): a batch of MRPC pads ~80 positions
# per sequence for ~52 real tokens, so a third of a padded model's work is on padding.

@dataclass
class Tokens:
    """Where the real tokens of a padded (B, T) batch are: built once per batch from its mask."""

    B: int
    T: int
    mask: torch.Tensor | None      # (B, T) bool, True = real token; None = nothing is padded
    index: torch.Tensor | None     # (n + fill,) positions b*T + t of the real tokens in the flat batch, then
                                   # of the filler rows (a padding position, repeated)
    lengths: list[int]             # real tokens of each sequence (host ints)
    cu_seqlens: torch.Tensor       # (B + 1 + k,) int32: sequence b is rows cu_seqlens[b]:cu_seqlens[b+1];
                                   # the filler rows after them, k sequences of at most T rows
    groups: list[tuple[int, int, int]]  # runs of consecutive sequences of one length: (first row, sequences, length)
    real_index: torch.Tensor | None = None  # (n,) the index's real-token part (a view)

    @classmethod
    def of(cls, attention_mask: "torch.Tensor | Tokens | None", B: int, T: int, device: torch.device) -> "Tokens":
        """From a (B, T) padding mask (1 = real token; None = nothing padded), or a `Tokens` built
        already (`Batch.to` builds it from the host-side lengths of its collate: no device read)."""
        if isinstance(attention_mask, Tokens):
            if (attention_mask.B, attention_mask.T) != (B, T):
                raise ValueError(f"tokens: built for (B, T) = {(attention_mask.B, attention_mask.T)}, the batch is "
                                 f"{(B, T)}")
            return attention_mask
        if attention_mask is None:
            return cls.build([T] * B, B, T, None, None, cls._host_cu([T] * B).to(device))
        if attention_mask.shape != (B, T):
            raise ValueError(f"attention_mask: shape {tuple(attention_mask.shape)}, expected (B, T) = {(B, T)}")
        mask = attention_mask.bool()
        lengths = mask.sum(1).tolist()  # a device read on CUDA: the training loop passes Batch.tokens instead
        index = mask.reshape(-1).nonzero().squeeze(1) if sum(lengths) < B * T else None
        return cls.build(lengths, B, T, mask if index is not None else None, index, cls._host_cu(lengths).to(device))

    @classmethod
    def from_lengths(cls, lengths, mask: torch.Tensor | None, device: torch.device, multiple: int = 1) -> "Tokens":
        """From host lengths of a batch whose real tokens come first in every row (`collate`'s
        layout) and its (B, T) mask on `device`: the index is computed on the host and copied
        (`multiple`: `host_layout`'s)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        B, T = (len(lengths), int(lengths.max())) if mask is None else tuple(mask.shape)
        index, cu = cls.host_layout(lengths, T, multiple)
        nb = device.type == "cuda"
        return cls.build(lengths.tolist(), B, T, None if index is None else mask.bool(),
                         None if index is None else index.to(device, non_blocking=nb), cu.to(device, non_blocking=nb))

    @staticmethod
    def host_layout(lengths, T: int, multiple: int = 1,
                    always_index: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The layout's device tensors, computed on the host (CPU tensors, to be copied) from the
        lengths of rows whose real tokens come first (`collate`'s layout): the index of the real
        tokens (None when nothing is padded, unless `always_index`) and the int32 cu_seqlens.

        `always_index`: a batch without padding gets an index too (every position), so that a
        compiled model meets one layout: on a GPU a batch without an index is another graph (the
        padded path, a guard on `index is None`), a compile of tens of seconds at a step nobody
        can foresee (masked-LM batches of whole 128-token lines, results/gpu/run-mfu-mlm-compile-*).

        `multiple` > 1 rounds the row count of a padded batch up to a multiple of it with filler rows
        (`filler`): copies of one padding position, attending among themselves as sequences of their
        own, which no head reads. The token-wise matmuls then meet a few row counts again and again
        instead of a new one at nearly every step, which on CUDA costs host time per call (cuBLAS
        picks a kernel for each new shape; `benchmarks/gpu.py hostcost`)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        n = int(lengths.sum())
        if n == len(lengths) * T and not always_index:
            return None, Tokens._host_cu(lengths)
        index = np.flatnonzero(np.arange(T)[None, :] < lengths[:, None])
        # always_index: at least one filler row where there is filler at all, so that the index and
        # its real-token part never have one size (traced, equal sizes become one symbol, and the
        # first batch with filler would compile again)
        chunks = Tokens.filler(n, T, multiple) or (Tokens._chunks(multiple, T) if always_index and multiple > 1 else [])
        if chunks:
            # a row with padding: its first padding position; without padding (always_index), the
            # first token: filler reads it and no head reads the filler, so its gradient adds zeros
            b = int(lengths.argmin())
            at = b * T + int(lengths[b]) if lengths[b] < T else 0
            index = np.concatenate([index, np.full(sum(chunks), at, dtype=index.dtype)])
        return torch.from_numpy(index), Tokens._host_cu([*lengths, *chunks])

    @staticmethod
    def filler(n: int, T: int, multiple: int) -> list[int]:
        """The filler rows that take n real rows to a multiple of `multiple`, as sequences of at most T."""
        return Tokens._chunks(-n % multiple if multiple > 1 else 0, T)

    @staticmethod
    def _chunks(fill: int, T: int) -> list[int]:
        return [T] * (fill // T) + ([fill % T] if fill % T else [])

    @staticmethod
    def _host_cu(lengths) -> torch.Tensor:
        return torch.tensor([0, *itertools.accumulate(int(L) for L in lengths)], dtype=torch.int32)

    @classmethod
    def build(cls, lengths: list[int], B: int, T: int, mask, index, cu: torch.Tensor) -> "Tokens":
        """From host lengths and the device tensors of the layout (cu_seqlens and index given:
        `host_layout`; filler rows where the index has more entries than real tokens)."""
        n = sum(lengths)
        fill = 0 if index is None else index.shape[0] - n
        groups, row = [], 0
        for L in [*lengths, *cls._chunks(fill, T)]:  # run-length encoding: equal lengths side by
            if groups and groups[-1][2] == L:          # side attend as one batch
                groups[-1] = (groups[-1][0], groups[-1][1] + 1, L)
            else:
                groups.append((row, 1, L))
            row += L
        return cls(B, T, mask, index, lengths, cu, groups, None if index is None else index[:n])

    @property
    def fill(self) -> int:
        """Filler rows after the n real ones (`host_layout`'s multiple)."""
        return 0 if self.index is None else self.index.shape[0] - self.real_index.shape[0]

    @property
    def max_len(self) -> int:
        """The longest sequence, filler's included."""
        return max(L for _, _, L in self.groups)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (n + fill, ...): the real tokens, sequence after sequence, then the filler."""
        flat = x.reshape(self.B * self.T, *x.shape[2:])
        return flat if self.index is None else flat.index_select(0, self.index)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """(n + fill, ...) -> (B, T, ...), zeros at the padding (filler rows left out)."""
        if self.index is not None:  # sliced by a tensor's size: traced, a symbol, not a value per batch
            n = self.real_index.shape[0]
            x = x.new_zeros(self.B * self.T, *x.shape[1:]).index_copy(0, self.real_index, x[:n])
        return x.view(self.B, self.T, *x.shape[1:])

    def positions(self) -> torch.Tensor:
        """(n,) position of every real token in its sequence (its column in the padded batch)."""
        flat = torch.arange(self.B * self.T, device=self.cu_seqlens.device)
        return (flat if self.index is None else self.index) % self.T

    def rows_of(self, flat: torch.Tensor) -> torch.Tensor:
        """(m,) flat positions b*T + t of real tokens in the padded batch -> their (m,) rows in the
        unpadded (n, ...) layout: row = cu_seqlens[b] + t."""
        return self.first_rows()[torch.div(flat, self.T, rounding_mode="floor")] + flat % self.T

    def first_rows(self) -> torch.Tensor:
        """(B,) row of every sequence's first token ([CLS]) in the unpadded layout."""
        return self.cu_seqlens[:self.B].to(torch.int64)


def cpu_value(t: torch.Tensor):
    """A CPU tensor's value on the host. A training step's only reads of tensor values go through
    here: clipping's "is the norm within the bound?" (optim.clip_grad_norm) and the seed of each
    dropout mask (keep_mask), both on CPU only, where no device runs ahead to wait for
    (tests/test_trainer.py checks that a step reads nothing else)."""
    if t.device.type != "cpu":
        raise ValueError(f"cpu_value: a {t.device.type} tensor; reading it would make the host wait for the device")
    return t.item()


def keep_mask(shape: tuple[int, ...], p: float, device: torch.device) -> tuple[torch.Tensor, float]:
    """A CPU dropout keep-mask, uint8 (1 = kept; `.view(torch.bool)` reads it as a bool mask), with
    P(drop) = p rounded to 1/65536, and the scale 1 / P(keep) of that rounded p, so the expectation
    is kept exactly.

    The bits: one 63-bit seed drawn from torch's CPU generator (so `torch.manual_seed` fixes the
    masks, and checkpointing's RNG replay redraws the same seed and so the same mask in a
    recomputation), expanded by NumPy's SFC64 generator into four 16-bit uniforms per 64-bit draw.
    PyTorch's CPU generator is a serial Mersenne Twister: the same bits from torch.randint took
    56 ms of a minilm-l6 bf16 step (batch 32, length 128, 19 masks) on this project's 2-core EPYC,
    SFC64 30 ms (F.dropout's bernoulli_ is slower than either). Neither splitting the draws over a
    second thread nor drawing them in cache-sized blocks gained anything inside a step.

    Drawn by one operator, `hpcbert::keep_mask`; in FakeTensorMode (`hpcbert plan`) it gives a mask
    of the shape only."""
    if device.type != "cpu":
        raise ValueError(f"keep_mask: CPU only (got {device.type}); other devices use F.dropout")
    drops = round(p * 65536)  # of the 65536 values of an int16, this many drop
    if torch.compiler.is_compiling():
        # Traced (torch.compile): no value to seed NumPy with; a mask of the same shape, dtype and
        # rate from torch's generator, in ops that trace (and that the compiler knows are random).
        n = math.prod(shape)
        bits = torch.randint(-2**63, 2**63 - 1, ((n + 3) // 4,), dtype=torch.int64)
        keep = torch.ge(bits.view(torch.int16)[:n], drops - 32768).to(torch.uint8)
        return keep.view(shape), keep_scale(p)
    return torch.ops.hpcbert.keep_mask(list(shape), drops, device), keep_scale(p)


def keep_scale(p: float) -> float:
    """1 / P(keep) of `keep_mask`'s rate: P(drop) = p rounded to 1/65536."""
    return 65536 / (65536 - round(p * 65536))


def _keep_mask_seed() -> torch.Tensor:
    """The one draw `keep_mask` takes from torch's CPU generator: its mask's seed. A mask taken from
    an earlier draw at the same generator state draws this alone, so that the draws after it are
    the same."""
    return torch.randint(0, 2**63 - 1, (), dtype=torch.int64)


@torch.library.custom_op("hpcbert::keep_mask", mutates_args=())
def _keep_mask_op(shape: list[int], drops: int, device: torch.device) -> torch.Tensor:
    n = math.prod(shape)
    seed = _keep_mask_seed()
    lanes = np.random.SFC64(cpu_value(seed)).random_raw((n + 3) // 4).view(np.int16)[:n]
    keep = np.greater_equal(lanes, drops - 32768).view(np.uint8)  # 1 byte per element, 1 = kept
    return torch.from_numpy(keep).view(shape)


@_keep_mask_op.register_fake
def _(shape, drops, device):
    return torch.empty(shape, dtype=torch.uint8)


def _apply_keep(x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """x times a `keep_mask` mask in x's dtype and its scale: CPU dropout, forward and backward.
    A multiplication: masked_fill with a bool mask measured ~5x slower on this CPU."""
    return x * keep.to(x.dtype).mul_(scale)


def _packed(keep: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.packbits(keep.numpy().reshape(-1).view(bool)))


def _unpacked(bits: torch.Tensor, n: int) -> torch.Tensor:
    return torch.from_numpy(np.unpackbits(bits.numpy(), count=n))


@torch.library.custom_op("hpcbert::pack_bits", mutates_args=())
def _pack_bits(keep: torch.Tensor) -> torch.Tensor:
    """A uint8 0/1 mask as bits, 8 to a byte (1/8 of its bytes)."""
    return _packed(keep)


@_pack_bits.register_fake
def _(keep):
    return keep.new_empty((keep.numel() + 7) // 8)


@torch.library.custom_op("hpcbert::unpack_bits", mutates_args=())
def _unpack_bits(bits: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """`pack_bits`'s mask again, uint8, of `shape`."""
    return _unpacked(bits, math.prod(shape)).view(shape)


@_unpack_bits.register_fake
def _(bits, shape):
    return bits.new_empty(shape)


def _kept_keep(x: torch.Tensor, p: float):
    """keep_mask for a dropout of x that a recomputation runs again: (mask, scale, its bits, the key
    the caller files itself under in _DRAWN_MASKS or None). Where a node drew the mask at this
    generator state and is still alive, its bits, unpacked, and the generator advanced as a draw
    would have advanced it: the same mask, 0.05 ms to unpack against 0.8 ms to draw (minilm-l6,
    batch 32, length 128). In FakeTensorMode (hpcbert plan) nothing is looked up: a mask of the shape."""
    shape, key = tuple(x.shape), None
    if not isinstance(x, FakeTensor):
        key = ("hidden", torch.get_rng_state().numpy().tobytes(), shape, p)
        first = _DRAWN_MASKS.get(key)
        if first is not None:
            _keep_mask_seed()
            return torch.ops.hpcbert.unpack_bits(first.mask_bits, list(shape)), keep_scale(p), first.mask_bits, key
    keep, scale = keep_mask(shape, p, x.device)
    return keep, scale, torch.ops.hpcbert.pack_bits(keep), key


class _Dropout(torch.autograd.Function):
    """CPU dropout with `keep_mask`; saves the uint8 mask (1 byte per element). With `reuse` (a
    dropout inside a module a checkpointing policy recomputes) the node also holds the mask as bits,
    past the checkpoint, and the recomputation takes them instead of drawing the mask again."""

    @staticmethod
    def forward(ctx, x, p, reuse=False):
        if reuse:
            keep, scale, ctx.mask_bits, key = _kept_keep(x, p)
            if key is not None:
                _DRAWN_MASKS[key] = ctx
        else:
            keep, scale = keep_mask(tuple(x.shape), p, x.device)
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return _apply_keep(x, keep, scale)

    @staticmethod
    def backward(ctx, g):
        keep, = ctx.saved_tensors
        return _apply_keep(g, keep, ctx.scale), None, None


def dropout(x: torch.Tensor, p: float, training: bool, reuse: bool = False) -> torch.Tensor:
    """Dropout; on CPU with `keep_mask` (autograd saves the uint8 mask, 1 byte per element); `reuse`:
    the mask is also kept as bits for a recomputation to take (_Dropout)."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, True)
    return _Dropout.apply(x, p, reuse and not torch.compiler.is_compiling())


class _CpuAttention(torch.autograd.Function):
    """Softmax attention per run of equal-length sequences, with attention dropout, on (n, 3H)
    fused Q/K/V rows. Saves Q/K/V (the projection's output), the probabilities P and the dropout
    keep-mask, not the dropped probabilities: the mask as uint8 (a quarter of P's bytes at bf16),
    or with `packed` as bits (1/16 of P's bytes; packing and unpacking cost ~0.3 ms a layer of
    minilm-l6 at batch 32, length 128, against 3 ms to draw it). Flash attention draws its mask
    again in backward from a counter-based generator at no cost; a CPU generator pays a draw per
    element (measured ~4% of a SQuAD step when drawn twice), so the mask is kept, and the
    checkpointing policies are where memory is traded for time. PyTorch's CPU SDPA takes no
    dropout in its flash kernel, so its math path would draw a (B, N, T, T) bernoulli mask and
    save it with P and the dropped P.

    The forward is one operator, `hpcbert::cpu_attention`, whose outputs are everything backward
    reads besides Q/K/V: every checkpointing policy that keeps them (none, selective) never runs
    the forward again.

    Per group (nb sequences of length L): S = (Q / sqrt(D)) K^T; P = softmax(S); A = P * K01 (the
    0/1 keep mask); O = s (A V) (s = 1 / P(keep)). Backward: dV = s A^T dO; dP = (s dO V^T) * K01;
    dS = P * (dP - rowsum(dP * P)) (PyTorch's fused softmax backward); dQ = dS K / sqrt(D);
    dK = dS^T Q / sqrt(D). Every scale is applied to an (L, D) operand or result, never to an
    (L, L) one: on a CPU the element-wise passes over the (L, L) tensors are what this costs
    beyond its matmuls."""

    @staticmethod
    def forward(ctx, qkv, groups, n_head, p, packed, reuse=False):
        flat = [x for g in groups for x in g]
        key = bits = None
        if reuse and p and not isinstance(qkv, FakeTensor):  # FakeTensorMode (hpcbert plan): no state to read
            # The mask is a function of the generator state, the shape and p: a node that drew it from
            # this state and is still alive (its graph not yet freed) holds its bits.
            key = (torch.get_rng_state().numpy().tobytes(), tuple(flat), n_head, p)
            first = _DRAWN_MASKS.get(key)
            bits = None if first is None else first.mask_bits
        out, *saved = torch.ops.hpcbert.cpu_attention(qkv, flat, n_head, p, packed, bits)
        if bits is not None:
            saved.append(bits)
        if reuse and p:
            # held by this node, past a checkpoint that drops what it saves, also where they came
            # from another node (the same state draws the same mask), which may be freed before it
            ctx.mask_bits = saved[-1]
            if key is not None:
                _DRAWN_MASKS[key] = ctx
        ctx.save_for_backward(qkv, *saved)
        ctx.groups, ctx.n_head, ctx.p, ctx.packed = groups, n_head, p, packed
        return out

    @staticmethod
    def backward(ctx, dout):
        qkv, *saved = ctx.saved_tensors
        n, H3 = qkv.shape
        H = H3 // 3
        N, p = ctx.n_head, ctx.p
        D = H // N
        dqkv = qkv.new_empty(n, H3)
        if p:
            keeps = _unpack_keeps(saved.pop(), ctx.groups, N, ctx.packed)
            scale = keep_scale(p)
        for i, (r0, nb, L) in enumerate(ctx.groups):
            P = saved[i]
            rows = slice(r0, r0 + nb * L)
            q, k, v = _heads(qkv[rows], nb, L, N, D)
            dO = dout[rows].view(nb, L, N, D).transpose(1, 2)           # (nb, N, L, D)
            g = dqkv[rows].view(nb, L, 3, N, D)
            if p:
                # in P's dtype once, for both products: a product of P and the uint8 mask converts
                # the mask into a temporary of P's dtype first (aten::copy_), each time
                keep = keeps[i].view(P.shape).to(P.dtype)
                dO = dO * scale
                dP = (dO @ v.transpose(-1, -2)).mul_(keep)              # (nb, N, L, L)
                g[:, :, 2] = ((P * keep).transpose(-1, -2) @ dO).transpose(1, 2)
            else:
                dP = dO @ v.transpose(-1, -2)
                g[:, :, 2] = (P.transpose(-1, -2) @ dO).transpose(1, 2)
            dS = torch.ops.aten._softmax_backward_data(dP, P, -1, P.dtype)
            g[:, :, 0] = (dS @ k).transpose(1, 2) * D ** -0.5
            g[:, :, 1] = (dS.transpose(-1, -2) @ q).transpose(1, 2) * D ** -0.5
        return dqkv, None, None, None, None, None


# Dropout masks that a recomputation can take instead of drawing them again (attention's
# `reuse_mask`, _Dropout's `reuse`): (generator state, groups and heads or "hidden" and the shape,
# p) -> the forward's autograd node, which holds the mask's bits. Weak: an entry lasts as long as
# the graph whose backward would recompute it.
_DRAWN_MASKS: "weakref.WeakValueDictionary[tuple, object]" = weakref.WeakValueDictionary()


def _keep_sizes(groups, n_head: int) -> list[int]:
    return [nb * n_head * L * L for _, nb, L in groups]


def _unpack_keeps(keep: torch.Tensor, groups, n_head: int, packed: bool) -> tuple[torch.Tensor, ...]:
    sizes = _keep_sizes(groups, n_head)
    if packed:
        keep = torch.ops.hpcbert.unpack_bits(keep, [sum(sizes)])
    return keep.split(sizes)


@torch.library.custom_op("hpcbert::cpu_attention", mutates_args=())
def _cpu_attention_op(qkv: torch.Tensor, groups: list[int], n_head: int, p: float, packed: bool,
                      bits: torch.Tensor | None = None) -> list[torch.Tensor]:
    """_CpuAttention's forward: [out (n, H), P of every group (nb, N, L, L), and where p > 0 the
    keep mask of all groups, flat: uint8, or bits packed 8 to a byte]. `groups` flat (r0, nb, L).
    `bits`: the mask, packed, from an earlier draw at the generator's present state: no new draw
    (the generator advances as if), and the mask is not returned."""
    groups3 = list(zip(groups[::3], groups[1::3], groups[2::3]))
    n, H3 = qkv.shape
    H = H3 // 3
    D = H // n_head
    out = qkv.new_empty(n, H)
    Ps = []
    if p:  # one mask for every group's (nb, N, L, L) probabilities: one draw, split per group
        sizes = _keep_sizes(groups3, n_head)
        if bits is None:
            flat, scale = keep_mask((sum(sizes),), p, qkv.device)
        else:
            _keep_mask_seed()  # the generator advances as keep_mask would have advanced it
            flat, scale = _unpacked(bits, sum(sizes)), keep_scale(p)
        keeps = flat.split(sizes)
    with torch.autocast("cpu", enabled=False):  # in qkv's dtype; the softmax accumulates in fp32
        for i, (r0, nb, L) in enumerate(groups3):
            q, k, v = _heads(qkv[r0:r0 + nb * L], nb, L, n_head, D)    # 3 x (nb, N, L, D)
            S = (q * D ** -0.5) @ k.transpose(-1, -2)                   # (nb, N, L, L)
            # bf16 in, bf16 out: PyTorch's CPU softmax accumulates reduced precision in fp32
            # (bit-equal to softmax in fp32 then rounded, without the two (L, L) casts)
            P = torch.softmax(S, -1)
            Ps.append(P)
            # P * keep: the uint8 mask converted to P's dtype in a temporary, then multiplied
            o = ((P * keeps[i].view(P.shape)) @ v).mul_(scale) if p else P @ v
            out[r0:r0 + nb * L] = o.transpose(1, 2).reshape(nb * L, H)
    if not p or bits is not None:
        return [out, *Ps]
    return [out, *Ps, _packed(flat) if packed else flat]


@register_flop_formula(torch.ops.hpcbert.cpu_attention, get_raw=True)
def _cpu_attention_flops(qkv, groups, n_head, p, packed, bits=None, out_val=None) -> int:
    """For torch's FlopCounterMode, which counts operators and cannot see inside this one: its two
    matmuls per group, S = Q K^T and P V, 2 nb N L L D FLOPs each (what SDPA's formula counts)."""
    D = qkv.shape[1] // 3 // n_head
    return sum(2 * 2 * nb * n_head * L * L * D for nb, L in zip(groups[1::3], groups[2::3]))


@_cpu_attention_op.register_fake
def _(qkv, groups, n_head, p, packed, bits=None):
    sizes = _keep_sizes(zip(groups[::3], groups[1::3], groups[2::3]), n_head)
    Ps = [qkv.new_empty(nb, n_head, L, L) for nb, L in zip(groups[1::3], groups[2::3])]
    out = qkv.new_empty(qkv.shape[0], qkv.shape[1] // 3)
    if not p or bits is not None:
        return [out, *Ps]
    m = sum(sizes)
    return [out, *Ps, qkv.new_empty((m + 7) // 8 if packed else m, dtype=torch.uint8)]


def _heads(rows: torch.Tensor, nb: int, L: int, N: int, D: int) -> tuple[torch.Tensor, ...]:
    """(nb * L, 3H) rows of fused Q/K/V -> q, k, v as (nb, N, L, D) views."""
    return rows.view(nb, L, 3, N, D).permute(2, 0, 3, 1, 4).unbind(0)


class _FlashVarlen(torch.autograd.Function):
    """CUDA, fp16/bf16: FlashAttention-2 over the unpadded rows (cu_seqlens), with attention dropout
    (Philox in the kernel; the RNG state it returns replays the mask in backward). PyTorch's public
    varlen_attn has no dropout, so this calls the same ATen kernels it does."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, p):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, p, False, False)
        ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused)
        ctx.max_len, ctx.p = max_len, p
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, ctx.p, False, rng, unused)
        return dq, dk, dv, None, None, None


def _flash_varlen_ok(qkv: torch.Tensor, D: int) -> bool:
    return (qkv.is_cuda and qkv.dtype in (torch.float16, torch.bfloat16) and D % 8 == 0 and D <= 256
            and _sm80_or_newer(qkv.device.index))


@torch.compiler.assume_constant_result  # a fact of the device: torch.compile reads it once, at trace time
def _sm80_or_newer(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 0)


def padded_attention(qkv: torch.Tensor, tokens: Tokens, n_head: int, p: float) -> torch.Tensor:
    """Attention on the padded (B, N, T, D) layout with PyTorch's SDPA and the padding mask (what
    the encoder did before it unpadded): CUDA where flash varlen does not apply, and the tests'
    reference for the kernels above."""
    B, T, H = tokens.B, tokens.T, qkv.shape[1] // 3
    x, mask = tokens.pad(qkv).view(B, T, 3, n_head, H // n_head), tokens.mask
    if mask is not None and T % 16:
        # CUDA's memory-efficient kernel (fp32; fp16/bf16 where flash varlen does not apply) refuses
        # in backward a mask bias whose strides are not multiples of its alignment ("attn_bias is
        # not correctly aligned", seen at T=21 on an H100): pad T to a multiple of 16, the extra keys
        # masked out (they add exactly 0), the extra queries dropped.
        Tp = T + 16 - T % 16
        x, mask = F.pad(x, (0, 0, 0, 0, 0, 0, 0, Tp - T)), F.pad(mask, (0, Tp - T), value=False)
    q, k, v = x.permute(2, 0, 3, 1, 4)  # 3 x (B, N, T, D)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None, None, :],
                                       dropout_p=p)  # (B, N, T, D)
    return tokens.unpad(y[:, :, :T].transpose(1, 2))


def attention(qkv: torch.Tensor, tokens: Tokens, n_head: int, p: float, pack_mask: bool = False,
              reuse_mask: bool = False) -> torch.Tensor:
    """(n, 3H) fused Q/K/V rows -> (n, H) attention output, each token attending to the real tokens
    of its own sequence; `p` = attention dropout (0 outside training); `pack_mask`: on CPU, keep
    the dropout mask for backward as bits, not bytes; `reuse_mask` (with `pack_mask`): hold those
    bits past a checkpoint, whose recomputation then takes them instead of drawing the mask again.

    Under torch.compile the GPU kernels trace into the graph (a layer compiles whole); the CPU
    kernel is a graph break (`_cpu_attention`)."""
    n, H = qkv.shape[0], qkv.shape[1] // 3
    D = H // n_head
    if qkv.device.type == "cpu":
        return _cpu_attention(qkv, tokens.groups, n_head, p, pack_mask, pack_mask and reuse_mask)
    if tokens.index is not None and _flash_varlen_ok(qkv, D):
        # Q, K and V as views of the fused rows (row stride 3H): the kernel asks only for a contiguous
        # last dimension, and without copies attention's forward and backward took 0.79-0.85x the time
        # on an H100, the same output and gradients (benchmarks/gpu_attention.py, results/gpu/attention.json)
        q, k, v = qkv.view(n, 3, n_head, D).unbind(1)  # 3 x (n, N, D)
        # The longest sequence: a host int; traced, the padded length T, which bounds it (equal to it
        # in collate's batches), as a symbol rather than a value per batch to recompile for.
        max_len = tokens.T if torch.compiler.is_compiling() else tokens.max_len
        return _FlashVarlen.apply(q, k, v, tokens.cu_seqlens, max_len, p).reshape(n, H)
    return padded_attention(qkv, tokens, n_head, p).reshape(n, H)


@torch.compiler.disable  # a loop over runs of equal host lengths: a graph break, not a recompile per batch
def _cpu_attention(qkv: torch.Tensor, groups, n_head: int, p: float, packed: bool, reuse: bool) -> torch.Tensor:
    return _CpuAttention.apply(qkv, groups, n_head, p, packed, reuse)


# Device types with an autocast, asked once per type outside any trace: torch.compile of torch 2.11
# (a GPU machine's) cannot trace torch.amp.is_autocast_available, and a graph break in every
# LayerNorm left the compiled model in 2 x 25 pieces (slower than eager on an H200); it can trace
# is_autocast_enabled and get_autocast_dtype, and a lookup in this table.
_AUTOCAST_DEVICE_TYPES = {t: torch.amp.is_autocast_available(t) for t in ("cpu", "cuda", "xpu", "mps", "hpu", "meta")}


def _has_autocast(device_type: str) -> bool:
    ok = _AUTOCAST_DEVICE_TYPES.get(device_type)
    return torch.amp.is_autocast_available(device_type) if ok is None else ok


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """Autocast's dtype on this device type where it is on there, else None."""
    if _has_autocast(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (the same parameters, names and fp32 arithmetic inside the kernel) that under
    bf16/fp16 autocast, with `low_precision` on, takes its input in autocast's dtype and returns
    that dtype (its weights: low_precision_norm_args): MosaicML Composer's LowPrecisionLayerNorm,
    which MosaicBERT trains with. Autocast's own rule (`low_precision` off, as Hugging Face's BERT runs) is fp32 in and out:
    a cast of every LayerNorm's input up and of its output down again for the next matmul, and the
    residual stream, which the LayerNorms' outputs are, in fp32. Low, it stays in autocast's dtype:
    those casts are gone, and the residual sums, the LayerNorms and the tensors they save move half
    the bytes. Without autocast (fp32 runs) both are the same. A precision policy sets it
    (policies.norm_precision; --norm-precision)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.low_precision = True

    def autocast_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        """The dtype this LayerNorm runs in at `x` when it leaves autocast's rule; None when it follows it."""
        return _autocast_dtype(x.device.type) if self.low_precision else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = self.autocast_dtype(x)
        if dt is None:
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):
            return F.layer_norm(*low_precision_norm_args(x, self.normalized_shape, self.weight, self.bias, dt), self.eps)


def low_precision_norm_args(x: torch.Tensor, shape, weight, bias, dtype: torch.dtype):
    """(x, normalized shape, weight, bias) for a LayerNorm kernel that returns `dtype`: x in `dtype`;
    on CPU the weights as they are (its kernel takes fp32 weights with a bf16 input and keeps the
    mean and 1/std it saves in fp32), elsewhere cast to `dtype` as Composer does."""
    if x.device.type != "cpu":
        weight = None if weight is None else weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    return x.to(dtype), shape, weight, bias


class BertEmbeddings(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.p = c.hidden_dropout_prob
        self.reuse_dropout_mask = False  # recomputed (policies.wrap_layers: all): keep the mask's bits

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, tokens: Tokens) -> torch.Tensor:
        """(B, T) ids -> (n, H) embeddings of the real tokens."""
        x = (self.word_embeddings(tokens.unpad(input_ids)) + self.token_type_embeddings(tokens.unpad(token_type_ids))
             + self.position_embeddings(tokens.positions()))
        return dropout(self.LayerNorm(x), self.p, self.training, self.reuse_dropout_mask)


class _KvKeepingLinear(torch.autograd.Function):
    """The fused Q/K/V projection of a layer whose attention a checkpointing policy recomputes
    (alternate): the forward keeps the K and V columns of its output (a copy, held on ctx out of the
    sight of autograd's saved-tensor hooks, as _NormKeepingOutput holds its output), and the
    recomputation, which finds them (_KEPT_KV), computes the Q columns alone: a third of the
    projection's matmul instead of all of it, for 2H bytes a token more (bf16: 4H). What it saves
    for backward (the input and the weight, in autocast's dtype as F.linear's would be) is the same
    in both runs, so the checkpoint pairs them up; its backward is F.linear's."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        dev = x.device.type
        dtype = _autocast_dtype(dev) or x.dtype
        xc, wc, bc = x.to(dtype), weight.to(dtype), bias.to(dtype)
        H = weight.shape[0] // 3
        # Identifies the forward's input and weight as they were: the input is held by the graph
        # whose node is found (so its storage is its own) and a write would bump its version. By
        # storage, not address: FakeTensorMode (hpcbert plan) has storages and no addresses.
        key = (x.untyped_storage()._cdata, x.storage_offset(), x._version, tuple(x.shape),
               weight.untyped_storage()._cdata, weight._version)
        first = _KEPT_KV.get(key)
        with torch.autocast(dev, enabled=False):
            if first is None or first.kv is None:  # (None: a backward through the graph freed them)
                out = F.linear(xc, wc, bc)
                ctx.kv = out[:, H:].clone()
                _KEPT_KV[key] = ctx
            else:  # the recomputation: Q alone, K and V as the forward computed them
                out = torch.cat([F.linear(xc, wc[:H], bc[:H]), first.kv], 1)
        ctx.save_for_backward(xc, wc)
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        # The recomputation that read K and V ran before this (the projection is the first thing
        # the recomputed layer does, so its backward comes last): free them now, not when the graph
        # goes (the training step holds its last loss through the optimizer step)
        ctx.kv = None
        xc, wc = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        dout = dout.to(xc.dtype)
        dx = (dout @ wc).to(x_dtype)
        dw = (dout.t() @ xc).to(w_dtype)
        return dx, dw, dout.sum(0).to(b_dtype)


# The K and V columns a forward of _KvKeepingLinear kept: (input and weight as they were) -> its
# autograd node. Weak, as _DRAWN_MASKS: an entry lasts as long as the graph that would recompute it.
_KEPT_KV: "weakref.WeakValueDictionary[tuple, object]" = weakref.WeakValueDictionary()


class BertSelfAttention(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.n_head = c.num_attention_heads
        # Q, K and V as one (3H, H) projection: one GEMM. Saved and loaded under HF's three names
        # (query, key, value): see fuse_qkv / split_qkv at the end of this file.
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size)
        self.p = c.attention_probs_dropout_prob
        # CPU: keep the attention dropout mask as bits (8x fewer bytes, ~0.3 ms a layer to pack
        # and unpack), and hold them for a checkpoint's recomputation (reuse); memory policies set
        # them (policies.py: selective, alternate)
        self.pack_dropout_mask = False
        self.reuse_dropout_mask = False
        # Recomputed by a checkpointing policy (alternate): keep K and V, recompute Q (_KvKeepingLinear)
        self.keep_kv = False

    def forward(self, x: torch.Tensor, tokens: Tokens) -> torch.Tensor:
        if self.keep_kv and self.training and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            qkv = _KvKeepingLinear.apply(x, self.qkv.weight, self.qkv.bias)
        else:
            qkv = self.qkv(x)
        return attention(qkv, tokens, self.n_head, self.p if self.training else 0.0,
                         self.pack_dropout_mask, self.reuse_dropout_mask)  # (n, H)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # HF checkpoints (and this project's before Q/K/V were fused) hold the three projections.
        fuse_qkv(state_dict, prefix, {"weight": self.qkv.weight.detach(), "bias": self.qkv.bias.detach()})
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class _NormKeepingOutput(torch.autograd.Function):
    """LayerNorm(dropout(z) + residual), CPU, whose backward keeps the LayerNorm's output y and
    1/std per token instead of its input and the dropout mask: the normalised input is
    (y - bias) / weight, and the mask is kept as bits (1/8 of its bytes; drawing it again from the
    generator state it was drawn from cost 0.8 ms, unpacking 0.05, minilm-l6 at batch 32, length
    128). This is apex's and Megatron-LM's "memory-efficient" LayerNorm backward, weights clamped
    away from 0 by eps as there (a weight of exactly 0 then gets no gradient).

    A checkpointing policy turns it on (BertSelfOutput.keep_output_only, policies.wrap_layers):
    - in a layer before a checkpointed one, whose checkpoint keeps y anyway: the layer keeps less
      (not the LayerNorm's fp32 input, and the mask as bits);
    - in a checkpointed layer (but the last): y and 1/std are held on ctx, out of the sight of
      autograd's saved-tensor hooks, so the last tensors the layer hands to the checkpoint's hooks
      are its feed-forward's second matmul's inputs, and the recomputation stops there, before
      that matmul runs (torch.utils.checkpoint stops early once every saved tensor is back): a
      third of the layer's matmul work, a dropout, the residual sum and a LayerNorm are not redone.
      Where the next layer is not checkpointed, y is kept in addition where that layer's first
      matmul keeps a cast of it (autocast with fp32 LayerNorms), not where it keeps y itself (fp32,
      or LayerNorms in autocast's dtype).

    With a low-precision LayerNorm (`dtype`) y is bf16/fp16, and the normalised input read back from
    it carries y's rounding, times |bias / weight| more where that is large: its gradients are within
    bf16's rounding of fp32's as none's are (tests/test_policies.py), not none's bits."""

    @staticmethod
    def forward(ctx, z, residual, weight, bias, eps, p, dtype=None):
        ctx.z_dtype, ctx.residual_dtype = z.dtype, residual.dtype
        if p:
            keep, scale = keep_mask(tuple(z.shape), p, z.device)  # as _Dropout
            ctx.mask_bits = torch.ops.hpcbert.pack_bits(keep)
            z = _apply_keep(z, keep, scale)
        args = (z + residual, weight.shape, weight, bias)
        if dtype is not None:  # LayerNorm.low_precision under autocast: as LayerNorm.forward
            args = low_precision_norm_args(*args, dtype)
        y, _, rstd = torch.native_layer_norm(*args, eps)
        ctx.y, ctx.version = y.detach(), y._version  # detached: no reference cycle through y's grad_fn
        ctx.rstd, ctx.weight, ctx.bias = rstd, weight.detach(), bias.detach()
        ctx.p, ctx.eps, ctx.z_shape = p, eps, z.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        y, rstd, w = ctx.y, ctx.rstd, ctx.weight
        if y._version != ctx.version:
            raise RuntimeError("hpcbert: a layer's output was modified in place after the forward; its "
                               "LayerNorm backward reads it (gradient checkpointing: alternate, all, every:K)")
        # In fp32 whatever y's dtype (a low-precision LayerNorm's y is bf16/fp16; the weights are fp32)
        xhat = (y.float() - ctx.bias) / torch.where(w >= 0, w.clamp_min(ctx.eps), w.clamp_max(-ctx.eps))
        # The kernel with mean 0 and 1/std 1 reads xhat as the normalised input; its input gradient
        # is then the true one over 1/std.
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            dy.float(), xhat, list(w.shape), torch.zeros_like(rstd), torch.ones_like(rstd), w, ctx.bias,
            [True, True, True])
        dx = dx.mul_(rstd)
        dz = dx.to(ctx.z_dtype)
        if ctx.p:
            dz = _apply_keep(dz, torch.ops.hpcbert.unpack_bits(ctx.mask_bits, list(ctx.z_shape)), keep_scale(ctx.p))
        return dz, dx.to(ctx.residual_dtype), dw, db, None, None, None


class BertSelfOutput(nn.Module):
    def __init__(self, c: BertConfig, inner: int):
        super().__init__()
        self.dense = nn.Linear(inner, c.hidden_size)
        self.LayerNorm = LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.p = c.hidden_dropout_prob
        # Backward keeps the output, not the LayerNorm's input and the mask (_NormKeepingOutput, CPU,
        # training); a checkpointing policy sets it (policies.wrap_layers)
        self.keep_output_only = False
        # Recomputed by a checkpointing policy: the dropout mask's bits are kept for it (_Dropout)
        self.reuse_dropout_mask = False

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        z = self.dense(h)
        if (self.keep_output_only and self.training and torch.is_grad_enabled() and z.device.type == "cpu"
                and not torch.compiler.is_compiling()):
            ln = self.LayerNorm
            return _NormKeepingOutput.apply(z, residual, ln.weight, ln.bias, ln.eps, self.p, ln.autocast_dtype(z))
        return self.LayerNorm(dropout(z, self.p, self.training, self.reuse_dropout_mask) + residual)


class BertAttention(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(c)
        self.output = BertSelfOutput(c, c.hidden_size)

    def forward(self, x: torch.Tensor, tokens: Tokens, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(n, H) -> (n, H); with `rows`, attention over every token, output at `rows` only, (m, H)."""
        h = self.self(x, tokens)
        if rows is not None:
            h, x = h.index_select(0, rows), x.index_select(0, rows)
        return self.output(h, x)


class BertIntermediate(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)
        # HF's "gelu" is the exact erf form; "gelu_new" / "gelu_pytorch_tanh" the tanh approximation.
        self.approximate = "none" if c.hidden_act == "gelu" else "tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x), approximate=self.approximate)


class BertLayer(nn.Module):
    """One encoder layer, (n, H) -> (n, H): the unit that gradient-checkpointing policies wrap.

    With `rows` (m,) the layer's output is computed at those rows only, (m, H): every token is
    still attended to (keys and values of all n rows), but the attention output projection, its
    LayerNorm and the feed-forward, 9 of the layer's 12 H^2 of matmul work per token, run on the
    m rows a head reads. The encoder does this in its last layer (see BertEncoder)."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.attention = BertAttention(c)
        self.intermediate = BertIntermediate(c)
        self.output = BertSelfOutput(c, c.intermediate_size)
        # Saved-tensor hooks (pack, unpack) around the feed-forward in training: a checkpointing
        # policy sets them (policies.wrap_layers: alternate), so that a checkpointed layer keeps its
        # feed-forward's activations and recomputes only its attention
        self.ffn_hooks = None

    def forward(self, x: torch.Tensor, tokens: Tokens, rows: torch.Tensor | None = None) -> torch.Tensor:
        a = self.attention(x, tokens, rows)
        if self.ffn_hooks is not None and self.training and torch.is_grad_enabled():
            with torch.autograd.graph.saved_tensors_hooks(*self.ffn_hooks):
                return self.output(self.intermediate(a), a)
        return self.output(self.intermediate(a), a)


class BertEncoder(nn.Module):
    """The layers, (n, H) -> (n, H); with `rows`, the last layer's output at those rows only, (m, H).

    A classifier reads the [CLS] row of the last layer and a masked-LM head its masked rows (15%),
    so the last layer's output projection and feed-forward on every other token are work nobody
    reads: MosaicBERT's and NVIDIA's BERTs skip it the same way (MosaicBERT's `subset_idx`). The
    result at `rows` is the full encoder's, up to float rounding (tests/test_unpad.py)."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(c) for _ in range(c.num_hidden_layers))

    def forward(self, x: torch.Tensor, tokens: Tokens, rows: torch.Tensor | None = None) -> torch.Tensor:
        last = len(self.layer) - 1
        for i, layer in enumerate(self.layer):
            x = layer(x, tokens, rows) if (i == last and rows is not None) else layer(x, tokens)
        return x


class BertPooler(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, cls: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls))  # (B, H) [CLS] hidden states -> (B, H)


class BertModel(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.config = c
        self.embeddings = BertEmbeddings(c)
        self.encoder = BertEncoder(c)
        self.pooler = BertPooler(c)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids (B, T), attention_mask (B, T) (1 = real token; None = nothing padded) or a Tokens ->
        (sequence output (B, T, H), zeros at the padding; pooled output (B, H), None without a pooler).

        `positions` (m,): flat indices b*T + t of the real tokens a head reads; the sequence output
        is then (m, H) at those positions only, and the last layer computes nothing else (the
        pooled output still comes from [CLS]). An empty `positions` is a classifier's: the pooled
        output alone."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        tokens = Tokens.of(attention_mask, *input_ids.shape, input_ids.device)
        x = self.embeddings(input_ids, token_type_ids, tokens)  # (n, H)
        if positions is None:
            seq = tokens.pad(self.encoder(x, tokens))
            return seq, (self.pooler(seq[:, 0]) if self.pooler is not None else None)
        rows = tokens.rows_of(positions)
        if self.pooler is None:
            return self.encoder(x, tokens, rows), None
        x = self.encoder(x, tokens, torch.cat([tokens.first_rows(), rows]))  # (B + m, H)
        return x[tokens.B:], self.pooler(x[:tokens.B])


class BertHeadModel(nn.Module):
    """Base of every task model: the shared encoder as `.bert` (HF name) plus a head, initialised
    as BERT is. Heads are the task models below; objectives (objectives/) pick one."""

    def __init__(self, c: BertConfig, with_pooler: bool = True):
        super().__init__()
        self.config = c
        self.bert = BertModel(c)
        if not with_pooler:
            self.bert.pooler = None

    def _init_weights(self, m: nn.Module) -> None:
        # BERT's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm.
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=self.config.initializer_range)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, nn.Embedding) and m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class BertForSequenceClassification(BertHeadModel):
    """BERT + dropout + linear head. num_labels == 1 is regression (MSE), else cross-entropy."""

    def __init__(self, c: BertConfig):
        super().__init__(c)
        self.dropout = nn.Dropout(c.hidden_dropout_prob if c.classifier_dropout is None else c.classifier_dropout)
        self.classifier = nn.Linear(c.hidden_size, c.num_labels)
        self.apply(self._init_weights)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """-> logits (B, num_labels)."""
        # The head reads [CLS] alone: the last layer runs on it only (BertEncoder).
        _, pooled = self.bert(input_ids, attention_mask, token_type_ids, positions=input_ids.new_zeros(0))
        return self.classifier(self.dropout(pooled))

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed (not averaged) loss over the batch: the trainer divides by the global batch."""
        return classification_loss(logits, labels, reduction="sum")


def classification_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "none") -> torch.Tensor:
    """Cross-entropy over classes, or MSE when there is one output (regression), in fp32."""
    if logits.shape[-1] == 1:
        return F.mse_loss(logits.squeeze(-1).float(), labels.float(), reduction=reduction)
    return F.cross_entropy(logits.float(), labels, reduction=reduction)


class BertForQuestionAnswering(BertHeadModel):
    """BERT + a linear span head (`qa_outputs`, H -> 2: start and end logits per token), no pooler:
    HF's BertForQuestionAnswering, so its checkpoints load by name."""

    def __init__(self, c: BertConfig):
        super().__init__(c, with_pooler=False)
        self.qa_outputs = nn.Linear(c.hidden_size, 2)
        self.apply(self._init_weights)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (start logits (B, T), end logits (B, T)), padded positions included (as HF)."""
        x, _ = self.bert(input_ids, attention_mask, token_type_ids)
        start, end = self.qa_outputs(x).unbind(-1)  # (B, T, 2) -> 2 x (B, T)
        return start, end


class BertPredictionHeadTransform(nn.Module):
    """dense H -> H, the encoder's activation, LayerNorm: HF's cls.predictions.transform."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.approximate = "none" if c.hidden_act == "gelu" else "tanh"
        self.LayerNorm = LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(F.gelu(self.dense(x), approximate=self.approximate))


class BertLMPredictionHead(nn.Module):
    """transform, then the vocabulary projection `decoder` whose weight is the word embeddings
    (tied by the model) and whose bias is `bias` (HF: cls.predictions.bias)."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.transform = BertPredictionHeadTransform(c)
        self.decoder = nn.Linear(c.hidden_size, c.vocab_size)
        self.bias = nn.Parameter(torch.zeros(c.vocab_size))
        self.decoder.bias = self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(x))  # (..., H) -> (..., V)


class BertPreTrainingHeads(nn.Module):
    """HF's `cls`: the masked-LM head, and the next-sentence head on the pooled [CLS] where used."""

    def __init__(self, c: BertConfig, nsp: bool):
        super().__init__()
        self.predictions = BertLMPredictionHead(c)
        self.seq_relationship = nn.Linear(c.hidden_size, 2) if nsp else None


class BertForMaskedLM(BertHeadModel):
    """BERT + the masked-LM head, no pooler: HF's BertForMaskedLM, so its weights load and save by
    name. With `mlm_positions` the vocabulary projection runs only at those positions: the hidden
    states of the masked tokens are gathered first (15% of the tokens), so the (tokens x V)
    projection, the largest matrix product of a small BERT, shrinks by the same factor."""

    # Copies of other parameters (HF's attribute): saved once, under the source's name.
    _tied_weights_keys = ["cls.predictions.decoder.weight", "cls.predictions.decoder.bias"]
    nsp = False

    def __init__(self, c: BertConfig):
        super().__init__(c, with_pooler=self.nsp)
        self.cls = BertPreTrainingHeads(c, self.nsp)
        self.apply(self._init_weights)
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight  # tied, as BERT

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, mlm_positions: torch.Tensor | None = None):
        """-> logits (B, T, V) at every position, or (m, V) at `mlm_positions` (m,), flat indices
        b*T + t into the batch; BertForPreTraining adds the next-sentence logits (B, 2)."""
        # With mlm_positions the last layer runs at those positions only (BertEncoder): x is (m, H).
        x, pooled = self.bert(input_ids, attention_mask, token_type_ids, positions=mlm_positions)
        logits = self.cls.predictions(x)
        if not self.nsp:
            return logits
        return logits, self.cls.seq_relationship(pooled)


class BertForPreTraining(BertForMaskedLM):
    """BERT + masked-LM and next-sentence heads (pooler kept): HF's BertForPreTraining."""

    nsp = True


def flops_per_sequence(c: BertConfig, seq_len: int, head_rows: float | None = None) -> float:
    """Training FLOPs of the encoder for one sequence: 3 * L * (8*s*h^2 + 4*s*h*I + 4*s^2*h),
    which is the familiar 3 * L * (24*s*h^2 + 4*s^2*h) when the feed-forward width I is 4h.

    Forward = 2 FLOPs per multiply-add: Q, K, V and output projections (4 h x h), the two
    feed-forward matmuls (2 h x I), and attention scores and values (2 * 2*s*h per token);
    backward = 2x forward. Source: the Megatron-LM paper (Narayanan et al. 2021, eq. 2) without
    the LM head, with I kept apart; cited in FIELD_NOTES. The heads' matrix products are counted
    apart, by each objective (`head_flops`, with `linear_flops`), on the rows they run on.

    `head_rows`: positions the head reads (1 for a classifier's [CLS]); the last layer's output
    projection and feed-forward run there only (BertEncoder), 3 * (s - head_rows) * (2h^2 + 4hI)
    fewer FLOPs. None: every position (a span head)."""
    return batch_flops(c, [seq_len], head_rows)


def batch_flops(c: BertConfig, lengths, head_rows: float | None = None) -> float:
    """Training FLOPs of the encoder for a batch of sequences of these real lengths (the encoder
    computes on real tokens only), whose head reads `head_rows` positions in all (None: every one)."""
    L, h, i = c.num_hidden_layers, c.hidden_size, c.intermediate_size
    s = np.asarray(lengths, dtype=np.float64)
    full = 3.0 * L * float((8.0 * s * h * h + 4.0 * s * h * i + 4.0 * s * s * h).sum())
    skipped = 0.0 if head_rows is None else 3.0 * (float(s.sum()) - head_rows) * (2.0 * h * h + 4.0 * h * i)
    return full - skipped


def linear_flops(rows: float, *shapes: tuple[int, int]) -> float:
    """Training FLOPs of linear layers of these (in, out) shapes applied to `rows` rows each:
    2 x rows x in x out forward, twice that backward (the gradients of the input and of the weight).
    What a head's matrix products cost (the objectives' head_flops): a classifier's pooler and
    output layer on each sequence's [CLS], a span head on every token, a masked-LM head's
    transform and vocabulary projection on the masked tokens."""
    return 3.0 * 2.0 * float(rows) * sum(float(i) * float(o) for i, o in shapes)


# --- loading Hugging Face-format checkpoints ------------------------------------------------------

def _hf_key(key: str) -> str:
    """Map a checkpoint key to this module's names: add the 'bert.' prefix of a bare BertModel,
    and rename TF-era LayerNorm gamma/beta."""
    key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
    if key.startswith(("embeddings.", "encoder.", "pooler.")):
        key = "bert." + key
    return key


def load_state_dict_file(model_dir: str | Path) -> dict[str, torch.Tensor]:
    model_dir = Path(model_dir)
    st, pt = model_dir / "model.safetensors", model_dir / "pytorch_model.bin"
    if st.is_file():
        from safetensors.torch import load_file
        return load_file(str(st))
    if pt.is_file():
        return torch.load(str(pt), map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{model_dir}: no model.safetensors or pytorch_model.bin "
                            f"(expected a Hugging Face-format model directory)")


@dataclass
class LoadReport:
    missing: list[str]      # parameters of this model not in the checkpoint (freshly initialised)
    unexpected: list[str]   # checkpoint tensors this model has no place for (ignored)
    mismatched: list[str]   # same name, different shape (freshly initialised)


def load_pretrained(model: BertHeadModel, model_dir: str | Path) -> LoadReport:
    """Copy an HF-format checkpoint into `model`, reporting every key that did not match by (HF) name."""
    return load_weights(model, load_state_dict_file(model_dir))


def load_weights(model: BertHeadModel, raw: dict[str, torch.Tensor]) -> LoadReport:
    """Copy a state dict (HF names, or this module's own) into `model`, reporting every key that did
    not match by (HF) name. A tied copy (`_tied_weights_keys`) is not missing: it is its source."""
    raw = split_qkv(raw)  # a checkpoint of this module: fused Q/K/V under HF's names
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    own = split_qkv(model.state_dict())  # this model's tensors under HF's names
    src: dict[str, torch.Tensor] = {}
    unexpected, mismatched, mismatched_own = [], [], set()
    for k, v in raw.items():
        k2 = _hf_key(k)
        if k2.endswith("position_ids"):  # a buffer in old HF checkpoints, not a parameter
            continue
        if k2 not in own:
            unexpected.append(k)
        elif own[k2].shape != v.shape:
            mismatched.append(f"{k} (checkpoint {tuple(v.shape)}, model {tuple(own[k2].shape)})")
            mismatched_own.add(k2)
        else:
            src[k2] = v
    missing = sorted(k for k in own if k not in src and k not in mismatched_own and k not in tied)
    model.load_state_dict(src, strict=False)  # BertSelfAttention fuses query/key/value as it loads
    return LoadReport(missing=missing, unexpected=sorted(unexpected), mismatched=sorted(mismatched))


QKV = ("query", "key", "value")  # HF's names of the three projections fused in BertSelfAttention.qkv


def split_qkv(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with every fused `...attention.self.qkv.{weight,bias}` as HF's query, key and
    value tensors (views: rows 0:H, H:2H, 2H:3H), the other entries as they are, in order."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        head, _, kind = name.rpartition(".")
        if head.endswith("attention.self.qkv"):
            for part, piece in zip(QKV, t.chunk(3)):
                out[f"{head[:-len('qkv')]}{part}.{kind}"] = piece
        else:
            out[name] = t
    return out


def fuse_qkv(state: dict, prefix: str, current: dict[str, torch.Tensor]) -> None:
    """In place: HF's `{prefix}query/key/value.{weight,bias}` -> `{prefix}qkv.{weight,bias}`
    (concatenated in that order); a part the state lacks keeps its value from `current`, the
    module's own fused tensors (so a partial checkpoint loads what it has)."""
    for kind in ("weight", "bias"):
        names = [f"{prefix}{part}.{kind}" for part in QKV]
        if any(n in state for n in names) and f"{prefix}qkv.{kind}" not in state:
            own = current[kind].chunk(3)
            state[f"{prefix}qkv.{kind}"] = torch.cat([state.pop(n) if n in state else own[i]
                                                      for i, n in enumerate(names)])


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s weights under Hugging Face names, on the CPU, each tensor once: what an exported
    model.safetensors holds (the reverse of `load_pretrained`; the only other place that knows the
    names). Tied weights (an MLM decoder sharing the word embeddings) are saved once, as HF's
    save_pretrained does: a model lists the names that are copies in `_tied_weights_keys` (HF's
    attribute: a list of names, or a {copy: source} dict), and those are dropped where they share
    memory with another tensor; otherwise the first name in state_dict order is kept."""
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    state = split_qkv(model.state_dict())  # fused Q/K/V as HF's query, key, value
    groups: dict[tuple, list[str]] = {}
    for name, t in state.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        groups.setdefault(key, []).append(name)
    keep = set()
    for names in groups.values():
        kept = [n for n in names if n not in tied] or names
        keep.add(kept[0])
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in state.items():  # state_dict order
        if name not in keep:
            continue
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t  # safetensors refuses tensors that share memory
        seen.add(ptr)
    return out
