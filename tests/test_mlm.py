"""Masked-LM pre-training (--task mlm): masking statistics, packing, the masked-only head against full
logits and against transformers, 1 vs 2 ranks, resume, --init-from, --eval-every, the target stop,
the LR decay, bad input.

Expected values come from outside the code under test: counts over the token arrays read with
numpy from the prepared files, transformers' BertForMaskedLM / BertForPreTraining, full-vocabulary
logits with ignore_index, hand formulas.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import minilm_dir_or_skip, run_env
from hpcbert import objectives
from hpcbert.cli import main as hpcbert_main
from hpcbert.config import RunConfig
from hpcbert.data import masking
from hpcbert.data.features import Batch, load_tokenizer, shard
from hpcbert.model import BertConfig, BertForMaskedLM, BertForPreTraining, hf_state_dict, load_pretrained
from hpcbert.runfiles import read_metrics, read_summary
from hpcbert.train import LRSchedule

TINY = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                  max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
WORDS = ("the history of unbelievable electromagnetism and photosynthesis was rewritten by anthropologists "
         "who studied a small village near the river where fishermen caught extraordinary salmon").split()


@pytest.fixture(scope="module")
def tok_dir() -> Path:
    return minilm_dir_or_skip()


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir, 512)


def corpus_text(n_docs: int, seed: int = 0) -> str:
    """Documents of 1-6 lines of 2-40 words; every 7th document has a line of ~90 words (longer than
    a 32-token sequence: it must be cut)."""
    rng = np.random.default_rng(seed)
    docs = []
    for d in range(n_docs):
        lines = [" ".join(rng.choice(WORDS, rng.integers(2, 41))) + "." for _ in range(rng.integers(1, 7))]
        if d % 7 == 3:
            lines.insert(1, " ".join(rng.choice(WORDS, 90)) + ".")
        docs.append("\n".join(lines))
    return "\n\n".join(docs) + "\n"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, tok_dir) -> Path:
    d = tmp_path_factory.mktemp("mlm")
    (d / "corpus.txt").write_text(corpus_text(60))
    assert hpcbert_main(["prepare-pretraining", str(d / "corpus.txt"), "--tokenizer", str(tok_dir),
                         "--max-seq-length", "32", "--out", str(d / "data"), "--eval-docs", "6",
                         "--shard-tokens", "1500"]) == 0
    return d / "data"


def stream_from_files(data: Path, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, document starts, line starts) of a split, read with numpy alone, shards in order."""
    meta = json.loads((data / "metadata.json").read_text())
    toks, docs, lines, base = [], [], [], 0
    for sh in meta["splits"][split]["shards"]:
        t = np.load(data / sh["tokens"]["file"])
        docs.append(np.load(data / sh["offsets"]["file"])[:-1] + base)
        lines.append(np.load(data / sh["lines"]["file"])[:-1] + base)
        toks.append(t)
        base += len(t)
    return np.concatenate(toks).astype(np.int64), np.concatenate(docs), np.concatenate(lines)


def objective(data_dir, tok_dir, **kw) -> tuple[objectives.Objective, object, dict]:
    from hpcbert import zoo

    cfg = RunConfig(task="mlm", data_dir=str(data_dir), model="bert-tiny", tokenizer=str(tok_dir),
                    max_seq_length=kw.pop("max_seq_length", 32), **kw)
    obj = objectives.get(cfg)
    obj.check(cfg)
    train, dev = obj.load(cfg, zoo.resolve(cfg.model, cfg.tokenizer))
    return obj, train, dev


def originals(batch) -> np.ndarray:
    """The batch's ids before masking: the labels put back at the selected positions."""
    ids = batch.input_ids.numpy().copy().reshape(-1)
    ids[batch.labels["mlm_positions"].numpy()] = batch.labels["mlm_labels"].numpy()
    return ids.reshape(batch.input_ids.shape)


# --- masking ----------------------------------------------------------------------------------------

