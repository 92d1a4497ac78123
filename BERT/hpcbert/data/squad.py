"""SQuAD v1.1 / v2.0: reading the official JSON, windowed features, and answers from logits.

Features follow Google's BERT `run_squad.py`: `[CLS] question [SEP] context-window [SEP]`, the
question cut to `max_query_length` tokens, the context cut into windows of at most
`max_seq_length - len(question) - 3` tokens whose starts are `doc_stride` tokens apart (the
reference's meaning of stride: the step, not the overlap), and each context token "belongs" to the
window where it has the most context on both sides (`_check_is_max_context`), so that when answers
are read back a span is only taken from that window. Where the reference maps characters to words
and words to word pieces, this maps characters straight to tokens with the fast tokenizer's
offsets, which point into the original context text even after lower-casing and accent stripping.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .squad_metrics import normalize_answer

__all__ = ["Answer", "SquadExample", "SquadFeatures", "read_squad", "build_features", "predict_answers"]


@dataclass(frozen=True)
class Answer:
    text: str
    answer_start: int  # character offset into the context


@dataclass(frozen=True)
class SquadExample:
    id: str
    question: str
    context: str
    answers: tuple[Answer, ...]  # empty for an unanswerable (v2.0) question
    is_impossible: bool
    title: str = ""


# --- reading -------------------------------------------------------------------------------------

def _get(obj, key: str, kind, where: str, path, what: str):
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: {where}: expected a JSON object, got {type(obj).__name__}")
    if key not in obj:
        raise ValueError(f"{path}: {where}.{key}: missing; expected {what}")
    v = obj[key]
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise ValueError(f"{path}: {where}.{key}: expected {what}, got {json.dumps(v)[:60]}")
    return v


def read_squad(path: str | os.PathLike) -> tuple[str, list[SquadExample]]:
    """(version, examples) from an official SQuAD JSON file. version is "1.1" or "2.0": "2.0"
    when the file says so or any question carries `is_impossible`. Any structural fault raises
    ValueError naming the file and the JSON path, e.g. data[3].paragraphs[1].qas[0].answers[0]."""
    p = Path(path)
    try:
        doc = json.loads(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: byte {e.start}: not UTF-8 (SQuAD files are UTF-8 JSON)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}:{e.lineno}:{e.colno}: malformed JSON: {e.msg}") from None
    except (ValueError, RecursionError) as e:  # an integer of over 4300 digits; nesting deeper than the stack
        raise ValueError(f"{p}: unreadable JSON ({str(e).split(':')[0]}); expected a SQuAD JSON file") from None
    data = _get(doc, "data", list, "(top level)", p, "a list of articles")
    declared = doc.get("version")
    if declared is not None and not isinstance(declared, str):
        raise ValueError(f"{p}: version: expected a string such as \"1.1\" or \"v2.0\", got {declared!r}")
    v2 = declared is not None and declared.lstrip("v").startswith("2")
    examples: list[SquadExample] = []
    seen: dict[str, str] = {}
    for ai, art in enumerate(data):
        aw = f"data[{ai}]"
        title = art.get("title", "") if isinstance(art, dict) else ""
        paras = _get(art, "paragraphs", list, aw, p, "a list of paragraphs")
        for pi, para in enumerate(paras):
            pw = f"{aw}.paragraphs[{pi}]"
            context = _get(para, "context", str, pw, p, "the context text (a string)")
            if not context.strip():
                raise ValueError(f"{p}: {pw}.context: empty; expected the paragraph text")
            for qi, qa in enumerate(_get(para, "qas", list, pw, p, "a list of questions")):
                qw = f"{pw}.qas[{qi}]"
                qid = _get(qa, "id", str, qw, p, "the question id (a string)")
                if qid in seen:
                    raise ValueError(f"{p}: {qw}.id: {qid!r} repeats the id of {seen[qid]}")
                seen[qid] = qw
                question = _get(qa, "question", str, qw, p, "the question text (a string)")
                if not question.strip():
                    raise ValueError(f"{p}: {qw}.question: empty; expected the question text")
                impossible = False
                if "is_impossible" in qa:
                    v2 = True
                    impossible = _get(qa, "is_impossible", bool, qw, p, "true or false")
                answers = []
                for ni, a in enumerate(_get(qa, "answers", list, qw, p, "a list of answers")):
                    nw = f"{qw}.answers[{ni}]"
                    text = _get(a, "text", str, nw, p, "the answer text (a string)")
                    start = _get(a, "answer_start", int, nw, p, "a character offset into the context (an integer)")
                    if not text:
                        raise ValueError(f"{p}: {nw}.text: empty; expected the answer text")
                    if start < 0 or start + len(text) > len(context):
                        raise ValueError(f"{p}: {nw}.answer_start: {start} + len(text) {len(text)} lies outside "
                                         f"the context (0..{len(context)})")
                    answers.append(Answer(text, start))
                if impossible:
                    answers = []  # v2.0: an impossible question is scored against ""
                elif not answers:
                    raise ValueError(f"{p}: {qw}.answers: empty for a question that is not is_impossible; "
                                     "expected at least one answer")
                examples.append(SquadExample(qid, question, context, tuple(answers), impossible, title))
    if not examples:
        raise ValueError(f"{p}: data: no questions found")
    return ("2.0" if v2 else "1.1"), examples


# --- features ------------------------------------------------------------------------------------

@dataclass
class SquadFeatures:
    """One row per window. Positions index the window's tokens; char_offsets are into the context."""

    input_ids: list[np.ndarray]      # each (T,) int32: [CLS] q [SEP] window [SEP]
    type_ids: list[np.ndarray]       # each (T,) int8
    char_offsets: list[np.ndarray]   # each (T, 2) int32: context char span of a context token, -1 elsewhere
    max_context: list[np.ndarray]    # each (T,) bool: this window is the token's best-context window
    example_index: np.ndarray        # (n,) int64: the example a window belongs to
    start_positions: np.ndarray      # (n,) int64: the answer's first token, 0 ([CLS]) if not inside
    end_positions: np.ndarray        # (n,) int64: the answer's last token, 0 ([CLS]) if not inside
    window_tokens: list[tuple[int, int]] = field(default_factory=list)  # (first, last+1) context token
    truncated: list[int] = field(default_factory=list)  # answerable examples no window holds whole
    unmatched: list[int] = field(default_factory=list)  # examples whose tokens read back != the answer

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def unrecoverable(self) -> list[int]:
        """Answerable examples whose gold answer no window's target reproduces."""
        return sorted(set(self.truncated) | set(self.unmatched))

    def as_features(self):
        """The ragged `features.Features` layout the batching code uses, labels (n, 2) = (start, end)."""
        from .features import Features

        labels = np.stack([self.start_positions, self.end_positions], axis=1)
        return Features.from_lists(self.input_ids, self.type_ids, labels)


