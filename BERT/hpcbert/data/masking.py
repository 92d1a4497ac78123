"""Masked-LM targets, drawn on the fly: a fresh mask every time a sequence is seen.

BERT's recipe (Devlin et al. 2019; create_pretraining_data.py): select `prob` of a sequence's
tokens for prediction (special tokens and padding never), then replace 80% of the selected ones by
[MASK], 10% by a random token and leave 10% unchanged. With whole-word masking a word (a piece and
the `##` pieces after it) is selected whole or not at all.

Every random number is counter-based: a hash (SplitMix64, Steele et al. 2014, the seeding
generator of java.util.SplittableRandom) of (seed, epoch, sequence index, position, purpose). So the
mask of a sequence depends on nothing else, not on the batch it is in, the rank that draws it, how
many ranks there are or whether the run was resumed; every epoch draws a fresh one, and evaluation
(epoch None) always the same one, whatever the run's seed. The draw is vectorised over a batch.

Counts: a sequence with c candidate tokens gets floor(prob * c) selected, plus one with probability
frac(prob * c) (stochastic rounding: the expected fraction is exactly `prob`, where BERT's round()
drifts with the length: round(0.15 * 126) = 19 is 15.1%). `count()` gives it from c alone, so the
normaliser of a global batch needs no token. Whole-word masking takes words in random order while
they fit in that count (BERT's rule), so its count is only known after the draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_TAG = 0x6D6C6D  # "mlm": keys of other users of the hash differ
# Purposes: one stream of numbers per position for each decision.
_SELECT, _ACTION, _RANDOM_ID, _COUNT = 0, 1, 2, 3
EVAL_EPOCH_CODE = 0  # evaluation; training epoch e uses e + 1


def mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on uint64 (wrapping arithmetic)."""
    z = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def sequence_keys(seed: int, epoch: int | None, indices: np.ndarray) -> np.ndarray:
    """(n,) uint64 key of each sequence for this epoch; evaluation (epoch None) ignores the seed."""
    code = EVAL_EPOCH_CODE if epoch is None else epoch + 1
    base = mix(np.uint64(_TAG))
    base = mix(base ^ np.uint64(0 if epoch is None else seed & 0xFFFFFFFFFFFFFFFF))
    base = mix(base ^ np.uint64(code))
    return mix(base ^ np.asarray(indices, dtype=np.uint64))


def uniform(keys: np.ndarray, positions: np.ndarray, purpose: int) -> np.ndarray:
    """Uniforms in [0, 1) for keys (B, 1) and positions (T,) or (B, T): SplitMix64's stream of each
    key, element position * 4 + purpose."""
    counter = np.asarray(positions, dtype=np.uint64) * np.uint64(4) + np.uint64(purpose + 1)
    with np.errstate(over="ignore"):
        z = mix(keys + counter * _GOLDEN)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


@dataclass(frozen=True)
class MaskSpec:
    prob: float                      # fraction of candidate tokens selected
    mask_id: int
    special: np.ndarray              # (V,) bool: never selected ([PAD], [CLS], [SEP], [MASK], [UNK])
    replace_ids: np.ndarray          # (k,) ids a random replacement draws from (the non-special ones)
    continuation: np.ndarray | None  # (V,) bool: '##' pieces; set for whole-word masking

    @classmethod
    def from_tokenizer(cls, tok, prob: float, whole_word: bool) -> "MaskSpec":
        """Special tokens: the tokenizer's own special tokens and BERT's five by name."""
        vocab = tok.get_vocab(with_added_tokens=True)  # token -> id
        V = max(vocab.values()) + 1
        special = np.zeros(V, dtype=bool)
        names = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
        ids = [vocab[t] for t in names if t in vocab]
        ids += [i for i, t in tok.get_added_tokens_decoder().items() if t.special]
        special[ids] = True
        cont = None
        if whole_word:
            cont = np.zeros(V, dtype=bool)
            cont[[i for t, i in vocab.items() if t.startswith("##")]] = True
        return cls(prob, vocab["[MASK]"], special, np.flatnonzero(~special), cont)


def count(spec: MaskSpec, candidates: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """(n,) tokens selected in sequences with `candidates` (n,) candidate tokens (token masking)."""
    want = spec.prob * np.asarray(candidates, dtype=np.float64)
    base = np.floor(want)
    return (base + (uniform(keys, np.zeros(len(keys)), _COUNT) < want - base)).astype(np.int64)


def mask(spec: MaskSpec, ids: np.ndarray, content: np.ndarray, keys: np.ndarray
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mask a batch: ids (B, T) int64, content (B, T) bool (corpus tokens: not the [CLS]/[SEP]
    added around them, not padding), keys (B,) from sequence_keys.

    Returns (ids with the replacements (B, T), positions (m,) flat indices b*T + t of the selected
    tokens in row-major order, labels (m,) their original ids)."""
    B, T = ids.shape
    k = keys.reshape(B, 1)
    pos = np.arange(T)
    cand = content & ~spec.special[ids]
    n = count(spec, cand.sum(1), keys)
    u = uniform(k, pos, _SELECT)
    u[~cand] = 2.0  # after every candidate
    if spec.continuation is None:
        order = np.argsort(u, axis=1, kind="stable")
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.broadcast_to(pos, (B, T)), axis=1)
        selected = rank < n[:, None]
    else:
        selected = _whole_words(spec, ids, cand, u, n)
    positions = np.flatnonzero(selected)
    labels = ids.reshape(-1)[positions]
    act = uniform(k, pos, _ACTION).reshape(-1)[positions]
    out = ids.copy().reshape(-1)
    out[positions[act < 0.8]] = spec.mask_id
    rnd = positions[(act >= 0.8) & (act < 0.9)]
    pick = (uniform(k, pos, _RANDOM_ID).reshape(-1)[rnd] * len(spec.replace_ids)).astype(np.int64)
    out[rnd] = spec.replace_ids[pick]
    return out.reshape(B, T), positions, labels


def _whole_words(spec: MaskSpec, ids: np.ndarray, cand: np.ndarray, u: np.ndarray, n: np.ndarray) -> np.ndarray:
    """BERT's whole-word rule: words (a candidate piece and the '##' pieces right after it) in the
    order of the uniform at their first piece, each taken while the total stays <= n; a word that
    would exceed it is skipped and the next one tried."""
    B, T = ids.shape
    prev = np.zeros_like(cand)
    prev[:, 1:] = cand[:, :-1]
    starts = cand & ~(spec.continuation[ids] & prev)  # a '##' piece after a candidate continues it
    word = np.cumsum(starts, axis=1) - 1              # (B, T) word number of each candidate piece
    selected = np.zeros_like(cand)
    for b in range(B):
        first = np.flatnonzero(starts[b])
        if not len(first) or not n[b]:
            continue
        sizes = np.bincount(word[b][cand[b]], minlength=len(first))
        take, total = np.zeros(len(first), dtype=bool), 0
        for w in np.argsort(u[b, first], kind="stable"):
            if total + sizes[w] <= n[b]:
                take[w], total = True, total + sizes[w]
                if total == n[b]:
                    break
        selected[b] = cand[b] & take[np.maximum(word[b], 0)]
    return selected
