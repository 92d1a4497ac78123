"""BERT encoder with a pooler and classification / regression heads, in one file.

Parameter names follow Hugging Face's BertModel so that HF-format checkpoints (config.json +
model.safetensors / pytorch_model.bin) load without a conversion table. This file knows nothing
about launching, distribution, logging or gradient checkpointing: those are applied from outside
(see policies.py), which wraps `encoder.layer[i]` in place.

Shapes: B batch, T tokens, H hidden, N heads, D = H / N head width.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


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


class BertEmbeddings(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        pos = torch.arange(T, device=input_ids.device)  # (T,)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids) + self.position_embeddings(pos)
        return self.dropout(self.LayerNorm(x))  # (B, T, H)


class BertSelfAttention(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.n_head = c.num_attention_heads
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)
        self.dropout_p = c.attention_probs_dropout_prob

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        B, T, H = x.shape
        # One GEMM for Q, K and V: the three weights concatenated are (3H, H). Cheaper than three
        # GEMMs on small hidden sizes; the parameters stay three HF-named Linear modules.
        w = torch.cat([self.query.weight, self.key.weight, self.value.weight])
        b = torch.cat([self.query.bias, self.key.bias, self.value.bias])
        q, k, v = F.linear(x, w, b).view(B, T, 3, self.n_head, H // self.n_head).permute(2, 0, 3, 1, 4)  # 3 x (B, N, T, D)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                           dropout_p=self.dropout_p if self.training else 0.0)  # (B, N, T, D)
        return y.transpose(1, 2).reshape(B, T, H)


class BertSelfOutput(nn.Module):
    def __init__(self, c: BertConfig, inner: int):
        super().__init__()
        self.dense = nn.Linear(inner, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(h)) + residual)


class BertAttention(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(c)
        self.output = BertSelfOutput(c, c.hidden_size)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        return self.output(self.self(x, attn_mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)
        # HF's "gelu" is the exact erf form; "gelu_new" / "gelu_pytorch_tanh" the tanh approximation.
        self.approximate = "none" if c.hidden_act == "gelu" else "tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x), approximate=self.approximate)


class BertLayer(nn.Module):
    """One encoder layer: the unit that gradient-checkpointing policies wrap."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.attention = BertAttention(c)
        self.intermediate = BertIntermediate(c)
        self.output = BertSelfOutput(c, c.intermediate_size)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        a = self.attention(x, attn_mask)
        return self.output(self.intermediate(a), a)


class BertEncoder(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(c) for _ in range(c.num_hidden_layers))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, attn_mask)
        return x


class BertPooler(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x[:, 0]))  # (B, H) from the [CLS] position


class BertModel(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.config = c
        self.embeddings = BertEmbeddings(c)
        self.encoder = BertEncoder(c)
        self.pooler = BertPooler(c)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids (B, T) -> (sequence output (B, T, H), pooled output (B, H), None without a pooler)."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        # Boolean mask (B, 1, 1, T): True = attend. Callers pass None when nothing is padded, which
        # lets SDPA pick its fastest kernel (checking here would be a CPU-GPU sync point).
        mask = None if attention_mask is None else attention_mask[:, None, None, :].bool()
        x = self.encoder(self.embeddings(input_ids, token_type_ids), mask)
        return x, (self.pooler(x) if self.pooler is not None else None)


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
        _, pooled = self.bert(input_ids, attention_mask, token_type_ids)
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
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

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
        x, pooled = self.bert(input_ids, attention_mask, token_type_ids)  # (B, T, H)
        if mlm_positions is not None:
            x = x.reshape(-1, x.shape[-1]).index_select(0, mlm_positions)  # (m, H)
        logits = self.cls.predictions(x)
        if not self.nsp:
            return logits
        return logits, self.cls.seq_relationship(pooled)


class BertForPreTraining(BertForMaskedLM):
    """BERT + masked-LM and next-sentence heads (pooler kept): HF's BertForPreTraining."""

    nsp = True


def flops_per_sequence(c: BertConfig, seq_len: int) -> float:
    """Training FLOPs of the encoder for one sequence: 3 * L * (8*s*h^2 + 4*s*h*I + 4*s^2*h),
    which is the familiar 3 * L * (24*s*h^2 + 4*s^2*h) when the feed-forward width I is 4h.

    Forward = 2 FLOPs per multiply-add: Q, K, V and output projections (4 h x h), the two
    feed-forward matmuls (2 h x I), and attention scores and values (2 * 2*s*h per token);
    backward = 2x forward. Source: the Megatron-LM paper (Narayanan et al. 2021, eq. 2) without
    the LM head, with I kept apart; cited in FIELD_NOTES.
    """
    L, h, s, i = c.num_hidden_layers, c.hidden_size, seq_len, c.intermediate_size
    return 3.0 * L * (8.0 * s * h * h + 4.0 * s * h * i + 4.0 * s * s * h)


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
    """Copy an HF-format checkpoint into `model`, reporting every key that did not match by name."""
    return load_weights(model, load_state_dict_file(model_dir))


def load_weights(model: BertHeadModel, raw: dict[str, torch.Tensor]) -> LoadReport:
    """Copy a state dict (HF names, or this module's own) into `model`, reporting every key that did
    not match by name. A tied copy (`_tied_weights_keys`) is not missing: it is its source."""
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    own = model.state_dict()
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
    model.load_state_dict(src, strict=False)
    return LoadReport(missing=missing, unexpected=sorted(unexpected), mismatched=sorted(mismatched))


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s weights under Hugging Face names, on the CPU, each tensor once: what an exported
    model.safetensors holds (the reverse of `load_pretrained`; the only other place that knows the
    names). Tied weights (an MLM decoder sharing the word embeddings) are saved once, as HF's
    save_pretrained does: a model lists the names that are copies in `_tied_weights_keys` (HF's
    attribute: a list of names, or a {copy: source} dict), and those are dropped where they share
    memory with another tensor; otherwise the first name in state_dict order is kept."""
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    state = model.state_dict()
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
