"""SQuAD reading, windowed features, answer read-back and the official v1.1/v2.0 metrics.

Metric expectations are computed by hand in the comments; feature expectations come from the
reference windowing rule worked out on paper and from the tokenizer's own pair encoding."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from conftest import ROOT, minilm_dir_or_skip
from hpcbert.data.squad import build_features, predict_answers, read_squad
from hpcbert.data.squad_metrics import evaluate_v1, evaluate_v2, exact_match, f1_v1, f1_v2, normalize_answer

SQUAD_DEV = ROOT.parent / "shared" / "data" / "squad" / "v1.1" / "dev-v1.1.json"


# --- metrics, by hand ----------------------------------------------------------------------------

def test_normalize_answer():
    # lower -> drop punctuation -> drop a/an/the as words -> collapse whitespace
    assert normalize_answer("The  Quick, brown fox!") == "quick brown fox"
    assert normalize_answer("An apple a day (theory)") == "apple day theory"  # 'theory' keeps 'the'
    assert normalize_answer("Denver's") == "denvers"


def test_exact_and_f1():
    assert exact_match("the Denver Broncos", "Denver Broncos.") == 1
    # gold [cat, sat, on, mat] (4), pred [cat, on, mat] (3), common 3: P = 3/3, R = 3/4,
    # F1 = 2 * 1 * 0.75 / 1.75 = 6/7
    assert f1_v1("the cat sat on the mat", "cat on a mat") == pytest.approx(6 / 7)
    # repeated tokens count with multiplicity: gold [a_, b] vs pred [b, b]: common 1, P 1/2, R 1/2 -> 0.5
    assert f1_v1("x y", "y y") == pytest.approx(0.5)
    # both normalise to nothing: v1.1 scores 0 (no common token), v2.0 scores 1 (both empty)
    assert f1_v1("the", "") == 0.0
    assert f1_v2("the", "") == 1.0
    assert f1_v2("Paris", "") == 0.0


def test_evaluate_v1_by_hand():
    ex = [
        {"id": "q1", "answers": [{"text": "Denver Broncos"}, {"text": "Broncos"}]},
        {"id": "q2", "answers": [{"text": "Santa Clara, California"}]},
        {"id": "q3", "answers": [{"text": "Levi's Stadium"}]},
    ]
    preds = {"q1": "the Broncos", "q2": "Santa Clara"}  # q3 missing: scored 0, still counted
    r = evaluate_v1(ex, preds)
    # q1: EM 1 (matches 'Broncos'), F1 1. q2: EM 0; F1: gold [santa, clara, california], pred
    # [santa, clara]: P = 1, R = 2/3 -> 0.8. q3: 0, 0. EM = 100 * 1/3, F1 = 100 * 1.8 / 3 = 60.
    assert r["exact_match"] == pytest.approx(100 / 3)
    assert r["f1"] == pytest.approx(60.0)
    assert (r["total"], r["missing"]) == (3, 1)


def test_evaluate_v2_by_hand():
    ex = [
        {"id": "A", "answers": [{"text": "Paris"}]},
        {"id": "B", "answers": [{"text": "blue whale"}]},
        {"id": "C", "answers": []},
        {"id": "D", "answers": []},
    ]
    preds = {"A": "Paris", "B": "whale", "C": "", "D": "London"}
    na = {"A": 0.1, "B": 0.2, "D": 0.3, "C": 0.9}
    r = evaluate_v2(ex, preds, na)
    # raw exact: A 1, B 0, C 1 ('' vs ''), D 0 -> 50. raw F1: A 1, B 2/3 (P 1, R 1/2), C 1, D 0
    # -> 100 * (8/3) / 4 = 66.667. HasAns (A, B): exact 50, F1 100 * (5/3) / 2 = 83.333.
    # NoAns (C, D): exact 50, F1 50. Threshold 1.0 switches nothing to "no answer".
    assert r["exact"] == pytest.approx(50.0)
    assert r["f1"] == pytest.approx(200 / 3)
    assert r["total"] == 4
    assert (r["HasAns_exact"], r["HasAns_f1"], r["HasAns_total"]) == (pytest.approx(50.0), pytest.approx(250 / 3), 2)
    assert (r["NoAns_exact"], r["NoAns_f1"], r["NoAns_total"]) == (pytest.approx(50.0), pytest.approx(50.0), 2)
    # best thresholds (find_best_thresh): start at #NoAns = 2, walk by rising na prob A, B, D, C.
    # exact: A +1 -> 3 (best, 0.1); B +0 -> 3; D -1 (predicted 'London') -> 2; C +0 -> 2. 75 @ 0.1
    # F1: A +1 -> 3 (0.1); B +2/3 -> 3.667 (best, 0.2); D -1 -> 2.667; C +0. 100 * 3.667 / 4 @ 0.2
    assert (r["best_exact"], r["best_exact_thresh"]) == (pytest.approx(75.0), 0.1)
    assert (r["best_f1"], r["best_f1_thresh"]) == (pytest.approx(100 * (11 / 3) / 4), 0.2)
    # na_prob_thresh 0.25: D (0.3) and C (0.9) become "no answer", both right -> D scores 1.
    # exact (1 + 0 + 1 + 1) / 4 = 75; F1 (1 + 2/3 + 1 + 1) / 4 = 91.667
    r = evaluate_v2(ex, preds, na, na_prob_thresh=0.25)
    assert r["exact"] == pytest.approx(75.0)
    assert r["f1"] == pytest.approx(100 * (11 / 3) / 4)
    assert "best_exact" not in evaluate_v2(ex, preds)  # only with no-answer probabilities
    with pytest.raises(ValueError, match="1 questions have no prediction.*'D'"):
        evaluate_v2(ex, {"A": "", "B": "", "C": ""})


# --- reading -------------------------------------------------------------------------------------

def _squad(tmp_path, qas, context="Paris is the capital of France.", version="1.1", name="s.json"):
    doc = {"version": version, "data": [{"title": "T", "paragraphs": [{"context": context, "qas": qas}]}]}
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return p


def test_read_squad_versions_and_fields(tmp_path):
    qa = {"id": "1", "question": "What is the capital?", "answers": [{"text": "Paris", "answer_start": 0}]}
    version, ex = read_squad(_squad(tmp_path, [qa]))
    assert version == "1.1"
    assert (ex[0].id, ex[0].answers[0].text, ex[0].answers[0].answer_start, ex[0].is_impossible) == ("1", "Paris", 0, False)
    no = {"id": "2", "question": "What is the capital of Mars?", "answers": [], "is_impossible": True,
          "plausible_answers": [{"text": "Paris", "answer_start": 0}]}
    version, ex = read_squad(_squad(tmp_path, [qa, no], version="1.1"))  # is_impossible alone makes it v2.0
    assert version == "2.0" and ex[1].is_impossible and ex[1].answers == ()
    assert read_squad(_squad(tmp_path, [qa], version="v2.0"))[0] == "2.0"


@pytest.mark.parametrize("qa, where, what", [
    ({"id": "1", "question": "Q?", "answers": [{"text": "Paris", "answer_start": "0"}]},
     "data[0].paragraphs[0].qas[0].answers[0].answer_start", "integer"),
    ({"id": "1", "question": "Q?", "answers": [{"answer_start": 0}]},
     "data[0].paragraphs[0].qas[0].answers[0].text: missing", "answer text"),
    ({"id": "1", "answers": []}, "data[0].paragraphs[0].qas[0].question: missing", "question text"),
    ({"id": "1", "question": "Q?", "answers": [{"text": "Paris", "answer_start": 40}]},
     "data[0].paragraphs[0].qas[0].answers[0].answer_start: 40", "outside the context"),
    ({"id": "1", "question": "Q?", "answers": []}, "data[0].paragraphs[0].qas[0].answers: empty", "is_impossible"),
    ({"id": "1", "question": "Q?", "answers": [], "is_impossible": "yes"},
     "data[0].paragraphs[0].qas[0].is_impossible", "true or false"),
])
def test_read_squad_errors_name_the_json_path(tmp_path, qa, where, what):
    p = _squad(tmp_path, [qa])
    with pytest.raises(ValueError) as e:
        read_squad(p)
    msg = str(e.value)
    assert msg.startswith(str(p)) and where in msg and what in msg and "\n" not in msg


def test_read_squad_malformed_json_and_duplicates(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{"data": [\n  {"paragraphs": [}\n]}')
    with pytest.raises(ValueError, match=r"bad\.json:2:\d+: malformed JSON"):
        read_squad(p)
    qa = {"id": "x", "question": "Q?", "answers": [{"text": "Paris", "answer_start": 0}]}
    with pytest.raises(ValueError, match=r"qas\[1\]\.id: 'x' repeats the id of .*qas\[0\]"):
        read_squad(_squad(tmp_path, [qa, qa]))
    p.write_text('{"data": [{"title": "no paragraphs"}]}')
    with pytest.raises(ValueError, match=r"data\[0\]\.paragraphs: missing; expected a list of paragraphs"):
        read_squad(p)


# --- features on a tiny word-level vocabulary ----------------------------------------------------

def _tiny_tokenizer(texts):
    """A BERT-style WordPiece tokenizer whose vocabulary is every lower-cased word of `texts`."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    pre = pre_tokenizers.BertPreTokenizer()
    words = sorted({w for t in texts for w, _ in pre.pre_tokenize_str(t.lower())})
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + words)}
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    tok.enable_truncation(16)  # build_features must ignore the caller's truncation
    return tok


