"""Pre-training samples from prepared shards (data/pretrain.py): which tokens make each sequence.

One split of a prepared directory is one token stream (its shards in order, memory-mapped), with
document and line offsets. Two ways to cut it into sequences, both fixed once for the run (the
masks, drawn per epoch by data/masking.py, are what changes between passes):

packed (default)  RoBERTa's FULL-SENTENCES (Liu et al. 2019, sec. 4.2): whole lines (BERT's
                  sentences) packed in corpus order up to max_seq_length - 2 tokens, crossing
                  document boundaries with a [SEP]; a line longer than that is cut into full
                  pieces. [CLS] content [SEP]. Every token of the split is in exactly one sequence.
nsp               BERT's sentence pairs (create_pretraining_data.py): contiguous chunks of a
                  document of max_seq_length - 3 tokens (10% of them shorter, at random), each cut
                  in two at a line boundary inside it (chosen at random; at a random token where
                  the chunk holds no boundary, as for a paragraph-long line); with probability 1/2
                  the second part is replaced by as many tokens from a random line of another
                  document (label 1, "random next") and given back to the next chunk.
                  [CLS] A [SEP] B [SEP], token types 0 for [CLS] A [SEP] and 1 for B [SEP].

The training split's pairs are drawn once from the run's seed (BERT draws them once, offline); the
evaluation split's from a fixed seed, so every run is scored on the same pairs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from .pretrain import Shard

SHORT_SEQ_PROB = 0.1  # BERT's short_seq_prob: chunks shorter than the maximum, so short inputs are seen
EVAL_PAIR_SEED = 12345


class Stream:
    """The shards of one split as one token stream: global token positions, document and line starts."""

    def __init__(self, shards: list[Shard], special_ids: np.ndarray):
        self.shards = shards
        sizes = [len(s.tokens) for s in shards]
        self.shard_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # (shards + 1,)
        self.n_tokens = int(self.shard_start[-1])
        # (documents + 1,) and (lines + 1,) global starts, the stream's end last
        self.doc_starts = np.concatenate([s.offsets[:-1] + a for s, a in zip(shards, self.shard_start)]
                                         + [[self.n_tokens]]).astype(np.int64)
        self.line_starts = np.concatenate([s.lines[:-1] + a for s, a in zip(shards, self.shard_start)]
                                          + [[self.n_tokens]]).astype(np.int64)
        # special tokens written in the text ("[SEP]" in a document): never selected for masking
        self.special_at = np.concatenate([np.flatnonzero(np.isin(s.tokens, special_ids)) + a
                                          for s, a in zip(shards, self.shard_start)] + [[]]).astype(np.int64)

    def gather(self, g: np.ndarray) -> np.ndarray:
        """The tokens at global positions `g` (int64), from whichever shard holds each."""
        k = np.searchsorted(self.shard_start, g, side="right") - 1
        out = np.empty(len(g), dtype=np.int64)
        for shard in np.unique(k):
            at = k == shard
            out[at] = self.shards[shard].tokens[g[at] - self.shard_start[shard]]
        return out

    def specials_in(self, g0: np.ndarray, g1: np.ndarray) -> np.ndarray:
        """(n,) special tokens written in the text within [g0, g1) of each range."""
        return np.searchsorted(self.special_at, g1) - np.searchsorted(self.special_at, g0)

    def doc_starts_inside(self, g0: np.ndarray, g1: np.ndarray) -> np.ndarray:
        """(n,) document starts d with g0 < d < g1: where a packed sequence crosses into the next."""
        return np.maximum(0, np.searchsorted(self.doc_starts, g1, "left")
                          - np.searchsorted(self.doc_starts, g0, "right"))


def _spans(n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For counts n (k,): the row r and the offset 0..n[r]-1 of every element of the k spans, flat."""
    n = np.asarray(n, dtype=np.int64)
    row = np.repeat(np.arange(len(n)), n)
    return row, np.arange(len(row)) - np.repeat(np.cumsum(n) - n, n)