def _plain(tok):
    """A copy of a `tokenizers.Tokenizer` without truncation or padding (windows are cut here)."""
    from tokenizers import Tokenizer

    t = Tokenizer.from_str(tok.to_str())
    t.no_truncation()
    t.no_padding()
    return t


def _spans(n: int, max_doc: int, stride: int) -> list[tuple[int, int]]:
    # run_squad.py: windows of at most max_doc tokens, starts `stride` apart, the last one ending at n.
    out, start = [], 0
    while True:
        length = min(n - start, max_doc)
        out.append((start, start + length))
        if start + length >= n:
            return out
        start += min(length, stride)


def _best_window(spans: list[tuple[int, int]], n: int) -> np.ndarray:
    """(n,) index of the window where each token has max(min(left, right) + 0.01 * length)
    context, the first such window on ties (run_squad.py `_check_is_max_context`)."""
    pos = np.arange(n)
    score = np.full((len(spans), n), -np.inf)
    for w, (s, e) in enumerate(spans):
        inside = slice(s, e)
        score[w, inside] = np.minimum(pos[inside] - s, e - 1 - pos[inside]) + 0.01 * (e - s)
    return score.argmax(axis=0)


def build_features(examples: list[SquadExample], tok, max_seq_length: int = 384, doc_stride: int = 128,
                   max_query_length: int = 64) -> SquadFeatures:
    """Windows of every example, tokenised with a `tokenizers.Tokenizer` (e.g. features.load_tokenizer).
    The training target is the first answer's first and last token when a window holds all of it."""
    if max_query_length < 1:
        raise ValueError(f"max_query_length: {max_query_length}; expected a positive number of tokens")
    if doc_stride < 1:
        raise ValueError(f"doc_stride: {doc_stride}; expected a positive number of tokens")
    t = _plain(tok)
    cls_id, sep_id = t.token_to_id("[CLS]"), t.token_to_id("[SEP]")
    if cls_id is None or sep_id is None:
        raise ValueError("tokenizer: its vocabulary has no [CLS] or [SEP] token (expected a BERT vocabulary)")
    contexts = list(dict.fromkeys(e.context for e in examples))  # each paragraph tokenised once
    ctx_index = {c: i for i, c in enumerate(contexts)}
    ctx_enc = t.encode_batch(contexts, add_special_tokens=False)
    ctx_ids = [np.asarray(c.ids, dtype=np.int32) for c in ctx_enc]
    ctx_off = [np.asarray(c.offsets, dtype=np.int32).reshape(-1, 2) for c in ctx_enc]
    ctx_windows: dict[tuple[int, int], tuple[list, np.ndarray]] = {}
    q_enc = t.encode_batch([e.question for e in examples], add_special_tokens=False)

    out = SquadFeatures([], [], [], [], np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    ex_idx, starts, ends = [], [], []
    for i, (ex, q) in enumerate(zip(examples, q_enc)):
        c = ctx_index[ex.context]
        ids, offs = ctx_ids[c], ctx_off[c]
        n = len(ids)
        if n == 0:
            raise ValueError(f"SQuAD example {ex.id!r}: the context tokenises to nothing")
        q_ids = np.asarray(q.ids[:max_query_length], dtype=np.int32)
        max_doc = max_seq_length - len(q_ids) - 3
        if max_doc < 1:
            raise ValueError(f"max_seq_length {max_seq_length} leaves no room for context after the "
                             f"{len(q_ids)}-token question of {ex.id!r} and 3 special tokens; raise it or "
                             f"lower max_query_length ({max_query_length})")
        key = (c, max_doc)
        if key not in ctx_windows:
            spans = _spans(n, max_doc, doc_stride)
            ctx_windows[key] = (spans, _best_window(spans, n))
        spans, best = ctx_windows[key]

        tok_s = tok_e = -1
        if not ex.is_impossible:
            a = ex.answers[0]
            cs, ce = a.answer_start, a.answer_start + len(a.text)
            # First token ending after the answer's first char; last token starting before its end.
            tok_s = int(np.searchsorted(offs[:, 1], cs, side="right"))
            tok_e = int(np.searchsorted(offs[:, 0], ce, side="left")) - 1
            ok = 0 <= tok_s <= tok_e < n and normalize_answer(
                ex.context[offs[tok_s, 0]:offs[tok_e, 1]]) == normalize_answer(a.text)
            if not ok:
                out.unmatched.append(i)
            if not any(s <= tok_s and tok_e < e for s, e in spans):
                out.truncated.append(i)
        head = len(q_ids) + 2
        for w, (s, e) in enumerate(spans):
            L = e - s
            out.input_ids.append(np.concatenate([[cls_id], q_ids, [sep_id], ids[s:e], [sep_id]]).astype(np.int32))
            out.type_ids.append(np.concatenate([np.zeros(head, np.int8), np.ones(L + 1, np.int8)]))
            co = np.full((head + L + 1, 2), -1, dtype=np.int32)
            co[head:head + L] = offs[s:e]
            out.char_offsets.append(co)
            mc = np.zeros(head + L + 1, dtype=bool)
            mc[head:head + L] = best[s:e] == w
            out.max_context.append(mc)
            out.window_tokens.append((s, e))
            ex_idx.append(i)
            if tok_s >= 0 and s <= tok_s and tok_e < e:
                starts.append(tok_s - s + head)
                ends.append(tok_e - s + head)
            else:
                starts.append(0)
                ends.append(0)
    out.example_index = np.asarray(ex_idx, dtype=np.int64)
    out.start_positions = np.asarray(starts, dtype=np.int64)
    out.end_positions = np.asarray(ends, dtype=np.int64)
    return out


# --- answers from logits -------------------------------------------------------------------------

def predict_answers(examples: list[SquadExample], features: SquadFeatures, start_logits, end_logits,
                    n_best: int = 20, max_answer_length: int = 30, null_threshold: float = 0.0,
                    version: str | None = None) -> tuple[dict[str, str], dict[str, list[dict]], dict[str, float]]:
    """(predictions {id: text}, n-best {id: [{text, start_logit, end_logit, probability}]},
    null odds {id: null score - best span score}) as run_squad.py `write_predictions`.

    start_logits/end_logits: one row per window (a list of (T_i,) arrays, or (n, T) padded).
    Every window of an example is combined once; spans must lie in the context, end >= start,
    be at most max_answer_length tokens, and start in a token's best-context window. version
    "2.0" (default: "2.0" if any example is_impossible) predicts "" when the null score ([CLS]
    start + end, the smallest over the example's windows) beats the best span by more than
    null_threshold. The null odds suit `squad_metrics.evaluate_v2(na_probs=...)`."""
    if len(start_logits) != len(features) or len(end_logits) != len(features):
        raise ValueError(f"predict_answers: {len(start_logits)} start / {len(end_logits)} end logit rows for "
                         f"{len(features)} windows; expected one row per window")
    v2 = (version or ("2.0" if any(e.is_impossible for e in examples) else "1.1")).lstrip("v").startswith("2")
    by_example: list[list[int]] = [[] for _ in examples]
    for f, i in enumerate(features.example_index):
        by_example[int(i)].append(f)
    preds, nbest_out, null_odds = {}, {}, {}
    for i, ex in enumerate(examples):
        cands = []  # (score, start_logit, end_logit, text)
        null_score, null_parts = math.inf, (0.0, 0.0)
        for f in by_example[i]:
            T = len(features.input_ids[f])
            s = np.asarray(start_logits[f], dtype=np.float64)[:T]
            e = np.asarray(end_logits[f], dtype=np.float64)[:T]
            if s[0] + e[0] < null_score:
                null_score, null_parts = s[0] + e[0], (float(s[0]), float(e[0]))
            co, mc = features.char_offsets[f], features.max_context[f]
            si = np.argsort(-s, kind="stable")[:n_best]
            ei = np.argsort(-e, kind="stable")[:n_best]
            ctx = co[:, 0] >= 0
            length = ei[None, :] - si[:, None] + 1
            ok = (ctx[si] & mc[si])[:, None] & ctx[ei][None, :] & (length >= 1) & (length <= max_answer_length)
            score = s[si][:, None] + e[ei][None, :]
            ok &= np.isfinite(score)
            for a, b in zip(*np.nonzero(ok)):
                st, en = si[a], ei[b]
                cands.append((score[a, b], float(s[st]), float(e[en]), ex.context[co[st, 0]:co[en, 1]]))
        cands.sort(key=lambda x: -x[0])
        nbest, seen = [], set()
        for sc, sl, el, text in cands:
            if len(nbest) >= n_best:
                break
            if text in seen:
                continue
            seen.add(text)
            nbest.append({"text": text, "start_logit": sl, "end_logit": el})
        best_span = nbest[0] if nbest else None
        if v2 and math.isfinite(null_score) and "" not in seen:
            nbest.append({"text": "", "start_logit": null_parts[0], "end_logit": null_parts[1]})
        if nbest:
            totals = np.array([x["start_logit"] + x["end_logit"] for x in nbest])
            p = np.exp(totals - totals.max())
            p /= p.sum()
            for x, pr in zip(nbest, p):
                x["probability"] = float(pr)
        nbest_out[ex.id] = nbest
        if not v2:
            preds[ex.id] = best_span["text"] if best_span else ""
            continue
        best_total = best_span["start_logit"] + best_span["end_logit"] if best_span else -math.inf
        diff = null_score - best_total if math.isfinite(null_score) else -math.inf
        null_odds[ex.id] = float(diff)
        preds[ex.id] = "" if (best_span is None or diff > null_threshold) else best_span["text"]
    return preds, nbest_out, null_odds