def test_masking_statistics_over_a_million_tokens(tok):
    spec = masking.MaskSpec.from_tokenizer(tok, 0.15, whole_word=False)
    specials = np.flatnonzero(spec.special)
    rng = np.random.default_rng(0)
    B, T = 12000, 128
    ids = rng.integers(1000, 30000, (B, T))
    lengths = rng.integers(64, T + 1, B)
    content = np.zeros((B, T), bool)
    for b, n in enumerate(lengths):
        content[b, 1:n - 1] = True
        ids[b, 0], ids[b, n - 1], ids[b, n:] = 101, 102, 0  # [CLS] ... [SEP] [PAD]...
    written = rng.random((B, T)) < 0.01  # special tokens written in the text: never selected
    ids[written & content] = rng.choice(specials, int((written & content).sum()))
    cand = content & ~np.isin(ids, specials)  # independent of MaskSpec: the ids themselves
    assert cand.sum() > 1_000_000
    out, positions, labels = masking.mask(spec, ids, content, masking.sequence_keys(7, 0, np.arange(B)))
    chosen = np.zeros(B * T, bool)
    chosen[positions] = True
    assert not (chosen & ~cand.reshape(-1)).any()  # no special token, no padding, no [CLS]/[SEP]
    assert abs(len(positions) / cand.sum() - 0.15) < 0.002
    assert (labels == ids.reshape(-1)[positions]).all()
    new = out.reshape(-1)[positions]
    to_mask = (new == 103).mean()
    to_random = ((new != 103) & (new != labels)).mean()
    kept = (new == labels).mean()
    assert abs(to_mask - 0.8) < 0.01 and abs(to_random - 0.1) < 0.01 and abs(kept - 0.1) < 0.01
    assert not np.isin(new[(new != 103) & (new != labels)], specials).any()  # random ids are ordinary ones
    untouched = np.ones(B * T, bool)
    untouched[positions] = False
    assert (out.reshape(-1)[untouched] == ids.reshape(-1)[untouched]).all()
    # per sequence: floor or ceil of 15% of its candidates
    per = np.bincount(positions // T, minlength=B)
    want = 0.15 * cand.sum(1)
    assert ((per == np.floor(want)) | (per == np.ceil(want))).all()


def test_whole_word_masking_takes_every_piece_of_a_word_or_none(tok):
    spec = masking.MaskSpec.from_tokenizer(tok, 0.15, whole_word=True)
    rng = np.random.default_rng(1)
    rows = [tok.encode(" ".join(rng.choice(WORDS, 40)), add_special_tokens=False).ids[:126] for _ in range(400)]
    B, T = len(rows), 128
    ids = np.zeros((B, T), np.int64)
    content = np.zeros((B, T), bool)
    for b, r in enumerate(rows):
        ids[b, 0], ids[b, 1:len(r) + 1], ids[b, len(r) + 1] = 101, r, 102
        content[b, 1:len(r) + 1] = True
    vocab = {i: t for t, i in tok.get_vocab().items()}
    _, positions, _ = masking.mask(spec, ids, content, masking.sequence_keys(3, 2, np.arange(B)))
    chosen = np.zeros(B * T, bool)
    chosen[positions] = True
    chosen = chosen.reshape(B, T)
    words = whole = 0
    for b, r in enumerate(rows):
        # words by the '##' prefix of the token strings (not the code's table)
        starts = [t for t in range(1, len(r) + 1) if not vocab[ids[b, t]].startswith("##")]
        for s, e in zip(starts, starts[1:] + [len(r) + 1]):
            picked = chosen[b, s:e]
            assert picked.all() or not picked.any(), (b, s, e, [vocab[i] for i in ids[b, s:e]])
            words += e - s > 1
            whole += e - s > 1 and picked.all()
    assert words > 1000 and whole > 100  # multi-piece words are selected, whole
    assert abs(chosen.sum() / content.sum() - 0.15) < 0.01


def test_masks_are_fresh_per_epoch_fixed_for_evaluation_and_independent_of_the_batch(data_dir, tok_dir):
    obj, train, dev = objective(data_dir, tok_dir)
    idx = np.arange(12)
    a, b = obj.collate(train, idx, None, 0), obj.collate(train, idx, None, 1)
    assert not torch.equal(a.input_ids, b.input_ids)  # a fresh mask every epoch
    assert (originals(a) == originals(b)).all()
    # sequence 5 alone, padded to another length: its mask is the same
    one = obj.collate(train, [5], 32, 0)
    L = int(train.lengths[5])
    assert torch.equal(one.input_ids[0, :L], a.input_ids[5, :L])
    # evaluation: the same mask whatever the run's seed
    obj2, _, dev2 = objective(data_dir, tok_dir, seed=999)
    e1, e2 = obj.collate(dev["eval"], [0, 1, 2]), obj2.collate(dev2["eval"], [0, 1, 2])
    assert torch.equal(e1.input_ids, e2.input_ids)
    assert torch.equal(e1.labels["mlm_positions"], e2.labels["mlm_positions"])
    # norm counts what collate selects, for the global batch
    n = obj.norm(train, idx, 0)
    assert n == {"masked": float(len(a.labels["mlm_positions"])), "examples": 12.0}


def test_eval_data_scores_every_document_of_another_corpus(data_dir, tok_dir):
    _, _, dev = objective(data_dir, tok_dir, eval_data=str(data_dir))
    _, _, own = objective(data_dir, tok_dir)
    every = sum(len(stream_from_files(data_dir, s)[0]) for s in ("train", "eval"))
    ev = dev["eval"]
    assert int((ev.ranges[1] - ev.ranges[0]).sum()) == every  # train and held-out documents, each token once
    assert int((own["eval"].ranges[1] - own["eval"].ranges[0]).sum()) == len(stream_from_files(data_dir, "eval")[0])


# --- packing --------------------------------------------------------------------------------------

@pytest.mark.parametrize("world, per_rank, accum", [(1, [8], 1), (2, [4, 4], 1), (2, [3, 1], 2)])
def test_packing_covers_every_token_once_per_epoch(data_dir, tok_dir, world, per_rank, accum):
    tokens, doc_starts, line_starts = stream_from_files(data_dir, "train")
    obj, train, _ = objective(data_dir, tok_dir)
    from hpcbert.data.features import epoch_order, global_batches

    gbs = global_batches(epoch_order(train.lengths, "length-grouped", 42, 0, sum(per_rank) * accum),
                         sum(per_rank) * accum)
    seqs: dict[int, np.ndarray] = {}
    for gb in gbs:
        for rank in range(world):
            for micro in shard(gb, per_rank, rank, accum):
                if not len(micro):
                    continue
                batch = obj.collate(train, micro, None, 0)
                assert batch.input_ids.shape[1] <= 32
                for i, row, n in zip(micro, originals(batch), batch.attention_mask.sum(1).tolist()
                                     if batch.attention_mask is not None else [batch.input_ids.shape[1]] * len(micro)):
                    assert int(i) not in seqs and row[0] == 101 and row[n - 1] == 102
                    seqs[int(i)] = row[1:n - 1]
    assert sorted(seqs) == list(range(len(train)))
    # in sequence order, without the [SEP]s between documents: the stream, every token once
    body = [s[s != 102] for _, s in sorted(seqs.items())]
    assert np.array_equal(np.concatenate(body), tokens)
    # a [SEP] exactly where a document begins inside a sequence; sequences start at a line start
    # unless a line longer than a sequence was cut
    pos = 0
    long_lines = {int(s) for s, e in zip(line_starts, list(line_starts[1:]) + [len(tokens)]) if e - s > 30}
    for _, s in sorted(seqs.items()):
        n = int((s != 102).sum())
        inside = doc_starts[(doc_starts > pos) & (doc_starts < pos + n)]
        assert np.array_equal(np.flatnonzero(s == 102) - np.arange((s == 102).sum()), inside - pos)
        line = line_starts[line_starts <= pos].max()
        assert pos in set(line_starts.tolist()) or line in long_lines
        pos += n


@pytest.mark.parametrize("nsp", [False, True])
def test_assembled_rows_by_hand_from_the_files(data_dir, tok_dir, nsp):
    """Every training sequence at once (many shards), each row against one built in this test from
    the files: [CLS] tokens [SEP], a [SEP] before each document start inside a packed row; with
    next-sentence pairs [CLS] A [SEP] B [SEP], B's part type 1; PAD after; content = corpus tokens."""
    tokens, doc_starts, _ = stream_from_files(data_dir, "train")
    _, train, _ = objective(data_dir, tok_dir, nsp=nsp)
    idx = np.random.default_rng(0).permutation(len(train))
    ids, types, content, lengths, _ = train.assemble(idx, 40)
    assert ids.shape == (len(train), 40)
    for r, i in enumerate(idx):
        if nsp:
            a0, a1, b0, b1 = (int(x[i]) for x in train.ranges[:4])
            row = [101, *tokens[a0:a1], 102, *tokens[b0:b1], 102]
            typ = [0] * (a1 - a0 + 2) + [1] * (b1 - b0 + 1)
            text = [False, *[True] * (a1 - a0), False, *[True] * (b1 - b0), False]
        else:
            g0, g1 = int(train.ranges[0][i]), int(train.ranges[1][i])
            row, text = [101], [False]
            for g in range(g0, g1):
                if g != g0 and g in set(doc_starts.tolist()):
                    row.append(102)
                    text.append(False)
                row.append(int(tokens[g]))
                text.append(True)
            row, text = row + [102], text + [False]
            typ = [0] * len(row)
        n = len(row)
        assert lengths[r] == n and ids[r, :n].tolist() == row and (ids[r, n:] == 0).all()
        assert types[r, :n].tolist() == typ and not types[r, n:].any()
        assert content[r, :n].tolist() == text and not content[r, n:].any()


def test_nsp_pairs(data_dir, tok_dir):
    obj, train, dev = objective(data_dir, tok_dir, nsp=True)
    tokens, doc_starts, line_starts = stream_from_files(data_dir, "train")
    doc_of = lambda g: np.searchsorted(doc_starts, g, "right") - 1  # noqa: E731
    a0, a1, b0, b1, rnd = train.ranges
    assert abs(rnd.mean() - 0.5) < 0.15 and (train.lengths <= 32).all()
    assert (doc_of(a0) == doc_of(a1 - 1)).all() and (doc_of(b0) == doc_of(b1 - 1)).all()  # within a document
    nxt = rnd == 0
    assert (b0[nxt] == a1[nxt]).all() and (doc_of(b0[rnd == 1]) != doc_of(a0[rnd == 1])).all()
    batch = obj.collate(train, np.arange(6), None, 0)
    row, types = originals(batch)[0], batch.token_type_ids[0].numpy()
    na, nb = a1[0] - a0[0], b1[0] - b0[0]
    assert np.array_equal(row[1:na + 1], tokens[a0[0]:a1[0]])
    assert np.array_equal(row[na + 2:na + nb + 2], tokens[b0[0]:b1[0]])
    assert types[:na + 2].sum() == 0 and types[na + 2:na + nb + 3].all()
    assert torch.equal(batch.labels["nsp"], torch.from_numpy(rnd[:6]))
    # the head: HF BertForPreTraining names, NSP logits and both losses
    model = obj.build_model(TINY.__class__(**{**TINY.to_dict(), "vocab_size": 30522}))
    assert isinstance(model, BertForPreTraining) and obj.hf_config()["architectures"] == ["BertForPreTraining"]
    out = obj.forward(model, batch)
    norm = obj.norm(train, np.arange(6), 0)
    loss = obj.loss(model, out, batch, norm)
    ref = (F.cross_entropy(out[0], batch.labels["mlm_labels"], reduction="sum") / norm["masked"]
           + F.cross_entropy(out[1], batch.labels["nsp"]))
    assert torch.allclose(loss, ref)
    ev = obj.evaluate("eval", objectives.to_host(obj.predict(out, batch)), train)
    assert {"mlm_accuracy", "mlm_loss", "nsp_accuracy", "nsp_loss", "loss"} <= set(ev.metrics)


# --- the head -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 37])  # fewer masked rows than the loss's chunks, uneven
def test_the_loss_is_torchs_cross_entropy_keeping_only_the_logits(dtype, rows):
    """CrossEntropySum against F.cross_entropy(logits.float(), reduction="sum"), the loss it
    replaced: the same loss and gradient (within fp32 rounding; at bf16 within one bf16 step of each
    entry), under bf16 autocast as a run computes it; for backward it keeps the logits and the
    labels, nothing else (torch keeps fp32 log-probabilities: 4 bytes an entry)."""
    from hpcbert.objectives.mlm import CrossEntropySum

    torch.manual_seed(rows)
    V = 30522
    logits = (3 * torch.randn(rows, V)).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (rows,))
    kept = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            ours = CrossEntropySum.apply(logits, labels) / 7
        ref = F.cross_entropy(logits.float(), labels, reduction="sum") / 7
    g_ours, = torch.autograd.grad(ours, logits)
    g_ref, = torch.autograd.grad(ref, logits)
    assert ours.dtype == torch.float32 and ours.item() == pytest.approx(ref.item(), rel=1e-6)
    assert g_ours.dtype == dtype
    if dtype == torch.bfloat16:
        step = g_ref.float().abs() * 2.0**-7 + 1e-30  # one bf16 step: 8 bits of mantissa
        assert ((g_ours.float() - g_ref.float()).abs() <= step).all()
    else:
        assert torch.allclose(g_ours.double(), g_ref.double(), rtol=1e-5, atol=1e-9)
    assert sum(kept.values()) == rows * V * logits.element_size() + rows * 8