def pack_lines(stream: Stream, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """FULL-SENTENCES: (g0, g1) stream ranges of sequences of whole lines, at most `cap` tokens
    including one [SEP] per document boundary crossed; a line longer than `cap` gives full pieces."""
    ls = stream.line_starts.tolist()
    first = set(stream.doc_starts[:-1].tolist())
    out0: list[int] = []
    out1: list[int] = []
    cur0, cur = 0, 0  # start of the open sequence, its tokens so far (separators included)
    for s, e in zip(ls[:-1], ls[1:]):
        n = e - s
        sep = 1 if cur and s in first else 0
        if cur and cur + sep + n > cap:  # close the open sequence before this line
            out0.append(cur0)
            out1.append(s)
            cur = sep = 0
        while not cur and n > cap:  # a line longer than a sequence: cut at token positions
            out0.append(s)
            out1.append(s + cap)
            s, n = s + cap, n - cap
        if not cur:
            cur0 = s
        cur += sep + n
    if cur:
        out0.append(cur0)
        out1.append(ls[-1])
    return np.asarray(out0, np.int64), np.asarray(out1, np.int64)


def make_pairs(stream: Stream, max_tokens: int, seed: int) -> tuple[np.ndarray, ...]:
    """Next-sentence pairs: (a0, a1, b0, b1, is_random) arrays, A = stream[a0:a1], B = stream[b0:b1]."""
    rng = np.random.default_rng([seed, 0x6E7370])
    ds, ls = stream.doc_starts, stream.line_starts
    n_docs = len(ds) - 1
    out: list[tuple[int, int, int, int, int]] = []
    for d in range(n_docs):
        s, e = int(ds[d]), int(ds[d + 1])
        pos = s
        while pos < e:
            target = max_tokens if rng.random() >= SHORT_SEQ_PROB else int(rng.integers(2, max_tokens + 1))
            end = min(e, pos + target)
            lo, hi = np.searchsorted(ls, pos, "right"), np.searchsorted(ls, end, "left")
            inner = ls[lo:hi]  # line starts strictly inside the chunk
            if end - pos == 1:
                a_end, random_next = end, True  # nothing to cut: a random second part
            else:
                a_end = int(inner[rng.integers(len(inner))]) if len(inner) else int(rng.integers(pos + 1, end))
                random_next = rng.random() < 0.5
            if random_next:
                other = int(rng.integers(n_docs - 1)) if n_docs > 1 else d
                other += other >= d and n_docs > 1  # any document but this one
                o0, o1 = int(ds[other]), int(ds[other + 1])
                lines = ls[np.searchsorted(ls, o0, "left"):np.searchsorted(ls, o1, "left")]
                b0 = int(lines[rng.integers(len(lines))])
                b1 = min(o1, b0 + max(1, target - (a_end - pos)))
                out.append((pos, a_end, b0, b1, 1))
                pos = a_end  # the unused second part starts the next chunk
            else:
                out.append((pos, a_end, a_end, end, 0))
                pos = end
    arr = np.asarray(out, dtype=np.int64).reshape(-1, 5)
    return tuple(arr[:, i] for i in range(5))


@dataclass
class Sequences:
    """What the masked-LM objective trains on: `len()`, `.lengths` (tokens of each sequence with its
    [CLS]/[SEP]) and `.fingerprint()`, the Dataset protocol of objectives/, and `assemble`."""

    stream: Stream
    kind: str                     # "packed" or "nsp"
    ranges: tuple[np.ndarray, ...]  # packed: (g0, g1); nsp: (a0, a1, b0, b1, is_random)
    lengths: np.ndarray           # (n,) tokens per sequence, [CLS]/[SEP] included
    candidates: np.ndarray        # (n,) corpus tokens that may be selected (special tokens excluded)
    cls_id: int
    sep_id: int
    pad_id: int
    origin: str                   # what the sequences were cut from (for the fingerprint)

    @classmethod
    def packed(cls, stream: Stream, max_seq_length: int, ids: dict, origin: str) -> "Sequences":
        g0, g1 = pack_lines(stream, max_seq_length - 2)
        seps = stream.doc_starts_inside(g0, g1)
        return cls(stream, "packed", (g0, g1), (g1 - g0) + seps + 2, (g1 - g0) - stream.specials_in(g0, g1),
                   ids["cls_id"], ids["sep_id"], ids["pad_id"], origin)

    @classmethod
    def pairs(cls, stream: Stream, max_seq_length: int, ids: dict, seed: int, origin: str) -> "Sequences":
        a0, a1, b0, b1, rnd = make_pairs(stream, max_seq_length - 3, seed)
        cand = (a1 - a0) - stream.specials_in(a0, a1) + (b1 - b0) - stream.specials_in(b0, b1)
        return cls(stream, "nsp", (a0, a1, b0, b1, rnd), (a1 - a0) + (b1 - b0) + 3, cand,
                   ids["cls_id"], ids["sep_id"], ids["pad_id"], f"{origin}; pair seed {seed}")

    def __len__(self) -> int:
        return len(self.lengths)

    def fingerprint(self) -> str:
        h = hashlib.sha256(self.origin.encode())
        for a in self.ranges:
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()[:16]

    def assemble(self, indices: np.ndarray, pad_to: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """-> ids (B, T) int64 padded with [PAD], token types (B, T), content (B, T) bool (corpus
        tokens), lengths (B,), next-sentence labels (B,) (nsp; else None)."""
        idx = np.asarray(indices, dtype=np.int64)
        lengths = self.lengths[idx]
        B, T = len(idx), int(pad_to or lengths.max())
        ids = np.full((B, T), self.pad_id, dtype=np.int64)
        types = np.zeros((B, T), dtype=np.int64)
        content = np.zeros((B, T), dtype=bool)
        ids[:, 0] = self.cls_id
        rows = np.arange(B)
        if self.kind == "packed":
            # [CLS] g0..g1 [SEP], with a [SEP] before each document start inside: a token moves one
            # column right per document start at or before it, the k-th [SEP] sits k columns right
            g0, g1 = self.ranges[0][idx], self.ranges[1][idx]
            starts = self.stream.doc_starts
            first = np.searchsorted(starts, g0, "right")  # the first document start after g0
            seps = np.maximum(0, np.searchsorted(starts, g1, "left") - first)
            row, off = _spans(g1 - g0)
            g = g0[row] + off
            col = 1 + off + np.searchsorted(starts, g, "right") - first[row]
            ids[row, col] = self.stream.gather(g)
            content[row, col] = True
            srow, k = _spans(seps)
            ids[srow, 1 + starts[first[srow] + k] - g0[srow] + k] = self.sep_id
            ids[rows, (g1 - g0) + seps + 1] = self.sep_id
        else:
            # [CLS] A [SEP] B [SEP], B's type 1 (its [SEP] included)
            a0, a1, b0, b1 = (r[idx] for r in self.ranges[:4])
            na, nb = a1 - a0, b1 - b0
            for start, n, col0 in ((a0, na, np.ones_like(na)), (b0, nb, na + 2)):
                row, off = _spans(n)
                cols = col0[row] + off
                ids[row, cols] = self.stream.gather(start[row] + off)
                content[row, cols] = True
            ids[rows, na + 1] = ids[rows, na + nb + 2] = self.sep_id
            row, off = _spans(nb + 1)
            types[row, na[row] + 2 + off] = 1
        nsp = self.ranges[4][idx].copy() if self.kind == "nsp" else None
        return ids, types, content, lengths, nsp
