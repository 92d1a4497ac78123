"""A deterministic, GLUE-shaped, learnable task that needs no files (for benchmarks anywhere).

Sentence pairs of random lengths; the label says whether the pair holds more tokens from a small
"positive" id set than from a "negative" one (20 ids each, among noise tokens): a bag-of-words rule
that a BERT learns in a few hundred steps (tests/test_features.py shows it). The data depend only on their own fixed seed and the sizes, never on the run's --seed, so
every run of a benchmark sees the same examples.
"""

from __future__ import annotations

import numpy as np

from .features import Features

DATA_SEED = 20201124
CLS, SEP = 101, 102  # BERT uncased vocabulary ids; any vocabulary >= 3000 ids works


def make_split(n: int, max_seq_length: int, split: str, vocab_size: int = 30522) -> Features:
    if vocab_size < 3000:
        raise ValueError(f"synthetic task: vocabulary of {vocab_size} ids is too small (needs >= 3000)")
    rng = np.random.default_rng([DATA_SEED, {"train": 0, "dev": 1}[split], max_seq_length])
    pos_lo, neg_lo, noise_lo, noise_hi, n_signal_ids = 1000, 1500, 2000, min(vocab_size, 8000), 20
    labels = rng.integers(0, 2, size=n)
    ids, types = [], []
    min_len = min(8, max_seq_length)
    for y in labels:
        total = int(rng.integers(min_len, max_seq_length + 1))
        body = max(total - 3, 2)  # [CLS] a [SEP] b [SEP]
        la = int(rng.integers(1, body))
        toks = rng.integers(noise_lo, noise_hi, size=body)
        # About a quarter of the tokens carry signal; the label's side gets 75% of them.
        signal = rng.random(body) < 0.25
        to_pos = rng.random(body) < (0.75 if y == 1 else 0.25)
        toks[signal & to_pos] = rng.integers(pos_lo, pos_lo + n_signal_ids, size=int((signal & to_pos).sum()))
        toks[signal & ~to_pos] = rng.integers(neg_lo, neg_lo + n_signal_ids, size=int((signal & ~to_pos).sum()))
        seq = [CLS, *toks[:la].tolist(), SEP, *toks[la:].tolist(), SEP][:max_seq_length]
        ids.append(seq)
        types.append([0] * (la + 2) + [1] * (len(seq) - la - 2))
    return Features.from_lists(ids, [t[: len(s)] for t, s in zip(types, ids)], labels.astype(np.int64))
