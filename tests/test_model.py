"""The model matches Hugging Face's BertModel on the same weights, and loads HF checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import minilm_dir_or_skip
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


def test_matches_hf_on_minilm_weights():
    transformers = _transformers()
    d = minilm_dir_or_skip()
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


@pytest.mark.parametrize("task, nsp", [("synthetic", False), ("squad", False), ("mlm", False), ("mlm", True)])
def test_the_flops_a_step_counts_are_the_matmul_flops_it_runs(task, nsp):
    """What a training step counts as model FLOPs (train.Trainer.step: the encoder's,
    model.batch_flops at the rows the head reads, plus the objective's head_flops) against what
    torch's FlopCounterMode counts in a real forward and backward of the objective's model on its
    example batch: every matrix product, the heads' included. Equal to the FLOP (both count 2 per
    multiply-add of the same products); without the head's the count falls short (by 0.13% for a
    classifier's pooler and output layer here, 31% for a masked-LM head, whose vocabulary is wide
    against the hidden size: 62 times here, 40 in bert-base)."""
    from torch.utils.flop_counter import FlopCounterMode

    from hpcbert import objectives
    from hpcbert.config import RunConfig
    from hpcbert.model import batch_flops

    cfg = BertConfig(vocab_size=2000, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64)
    obj = objectives.get(RunConfig(task=task, nsp=nsp))
    torch.manual_seed(0)
    model = obj.build_model(cfg).train()
    batch, norm = obj.example_batch(4, 40, cfg.vocab_size)
    with FlopCounterMode(display=False) as counter:
        obj.loss(model, obj.forward(model, batch), batch, norm).backward()
    counted = counter.get_total_flops()
    B, T = batch.input_ids.shape
    encoder = batch_flops(cfg, [T] * B, obj.head_rows(batch))
    head = obj.head_flops(batch, cfg)
    assert head > 0
    assert encoder + head == pytest.approx(counted, rel=1e-9)
    assert encoder < counted * (1 - 1e-3)


# --- LayerNorm precision under autocast (--norm-precision) ------------------------------------------

def test_low_precision_layer_norm_against_a_float64_reference():
    """Under bf16 autocast a low-precision LayerNorm returns bf16: the float64 LayerNorm of its
    input rounded to bf16, within bf16's rounding of the result; its gradients within 1% of
    float64's. With low_precision off it follows autocast's rule: fp32 out, as nn.LayerNorm. Without
    autocast the two are the same computation, bit for bit."""
    from hpcbert.model import LayerNorm

    g = torch.Generator().manual_seed(0)
    ln = LayerNorm(64, eps=1e-12)
    with torch.no_grad():
        ln.weight.copy_(torch.randn(64, generator=g) * 0.5 + 1)
        ln.bias.copy_(torch.randn(64, generator=g) * 0.3)
    x = (torch.randn(8, 64, generator=g) * 3 + torch.randn(8, 1, generator=g) * 5).requires_grad_()
    dy = torch.randn(8, 64, generator=g)

    xd = x.detach().bfloat16().double().requires_grad_()
    wd, bd = (t.detach().double().requires_grad_() for t in (ln.weight, ln.bias))
    ref = torch.nn.functional.layer_norm(xd, (64,), wd, bd, 1e-12)
    ref.backward(dy.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ln(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), ref.detach(), rtol=2 ** -8, atol=1e-6)
    y.float().backward(dy)
    for got, want in ((x.grad, xd.grad), (ln.weight.grad, wd.grad), (ln.bias.grad, bd.grad)):
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-2

    ln.low_precision = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ln(x)
    assert y.dtype == torch.float32
    assert torch.equal(y, torch.nn.functional.layer_norm(x, (64,), ln.weight, ln.bias, 1e-12))
    plain = ln(x)
    ln.low_precision = True
    assert torch.equal(ln(x), plain)


def test_layer_norm_compiles_whole_under_autocast(monkeypatch):
    """torch.compile of torch 2.11 (the GPU machines' torch) cannot trace
    torch.amp.is_autocast_available: a LayerNorm that asked it in forward was a graph break, 25 in
    bert-base, and the compiled model ran slower than eager on an H200 (results/gpu/). Its forward
    asks only what dynamo folds (is_autocast_enabled, get_autocast_dtype): here with that function
    made to fail, the LayerNorm runs and compiles as one graph, bf16 out, as eager."""
    from hpcbert.model import LayerNorm

    def refuse(device_type):
        raise AssertionError(f"is_autocast_available({device_type!r}) asked in a LayerNorm's forward")

    ln = LayerNorm(16)
    x = torch.randn(4, 16)
    monkeypatch.setattr(torch.amp, "is_autocast_available", refuse)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = ln(x)
        explained = torch._dynamo.explain(ln)(x)
    assert eager.dtype == torch.bfloat16
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


def test_the_residual_stream_is_in_the_layer_norms_precision():
    """--norm-precision low under bf16: every encoder layer's output (the residual stream) is bf16;
    fp32: fp32, as in Hugging Face's BERT under autocast. In an fp32 run the setting changes
    nothing: the same loss and gradients, bit for bit."""
    from hpcbert import policies

    torch.manual_seed(0)
    m = BertForSequenceClassification(BertConfig(**TINY)).train()
    ids, mask, types = padded_batch(TINY["vocab_size"])
    dtypes = []
    for layer in m.bert.encoder.layer:
        layer.register_forward_hook(lambda mod, args, out: dtypes.append(out.dtype))
    for norms, dtype in (("low", torch.bfloat16), ("fp32", torch.float32)):
        dtypes.clear()
        policies.norm_precision(m, norms)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(ids, mask, types)
        assert dtypes == [dtype] * TINY["num_hidden_layers"], norms

    def loss_and_grads(norms):
        policies.norm_precision(m, norms)
        m.zero_grad()
        torch.manual_seed(5)
        loss = m(ids, mask, types).sum()
        loss.backward()
        return loss, [p.grad.clone() for p in m.parameters()]

    (la, ga), (lb, gb) = loss_and_grads("low"), loss_and_grads("fp32")
    assert torch.equal(la, lb) and all(torch.equal(a, b) for a, b in zip(ga, gb))
    with pytest.raises(ValueError, match="norm_precision: 'half' is not one of low, fp32"):
        policies.norm_precision(m, "half")