def _example(context, question, answer=None, qid="q", impossible=False):
    from hpcbert.data.squad import Answer, SquadExample

    answers = () if answer is None else (Answer(answer, context.index(answer)),)
    return SquadExample(qid, question, context, answers, impossible)


CONTEXT = " ".join(f"w{i}" for i in range(30))  # 30 one-token words: w0 .. w29


def test_windows_follow_the_reference_rule():
    ex = [_example(CONTEXT, "which one", "w13 w14")]
    tok = _tiny_tokenizer([CONTEXT, "which one"])
    f = build_features(ex, tok, max_seq_length=16, doc_stride=4, max_query_length=64)
    # room for context: 16 - 2 question tokens - 3 = 11; starts 4 apart until a window ends at 30:
    assert f.window_tokens == [(0, 11), (4, 15), (8, 19), (12, 23), (16, 27), (20, 30)]
    assert all(len(x) <= 16 for x in f.input_ids)
    # Answer tokens 13..14 lie whole in windows 2..4; window offset = 2 question tokens + [CLS] + [SEP] = 4
    assert f.start_positions.tolist() == [0, 13 - 4 + 4, 13 - 8 + 4, 13 - 12 + 4, 0, 0]
    assert f.end_positions.tolist() == [0, 14 - 4 + 4, 14 - 8 + 4, 14 - 12 + 4, 0, 0]
    # Best context: token 13 sits at min(13-8, 18-13) + 0.01*11 = 5.11 in window (8, 19), its best
    # (window (12, 23): min(1, 9) = 1; (4, 15): min(9, 1) = 1) -> only window 2 may start a span there.
    owners = np.zeros(30, int)
    for w, (s, e) in enumerate(f.window_tokens):
        mc = f.max_context[w][4:4 + e - s]
        owners[s:e][mc] += 1
        if s <= 13 < e:
            assert mc[13 - s] == (w == 2)
    assert (owners == 1).all()  # every context token belongs to exactly one window
    # type ids: [CLS] q q [SEP] -> 0, window + [SEP] -> 1; offsets only on context tokens
    assert f.type_ids[0].tolist() == [0] * 4 + [1] * 12
    assert (f.char_offsets[0][:4] == -1).all() and (f.char_offsets[0][-1] == -1).all()
    assert CONTEXT[slice(*f.char_offsets[0][4])] == "w0"
    assert (f.truncated, f.unmatched) == ([], [])