@pytest.mark.parametrize("rows", [5, 37, 1216])  # fewer masked rows than predict's chunks, uneven, many
def test_predictions_are_cross_entropy_and_argmax_of_every_masked_row(rows):
    """predict's per-sequence sums against F.cross_entropy and argmax over the whole fp32 logits at
    once, summed per sequence by numpy: the rows taken in chunks lose or repeat none."""
    torch.manual_seed(rows)
    B, T, V = 6, 256, 30522
    positions = torch.randperm(B * T)[:rows].sort().values
    labels = torch.randint(0, V, (rows,))
    logits = (3 * torch.randn(rows, V)).bfloat16()
    right = torch.arange(0, rows, 3)
    logits[right, labels[right]] += 20  # some rows predicted right
    batch = Batch(torch.zeros(B, T, dtype=torch.long), None, None,
                  {"mlm_positions": positions, "mlm_labels": labels}, rows)
    obj = objectives.get(RunConfig(task="mlm", data_dir="unread"))
    got = objectives.to_host(obj.predict(logits, batch))
    seq = positions.numpy() // T
    ref_loss = F.cross_entropy(logits.float(), labels, reduction="none").numpy()
    ref_right = (logits.float().numpy().argmax(-1) == labels.numpy()).astype(float)
    assert np.array_equal(got["masked"], np.bincount(seq, minlength=B))
    assert np.array_equal(got["correct"], np.bincount(seq, ref_right, minlength=B)) and ref_right.sum() > 0
    np.testing.assert_allclose(got["loss"], np.bincount(seq, ref_loss.astype(np.float64), minlength=B), rtol=1e-6)


