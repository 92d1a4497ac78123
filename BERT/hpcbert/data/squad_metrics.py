"""The official SQuAD v1.1 and v2.0 metrics, re-implemented from the evaluation scripts' definitions.

v1.1 (`evaluate-v1.1.py`): exact match and token F1 of the normalised answer, the maximum over the
reference answers, averaged over every question (a question without a prediction scores 0).
v2.0 (`evaluate-v2.0.py`): the same, with an unanswerable question scored against the empty string,
a HasAns_/NoAns_ breakdown, and, given no-answer probabilities, the best_exact/best_f1 thresholds.
The two scripts differ in one corner, kept here: when the gold or the prediction normalises to no
token, v1.1's F1 is 0 while v2.0's is 1 if both are empty.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Mapping

__all__ = ["normalize_answer", "exact_match", "f1_v1", "f1_v2", "evaluate_v1", "evaluate_v2"]

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower-case, drop ASCII punctuation, drop the articles a/an/the, collapse whitespace
    (in that order, as both official scripts)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def exact_match(gold: str, pred: str) -> int:
    return int(normalize_answer(gold) == normalize_answer(pred))


def _overlap(gold_toks: list[str], pred_toks: list[str]) -> float:
    num_same = sum((Counter(gold_toks) & Counter(pred_toks)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_toks)
    recall = num_same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def f1_v1(gold: str, pred: str) -> float:
    """Token F1 as evaluate-v1.1.py: 0 when nothing is shared (also when either is empty)."""
    return _overlap(normalize_answer(gold).split(), normalize_answer(pred).split())


def f1_v2(gold: str, pred: str) -> float:
    """Token F1 as evaluate-v2.0.py: if either side has no token, 1 when both have none, else 0."""
    g = normalize_answer(gold).split() if gold else []
    p = normalize_answer(pred).split() if pred else []
    if not g or not p:
        return float(g == p)
    return _overlap(g, p)


def _questions(examples: Iterable) -> list:
    """Accept SquadExample objects (squad.read_squad) or dicts with id/answers."""
    out = []
    for e in examples:
        if isinstance(e, Mapping):
            out.append((e["id"], [a["text"] for a in e.get("answers", [])]))
        else:
            out.append((e.id, [a.text for a in e.answers]))
    return out


def evaluate_v1(examples: Iterable, predictions: Mapping[str, str]) -> dict:
    """{'exact_match', 'f1'} in percent over every question, plus 'total' and 'missing' (questions
    without a prediction, scored 0 as the official script does)."""
    qs = _questions(examples)
    em = f1 = 0.0
    missing = 0
    for qid, golds in qs:
        if qid not in predictions:
            missing += 1
            continue
        pred = predictions[qid]
        em += max(exact_match(g, pred) for g in golds)
        f1 += max(f1_v1(g, pred) for g in golds)
    n = len(qs)
    if n == 0:
        raise ValueError("evaluate_v1: no questions to score")
    return {"exact_match": 100.0 * em / n, "f1": 100.0 * f1 / n, "total": n, "missing": missing}


def _best_thresh(preds, scores, na_probs, has_ans) -> tuple[float, float]:
    # evaluate-v2.0.py find_best_thresh: start from "predict no answer everywhere" (every NoAns
    # question right), then walk the questions by rising no-answer probability, switching each to
    # its span prediction, and keep the best running score and the probability where it occurred.
    cur = best = sum(1 for v in has_ans.values() if not v)
    thresh = 0.0
    for qid in sorted(na_probs, key=lambda k: na_probs[k]):
        if qid not in scores:
            continue
        if has_ans[qid]:
            diff = scores[qid]
        else:
            diff = -1 if preds[qid] else 0
        cur += diff
        if cur > best:
            best, thresh = cur, na_probs[qid]
    return 100.0 * best / len(scores), thresh


def evaluate_v2(examples: Iterable, predictions: Mapping[str, str], na_probs: Mapping[str, float] | None = None,
                na_prob_thresh: float = 1.0) -> dict:
    """The evaluate-v2.0.py result: exact, f1, total, HasAns_*/NoAns_* and, when `na_probs` (the
    probability, or any score rising with it, that a question has no answer) is given,
    best_exact, best_exact_thresh, best_f1, best_f1_thresh. A prediction "" means "no answer".
    Every question needs a prediction (the official script fails on a missing HasAns one)."""
    qs = _questions(examples)
    if not qs:
        raise ValueError("evaluate_v2: no questions to score")
    missing = [qid for qid, _ in qs if qid not in predictions]
    if missing:
        raise ValueError(f"evaluate_v2: {len(missing)} questions have no prediction (first: {missing[0]!r}); "
                         "predict '' for no answer")
    has_ans = {qid: bool(golds) for qid, golds in qs}
    exact_raw, f1_raw = {}, {}
    for qid, golds in qs:
        # Only gold answers that normalise to something count; none left -> the empty answer.
        golds = [g for g in golds if normalize_answer(g)] or [""]
        pred = predictions[qid]
        exact_raw[qid] = max(exact_match(g, pred) for g in golds)
        f1_raw[qid] = max(f1_v2(g, pred) for g in golds)
    probs = dict(na_probs) if na_probs is not None else {qid: 0.0 for qid in predictions}

    def thresholded(raw):
        return {q: (float(not has_ans[q]) if probs[q] > na_prob_thresh else s) for q, s in raw.items()}

    exact_t, f1_t = thresholded(exact_raw), thresholded(f1_raw)

    def block(ids):
        n = len(ids)
        return {"exact": 100.0 * sum(exact_t[q] for q in ids) / n, "f1": 100.0 * sum(f1_t[q] for q in ids) / n,
                "total": n}

    out = block(list(exact_t))
    for prefix, ids in (("HasAns", [q for q, v in has_ans.items() if v]),
                        ("NoAns", [q for q, v in has_ans.items() if not v])):
        if ids:
            out.update({f"{prefix}_{k}": v for k, v in block(ids).items()})
    if na_probs is not None:
        out["best_exact"], out["best_exact_thresh"] = _best_thresh(predictions, exact_raw, probs, has_ans)
        out["best_f1"], out["best_f1_thresh"] = _best_thresh(predictions, f1_raw, probs, has_ans)
    return out