def test_single_window_matches_the_tokenizers_pair_encoding():
    ctx = "The Broncos beat the Panthers 24 to 10, in Santa Clara."
    q = "Who beat the Panthers?"
    tok = _tiny_tokenizer([ctx, q])
    f = build_features([_example(ctx, q, "Broncos")], tok)
    tok.no_truncation()
    ref = tok.encode(q, ctx)
    assert f.input_ids[0].tolist() == ref.ids
    assert f.type_ids[0].tolist() == ref.type_ids
    s, e = f.start_positions[0], f.end_positions[0]
    assert ref.tokens[s] == ref.tokens[e] == "broncos"


def test_question_cut_and_unrecoverable_answers_are_counted():
    long_q = " ".join(["why"] * 10)
    ex = [_example(CONTEXT, long_q, "w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13"),  # 12 tokens > 11-token windows
          _example(CONTEXT, "which", "w2", qid="sub"),
          _example(CONTEXT, "which", None, qid="none", impossible=True)]
    tok = _tiny_tokenizer([CONTEXT, long_q])
    f = build_features(ex, tok, max_seq_length=20, doc_stride=4, max_query_length=6)
    assert f.input_ids[0][:8].tolist() == [2] + [tok.token_to_id("why")] * 6 + [3]  # question cut to 6
    assert f.truncated == [0]
    # an answer that ends inside a token: "w2" annotated as "w" (start of token w2) reads back as "w2"
    from hpcbert.data.squad import Answer, SquadExample
    sub = SquadExample("sub2", "which", CONTEXT, (Answer("w", CONTEXT.index("w2")),), False)
    g = build_features([sub], tok, max_seq_length=20, doc_stride=4)
    assert g.unmatched == [0] and g.unrecoverable == [0]
    none = [w for w in range(len(f)) if f.example_index[w] == 2]
    assert all(f.start_positions[w] == 0 == f.end_positions[w] for w in none)