def test_masked_only_logits_give_the_loss_and_gradients_of_full_logits():
    torch.manual_seed(0)
    model = BertForMaskedLM(TINY).double()
    ids = torch.randint(5, TINY.vocab_size, (4, 20))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[2, 13:] = False
    positions = torch.tensor([3, 7, 21, 30, 39, 45, 62, 71, 79])  # flat b*T + t, none in the padding
    labels = torch.randint(5, TINY.vocab_size, (len(positions),))

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    masked_loss, g1 = grads(F.cross_entropy(model(ids, mask, None, positions), labels, reduction="sum") / 9)
    full_labels = torch.full((4 * 20,), -100)
    full_labels[positions] = labels
    full = model(ids, mask, None).reshape(-1, TINY.vocab_size)  # (B*T, V): every position
    full_loss, g2 = grads(F.cross_entropy(full, full_labels, ignore_index=-100))
    assert abs(masked_loss - full_loss) <= 1e-6 * abs(full_loss)
    for a, b in zip(g1, g2):
        assert (a - b).norm() <= 1e-6 * b.norm() + 1e-12


@pytest.mark.parametrize("ours, theirs", [(BertForMaskedLM, "BertForMaskedLM"),
                                          (BertForPreTraining, "BertForPreTraining")])
def test_weights_round_trip_through_transformers(tmp_path, ours, theirs):
    transformers = pytest.importorskip("transformers")
    from hpcbert.export import write_hf_dir

    torch.manual_seed(0)
    model = ours(TINY).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # biases and LayerNorms too: a wrong name shows
    write_hf_dir(tmp_path / "hf", model, {"architectures": [theirs]}, None)
    hf = getattr(transformers, theirs).from_pretrained(str(tmp_path / "hf")).eval()
    ids = torch.randint(5, TINY.vocab_size, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        out, ho = model(ids, mask), hf(input_ids=ids, attention_mask=mask)
    logits = out if theirs == "BertForMaskedLM" else out[0]
    ref = ho.logits if theirs == "BertForMaskedLM" else ho.prediction_logits
    assert (logits - ref)[mask.bool()].abs().max() <= 1e-4
    if theirs == "BertForPreTraining":
        assert (out[1] - ho.seq_relationship_logits).abs().max() <= 1e-4
    hf.save_pretrained(str(tmp_path / "back"))  # and back: transformers' file loads by name, nothing missing
    again = ours(TINY).eval()
    rep = load_pretrained(again, tmp_path / "back")
    assert rep.missing == rep.unexpected == rep.mismatched == []
    assert again.cls.predictions.decoder.weight is again.bert.embeddings.word_embeddings.weight  # still tied
    for (k, a), b in zip(hf_state_dict(again).items(), hf_state_dict(model).values()):
        assert torch.equal(a, b), k


# --- the LR decay ---------------------------------------------------------------------------------

def test_poly_decay_follows_the_hand_formula():
    s = LRSchedule(10, 100, power=0.5)
    for step in (0, 4, 9):
        assert s(step) == pytest.approx((step + 1) / 10)
    for step in (10, 37, 99, 100, 130):
        assert s(step) == pytest.approx(max(0.0, 1 - (step - 10) / 90) ** 0.5)
    assert LRSchedule(10, 100)(55) == pytest.approx(1 - 45 / 90)  # linear: power 1


# --- end to end -------------------------------------------------------------------------------------

def train(tmp: Path, out: str, data_dir, tok_dir, *extra, check=True):
    argv = ["train", "--task", "mlm", "--data-dir", str(data_dir), "--tokenizer", str(tok_dir), "--model", "bert-tiny",
            "--max-seq-length", "32", "--batch-size", "8", "--lr", "2e-3", "--dropout", "0",
            *(["--precision", "fp32"] if "--precision" not in extra else []),
            "--log-every", "1", "--threads", "1", "--out", str(tmp / out), *map(str, extra)]
    rc = hpcbert_main(argv)
    if check:
        assert rc == 0
    return rc


@pytest.mark.slow
def test_eval_every_target_and_summary(tmp_path, data_dir, tok_dir):
    obj, tr, _ = objective(data_dir, tok_dir)
    spe = math.ceil(len(tr) / 8)
    train(tmp_path, "run", data_dir, tok_dir, "--max-steps", 3 * spe, "--eval-every", spe,
          "--lr-decay", "poly", "--poly-power", 0.5, "--warmup-ratio", 0.2)
    metrics = read_metrics(tmp_path / "run")
    evals = [m for m in metrics if "eval" in m]
    assert [m["step"] for m in evals] == [spe, 2 * spe, 3 * spe] and all(m["loss"] is None for m in evals)
    # after one epoch every sequence was seen once: tokens seen = all tokens of the packed sequences
    assert evals[0]["tokens_seen"] == int(tr.lengths.sum()) and evals[1]["tokens_seen"] == 2 * int(tr.lengths.sum())
    acc = [m["eval"]["eval"]["mlm_accuracy"] for m in evals]
    summary = read_summary(tmp_path / "run")
    assert summary["eval"]["eval"]["mlm_accuracy"] == acc[-1] and summary["stopped_by"] == "max_steps"
    assert summary["time_to_target_s"] is None and summary["schema_version"] == 8
    assert hpcbert_main(["report", str(tmp_path / "run"), "--format", "html", "--out", str(tmp_path / "r.html")]) == 0
    assert 'alt="Evaluation during training" src="data:image/png' in (tmp_path / "r.html").read_text()
    # the LR of every step: peak x the hand formula (a line logs the LR of the next step, number s)
    total, warm = 3 * spe, round(0.2 * 3 * spe)
    for m in metrics:
        if "lr" in m:
            s = m["step"]
            want = (s + 1) / warm if s < warm else max(0.0, 1 - (s - warm) / (total - warm)) ** 0.5
            assert m["lr"] == pytest.approx(2e-3 * want)
    # by wall time: rank 0's clock, agreed through the per-step all-reduce (here: after every step)
    train(tmp_path, "timed", data_dir, tok_dir, "--max-steps", 3, "--eval-every", "0.001s")
    assert [m["step"] for m in read_metrics(tmp_path / "timed") if "eval" in m] == [1, 2, 3]
    # a target the first evaluation reaches: stop there, with the time, steps and tokens to it
    target = acc[0] * 0.999
    train(tmp_path, "target", data_dir, tok_dir, "--max-steps", 3 * spe, "--eval-every", spe,
          "--lr-decay", "poly", "--poly-power", 0.5, "--warmup-ratio", 0.2, "--target-mlm-accuracy", target)
    s = read_summary(tmp_path / "target")
    assert s["stopped_by"] == "target" and s["steps_to_target"] == spe == s["steps"]
    assert s["tokens_to_target"] == int(tr.lengths.sum()) and 0 < s["time_to_target_s"] < 600
    assert s["eval"]["eval"]["mlm_accuracy"] == pytest.approx(acc[0])


@pytest.mark.slow
def test_resumed_run_gives_the_losses_and_evaluations_of_the_straight_run(tmp_path, data_dir, tok_dir):
    common = ["--max-steps", 8, "--eval-every", 3, "--checkpoint-steps", 4, "--keep-last", 3, "--sampler", "random"]
    train(tmp_path, "straight", data_dir, tok_dir, *common)
    run = tmp_path / "resumed"
    shutil.copytree(tmp_path / "straight", run)
    shutil.rmtree(run / "checkpoints" / "step-00000008")  # as if killed right after step 4's checkpoint
    (run / "summary.json").unlink()
    train(tmp_path, "resumed", data_dir, tok_dir, *common, "--resume", "auto")
    lines = lambda r: [{k: v for k, v in m.items() if not k.endswith(("_s", "_per_sec"))}  # noqa: E731
                       for m in read_metrics(r)]
    assert lines(run) == lines(tmp_path / "straight")  # losses, LRs, evaluations, tokens seen: equal
    assert read_summary(run)["resumed_from_step"] == 4


@pytest.mark.slow
def test_two_ranks_give_the_losses_of_one(tmp_path, data_dir, tok_dir):
    def launch(nproc, out, *extra):
        cmd = [sys.executable, "-m", "hpcbert.cli"] if nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "hpcbert.cli"]
        args = ["train", "--task", "mlm", "--data-dir", data_dir, "--tokenizer", tok_dir, "--model", "bert-tiny",
                "--max-seq-length", 32, "--lr", "2e-3", "--dropout", 0, "--precision", "fp32", "--log-every", 1,
                "--threads", 1, "--max-steps", 4, "--whole-word-masking", "--out", tmp_path / out, *extra]
        r = subprocess.run(cmd + [str(a) for a in args], env=run_env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return read_metrics(tmp_path / out), read_summary(tmp_path / out)

    one, s1 = launch(1, "one", "--batch-size", 8)
    two, s2 = launch(2, "two", "--batch-size", 2, "--grad-accum", 2)
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (one, two)
    assert s1["eval"]["eval"]["mlm_accuracy"] == s2["eval"]["eval"]["mlm_accuracy"]
    assert s1["eval"]["eval"]["masked_tokens"] == s2["eval"]["eval"]["masked_tokens"]


@pytest.mark.slow
def test_phase_2_init_from_takes_the_weights_and_nothing_else(tmp_path, data_dir, tok_dir, capsys):
    from hpcbert import dist
    from hpcbert.model import load_state_dict_file
    from hpcbert.train import Trainer

    train(tmp_path, "phase1", data_dir, tok_dir, "--max-steps", 3, "--checkpoint-steps", 2)
    final = load_state_dict_file(tmp_path / "phase1" / "model")

    def phase2(source, out, **kw):
        cfg = RunConfig(task="mlm", data_dir=str(data_dir), tokenizer=str(tok_dir), model="bert-tiny",
                        max_seq_length=64, batch_size=4, lr=1e-4, optimizer="lamb", init_from=str(source),
                        out=str(tmp_path / out), threads=1, **kw)
        d = dist.init(1, 60)
        return Trainer(cfg, d, objectives.get(cfg))

    t = phase2(tmp_path / "phase1", "phase2")
    mine = hf_state_dict(t.raw)
    assert mine.keys() == final.keys() and all(torch.equal(mine[k], final[k]) for k in final)
    assert t.state.step == 0 and t.state.sequences == 0 and not t.optimizer.state  # fresh optimizer and loop
    assert t.scheduler.last_epoch == 0 and t.cfg.max_seq_length == 64
    assert "init_from: model weights of" in capsys.readouterr().err
    # from a checkpoint directory: that step's weights
    ck = tmp_path / "phase1" / "checkpoints" / "step-00000002"
    t = phase2(ck, "phase2b")
    ck_model = torch.load(ck / "shared.pt", weights_only=False)["model"]
    assert all(torch.equal(v, ck_model[k]) for k, v in t.raw.state_dict().items())
    # fine-tuning from the pre-trained run: the encoder loads, the head is reported by name
    cfg = RunConfig(task="synthetic", model="bert-tiny", tokenizer=str(tok_dir), init_from=str(tmp_path / "phase1"),
                    out=str(tmp_path / "ft"), threads=1, synthetic_train_size=8)
    t = Trainer(cfg, dist.init(1, 60), objectives.get(cfg))
    err = capsys.readouterr().err
    assert "ignored, not in this model: cls.predictions" in err and "classifier.weight" in err
    assert torch.equal(t.raw.bert.embeddings.word_embeddings.weight, final["bert.embeddings.word_embeddings.weight"])


@pytest.mark.slow
def test_export_of_an_mlm_run_gives_transformers_the_same_logits(tmp_path, data_dir, tok_dir, capsys):
    transformers = pytest.importorskip("transformers")
    train(tmp_path, "run", data_dir, tok_dir, "--max-steps", 2)
    assert hpcbert_main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.BertForMaskedLM.from_pretrained(str(tmp_path / "hf")).eval()
    ours = BertForMaskedLM(BertConfig.from_json(tmp_path / "hf" / "config.json"))
    load_pretrained(ours, tmp_path / "run" / "model")
    ids = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))(
        ["the river where fishermen caught salmon", "a small village"], padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = hf(**ids).logits
        got = ours.eval()(ids["input_ids"], ids["attention_mask"], ids["token_type_ids"])
    m = ids["attention_mask"].bool()
    assert (got - ref)[m].abs().max() <= 1e-4
    # and hpcbert fine-tunes the export: the encoder loads, the MLM head is reported as not used
    assert hpcbert_main(["train", "--model", str(tmp_path / "hf"), "--task", "synthetic", "--max-steps", "1",
                         "--synthetic-train-size", "8", "--synthetic-dev-size", "8", "--threads", "1",
                         "--out", str(tmp_path / "ft")]) == 0
    assert "ignored checkpoint tensors not in the model: cls.predictions" in capsys.readouterr().err


def test_bad_input_is_one_line_exit_2(tmp_path, data_dir, tok_dir, capsys):
    def err(*args) -> str:
        assert hpcbert_main(["train", "--model", "bert-tiny", "--out", str(tmp_path / "never"), *map(str, args)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert not (tmp_path / "never").exists()
        return lines[-1]

    assert "data_dir: --task mlm trains on prepared data" in err("--task", "mlm")
    assert f"data_dir: {tmp_path / 'none'} does not exist" in err("--task", "mlm", "--data-dir", tmp_path / "none")
    assert "train_file: an option of squad and classify" in err("--task", "mlm", "--data-dir", data_dir,
                                                                "--train-file", "x.json")
    assert "target_mlm_accuracy: task 'synthetic' has no masked-LM accuracy" in err("--target-mlm-accuracy", 0.5)
    other = tmp_path / "tok"
    other.mkdir()
    (other / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    assert "prepared with another tokenizer" in err("--task", "mlm", "--data-dir", data_dir, "--tokenizer", other)
    assert "eval_every: evaluates during training" in err("--task", "mlm", "--data-dir", data_dir, "--tokenizer",
                                                          tok_dir, "--eval-every", 5, "--no-do-eval")
    assert "init_from: " in err("--task", "mlm", "--data-dir", data_dir, "--tokenizer", tok_dir, "--init-from",
                                tmp_path / "nowhere")
    assert "eval_every: cannot read" in err("--task", "mlm", "--eval-every", "5 minutes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_bf16_and_the_largest_batch_that_fits(tmp_path, data_dir, tok_dir):
    """bf16 on the device trains like fp32 (first losses within 2%), and --per-rank-batch auto probes
    the masked-LM model (its example batch: masked positions, the head at those positions)."""
    train(tmp_path, "bf16", data_dir, tok_dir, "--max-steps", 4, "--precision", "bf16")
    train(tmp_path, "fp32", data_dir, tok_dir, "--max-steps", 4, "--precision", "fp32")
    a, b = read_metrics(tmp_path / "bf16"), read_metrics(tmp_path / "fp32")
    assert read_summary(tmp_path / "bf16")["precision"] == "bf16"
    assert abs(a[0]["loss"] - b[0]["loss"]) <= 0.02 * b[0]["loss"]
    train(tmp_path, "auto", data_dir, tok_dir, "--max-steps", 2, "--per-rank-batch", "auto", "--precision", "bf16")
    assert read_summary(tmp_path / "auto")["per_device_batch_size"] > 8
