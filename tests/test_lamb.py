"""LAMB: the multi-tensor (torch._foreach_*) optimizer against the per-tensor loop it replaced, its
state_dict, and a real training run with --optimizer lamb."""

from __future__ import annotations

import copy
import io
import json
import subprocess
import sys

import pytest
import torch

from conftest import run_env
from hpcbert.model import BertConfig, BertForSequenceClassification
from hpcbert.optim import Lamb, param_groups

LR, WD = 0.02, 0.01


class LoopLamb(torch.optim.Optimizer):
    """The reference: hpcbert's LAMB as it was before the foreach version (one Python loop over the
    parameter tensors, a dozen ops each). You et al. 2020, Algorithm 2: Adam moments with bias
    correction, decoupled weight decay inside the update, trust ratio ||w|| / ||update|| (1 where
    either norm is 0)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = m / (1 - beta1 ** state["step"])
                v_hat = v / (1 - beta2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.add_(update * trust, alpha=-group["lr"])
        return loss


def tiny_bert(device="cpu") -> BertForSequenceClassification:
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(cfg).to(device)
    with torch.no_grad():
        model.classifier.weight.zero_()  # a weight matrix at 0: its first step has trust ratio 1
    return model


def batch(step: int, device="cpu"):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1, 200, (4, 16), generator=g)
    ids[:, 12:] = 0
    mask = (ids != 0).long()
    return ids.to(device), mask.to(device), torch.randint(0, 2, (4,), generator=g).to(device)


def backward(model: BertForSequenceClassification, step: int) -> None:
    """Real gradients from the classification loss, then the cases the optimizer must handle:
    a tensor whose grad is None every step (no state, unchanged), one whose grad is None every other
    step (its own step count, so its bias corrections differ from the rest), and one with a zero
    grad and no weight decay (zero update: trust ratio 1, unchanged)."""
    model.zero_grad(set_to_none=True)
    ids, mask, labels = batch(step, next(model.parameters()).device)
    model.loss_sum(model(ids, mask), labels).backward()
    emb = model.bert.embeddings
    emb.position_embeddings.weight.grad = None
    if step % 2:
        emb.token_type_embeddings.weight.grad = None
    emb.LayerNorm.bias.grad.zero_()


@torch.no_grad()
def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float((a - b).norm())


def assert_same_params(model, ref, rel: float) -> None:
    bad = {n: rel_diff(p, q) for (n, p), q in zip(model.named_parameters(), ref.parameters())
           if rel_diff(p, q) > rel}
    assert not bad, f"parameters differ by more than {rel} relative (||a - b|| / ||b||): {bad}"


def two_optimizers(device="cpu"):
    model, ref = tiny_bert(device), tiny_bert(device)
    return (model, Lamb(param_groups(model, WD), lr=LR)), (ref, LoopLamb(param_groups(ref, WD), lr=LR))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_foreach_lamb_equals_the_per_tensor_loop(device):
    (model, opt), (ref, ref_opt) = two_optimizers(device)
    assert len(opt.param_groups[0]["params"]) > 0 and len(opt.param_groups[1]["params"]) > 0  # decay and not
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(10):
        train([step], (model, opt), (ref, ref_opt))
        if step == 0:
            # The zero classifier weight moved by lr * update exactly (trust 1), with update =
            # m_hat / (sqrt(v_hat) + eps) = g / (|g| + eps) after one step (its weight-decay term is 0).
            g = model.classifier.weight.grad
            torch.testing.assert_close(model.classifier.weight, -LR * g / (g.abs() + 1e-6), rtol=1e-6, atol=1e-9)
    assert_same_params(model, ref, 1e-6)
    emb = model.bert.embeddings
    assert torch.equal(emb.position_embeddings.weight, w0["bert.embeddings.position_embeddings.weight"])
    assert emb.position_embeddings.weight not in opt.state
    assert torch.equal(emb.LayerNorm.bias, w0["bert.embeddings.LayerNorm.bias"])  # zero update, trust 1
    assert opt.state[emb.token_type_embeddings.weight]["step"] == 5 and opt.state[emb.word_embeddings.weight]["step"] == 10
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, w0[n])]
    assert len(moved) == len(w0) - 2  # everything else trained


def test_tensors_of_two_dtypes_in_one_group_match_the_loop():
    torch.manual_seed(1)
    ws = [torch.randn(7, 5), torch.randn(3, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)]
    ps, qs = [torch.nn.Parameter(w.clone()) for w in ws], [torch.nn.Parameter(w.clone()) for w in ws]
    opt, ref = Lamb(ps, lr=0.1, weight_decay=0.1), LoopLamb(qs, lr=0.1, weight_decay=0.1)
    for step in range(5):
        for params, o in ((ps, opt), (qs, ref)):
            o.zero_grad()
            sum((p.double() ** 3).sum() * (i + 1) for i, p in enumerate(params)).backward()
            o.step()
    for p, q in zip(ps, qs):
        assert p.dtype == q.dtype and rel_diff(p.detach(), q.detach()) < 1e-6


def roundtrip(state_dict: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def train(steps, lead, *others) -> None:
    """Steps of (model, optimizer) pairs with the same gradients: the lead model's real gradients,
    copied to the others, so that only the optimizers can make them differ (a tiny BERT has tensors
    whose true gradient is 0 and whose computed one is rounding noise, e.g. the attention key
    biases: softmax ignores a shift shared by all keys; LAMB normalises that noise to full-size steps)."""
    for step in steps:
        backward(lead[0], step)
        for m, _ in others:
            for p, q in zip(lead[0].parameters(), m.parameters()):
                q.grad = None if p.grad is None else p.grad.clone()
        for _, o in (lead, *others):
            o.step()


def test_state_dict_round_trip_continues_exactly():
    model = tiny_bert()
    opt = Lamb(param_groups(model, WD), lr=LR)
    train(range(5), (model, opt))
    restored = copy.deepcopy(model)
    opt2 = Lamb(param_groups(restored, WD), lr=LR)
    opt2.load_state_dict(roundtrip(opt.state_dict()))
    train(range(5, 10), (model, opt), (restored, opt2))
    for (n, p), q in zip(model.named_parameters(), restored.parameters()):
        assert torch.equal(p, q), n
    assert opt.state_dict()["state"].keys() == opt2.state_dict()["state"].keys()


@pytest.mark.parametrize("step_as", ["int", "tensor"])
def test_checkpoint_of_the_per_tensor_class_loads(step_as):
    """A state_dict written by the old per-tensor class (int steps) loads and continues as that class
    would; so does one whose steps are 0-d tensors (torch's Adam layout)."""
    ref = tiny_bert()
    ref_opt = LoopLamb(param_groups(ref, WD), lr=LR)
    train(range(5), (ref, ref_opt))
    saved = roundtrip(ref_opt.state_dict())
    if step_as == "tensor":
        for s in saved["state"].values():
            s["step"] = torch.tensor(float(s["step"]))
    model = copy.deepcopy(ref)
    opt = Lamb(param_groups(model, WD), lr=LR)
    opt.load_state_dict(saved)
    assert {type(s["step"]) for s in opt.state.values()} == {int}
    train(range(5, 10), (model, opt), (ref, ref_opt))
    assert_same_params(model, ref, 1e-6)


@pytest.mark.parametrize("kwargs,field", [(dict(lr=0.0), "lr"), (dict(betas=(0.9, 1.0)), "betas"),
                                          (dict(eps=-1.0), "eps"), (dict(weight_decay=-0.1), "weight_decay")])
def test_bad_hyperparameters_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        Lamb([torch.nn.Parameter(torch.ones(2))], **kwargs)


@pytest.mark.slow
def test_training_with_lamb_through_the_cli_lowers_the_loss(tmp_path):
    """bert-tiny on 64 synthetic sequences (4 batches of 16), 24 steps at lr 3e-2: the loss of
    the first steps is ln 2 (chance, 2 classes); with a working LAMB the last steps' loss is below
    a third of it (measured on 2 cores: 0.69 -> 0.13). An optimizer that does not move the weights
    stays at 0.69."""
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "hpcbert.cli", "train", "--model", "bert-tiny", "--task", "synthetic",
                        "--optimizer", "lamb", "--lr", "3e-2", "--max-steps", "24", "--batch-size", "16",
                        "--log-every", "1", "--synthetic-train-size", "64", "--synthetic-dev-size", "8",
                        "--max-seq-length", "32", "--threads", "1", "--no-do-eval", "--out", str(out)],
                       env=run_env(), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 24
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert first > 0.6 and last < first / 3, losses
    s = json.loads((out / "summary.json").read_text())
    assert s["optimizer"] == "lamb" and s["steps"] == 24 and s["stopped_by"] == "max_steps"