def _logits(f, spans: dict[int, tuple[int, int, float]], null: dict[int, float] | None = None):
    """-5 everywhere, `score` at chosen (start, end) of chosen windows, [CLS] set per window."""
    S, E = [], []
    for w in range(len(f)):
        T = len(f.input_ids[w])
        s, e = np.full(T, -5.0), np.full(T, -5.0)
        if w in spans:
            a, b, sc = spans[w]
            s[a], e[b] = sc, sc
        if null and w in null:
            s[0] = e[0] = null[w]
        S.append(s)
        E.append(e)
    return S, E


def test_predict_combines_windows_once_and_v2_null():
    ex = [_example(CONTEXT, "which one", "w13 w14", qid="a"),
          _example(CONTEXT, "which one", None, qid="b", impossible=True)]
    tok = _tiny_tokenizer([CONTEXT, "which one"])
    f = build_features(ex, tok, max_seq_length=16, doc_stride=4)
    wa = [w for w in range(len(f)) if f.example_index[w] == 0]
    wb = [w for w in range(len(f)) if f.example_index[w] == 1]
    assert len(wa) == len(wb) == 6
    # Example a: span w13..w14 scored 2 + 2 in window 2 (w13's best-context window). A decoy
    # "w13" scored 9 + 9 in window 3 must be ignored: w13 has less context there (min(1, 9) vs
    # min(5, 5)), and no token of window 3 before w13 is its own, so no other span ends there.
    spans = {wa[2]: (13 - 8 + 4, 14 - 8 + 4, 2.0), wa[3]: (13 - 12 + 4, 13 - 12 + 4, 9.0)}
    # Example b: best span "w28" (only window 5 holds it) = 1 + 1 = 2; null = the smallest
    # [CLS] start + end over its windows = 1.5 + 1.5 = 3 (others 4 + 4) -> odds 3 - 2 = 1 > 0 -> "".
    spans[wb[5]] = (28 - 20 + 4, 28 - 20 + 4, 1.0)
    null = {w: 4.0 for w in wb} | {wb[4]: 1.5} | {w: -9.0 for w in wa}
    S, E = _logits(f, spans, null)
    preds, nbest, odds = predict_answers(ex, f, S, E, n_best=3)
    assert preds == {"a": "w13 w14", "b": ""}
    assert odds["b"] == pytest.approx(1.0)
    assert odds["a"] == pytest.approx(-18.0 - 4.0)  # null -9 - 9 minus span 2 + 2
    assert nbest["b"][0]["text"] == "w28" and nbest["b"][-1]["text"] == ""
    assert sum(x["probability"] for x in nbest["a"]) == pytest.approx(1.0)
    assert len({x["text"] for x in nbest["a"]}) == len(nbest["a"]) <= 3 + 1  # n_best spans + the null
    # a threshold above the odds keeps the span; v1.1 ignores the null score altogether
    assert predict_answers(ex, f, S, E, null_threshold=1.5)[0]["b"] == "w28"
    assert predict_answers(ex, f, S, E, version="1.1")[0]["b"] == "w28"
    # max_answer_length: the 3-token span w13..w15 is taken at 3, refused at 2
    S2, E2 = _logits(f, {wa[2]: (13 - 8 + 4, 15 - 8 + 4, 2.0)})
    assert predict_answers(ex, f, S2, E2, max_answer_length=3, version="1.1")[0]["a"] == "w13 w14 w15"
    assert predict_answers(ex, f, S2, E2, max_answer_length=2, version="1.1")[0]["a"] != "w13 w14 w15"
    with pytest.raises(ValueError, match="one row per window"):
        predict_answers(ex, f, S[:-1], E)


# --- the real dev file ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dev_features():
    if not SQUAD_DEV.is_file():
        pytest.skip(f"SQuAD v1.1 dev file not found at {SQUAD_DEV} (it lives in ../shared beside the project)")
    vocab = minilm_dir_or_skip()
    from hpcbert.data.features import load_tokenizer

    t0 = time.perf_counter()
    version, ex = read_squad(SQUAD_DEV)
    tok = load_tokenizer(vocab, 384)
    f = build_features(ex, tok)
    return version, ex, tok, f, time.perf_counter() - t0


def test_dev_file_targets_read_back_and_perfect_logits_score_100(dev_features):
    version, ex, tok, f, secs = dev_features
    assert version == "1.1" and len(ex) == 10570  # README: 10,570 questions
    print(f"\nSQuAD dev: {len(ex)} questions -> {len(f)} windows in {secs:.1f} s; "
          f"{len(f.truncated)} answers cut by windowing, {len(f.unmatched)} not on token boundaries")
    assert len(f.unrecoverable) <= 0.005 * len(ex)  # measured: 0 truncated, 32 annotations inside a token
    assert all(len(x) <= 384 for x in f.input_ids)
    # Every recoverable answer's window target reads back, through the offsets, to the first gold
    # answer (an unmatched one, e.g. 'gold' annotated inside 'golden', reads back as the whole token).
    has = np.nonzero(f.start_positions)[0]
    bad = set(f.unmatched)
    for w in has:
        if f.example_index[w] in bad:
            continue
        e = ex[f.example_index[w]]
        co = f.char_offsets[w]
        text = e.context[co[f.start_positions[w], 0]:co[f.end_positions[w], 1]]
        assert normalize_answer(text) == normalize_answer(e.answers[0].text), e.id
    recoverable = set(range(len(ex))) - set(f.unrecoverable)
    assert recoverable <= set(f.example_index[has].tolist())
    # Windows cover every context token: compare with an independent count from the tokenizer.
    plain = tok.__class__.from_str(tok.to_str())
    plain.no_truncation()
    first = {}
    for w, i in enumerate(f.example_index.tolist()):
        first.setdefault(i, []).append(f.window_tokens[w])
    paras = list(dict.fromkeys(e.context for e in ex))
    n_tok = dict(zip(paras, (len(x.ids) for x in plain.encode_batch(paras, add_special_tokens=False))))
    for i, spans in first.items():
        covered = np.zeros(n_tok[ex[i].context], bool)
        for s, e in spans:
            covered[s:e] = True
        assert covered.all(), ex[i].id
    # Perfect logits: 1 at the gold start/end of windows holding the answer, -inf elsewhere.
    S, E = [], []
    for w in range(len(f)):
        T = len(f.input_ids[w])
        s, e = np.full(T, -np.inf), np.full(T, -np.inf)
        if f.start_positions[w]:
            s[f.start_positions[w]] = e[f.end_positions[w]] = 1.0
        S.append(s)
        E.append(e)
    preds, _, _ = predict_answers(ex, f, S, E)
    r = evaluate_v1(ex, preds)
    floor = 100.0 * len(recoverable) / len(ex)
    assert r["missing"] == 0
    assert r["exact_match"] >= floor and r["f1"] >= floor
    assert r["exact_match"] > 99.5
