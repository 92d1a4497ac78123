"""LAMB, the LR schedule, LR scaling and config validation."""

from __future__ import annotations

import pytest
import torch

from hpcbert.config import RunConfig, parse_duration
from hpcbert.optim import Lamb, clip_grad_norm, scaled_lr, warmup_linear


def test_lamb_step_matches_the_paper_formula():
    torch.manual_seed(0)
    w0 = torch.randn(5, 3)
    g = torch.randn(5, 3)
    p = torch.nn.Parameter(w0.clone())
    opt = Lamb([p], lr=0.1, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    p.grad = g.clone()
    opt.step()
    m, v = 0.1 * g, 0.001 * g * g
    r = (m / 0.1) / ((v / 0.001).sqrt() + 1e-6) + 0.01 * w0
    expected = w0 - 0.1 * (w0.norm() / r.norm()) * r
    assert torch.allclose(p.detach(), expected, atol=1e-6)


def test_warmup_then_linear_decay():
    f = warmup_linear(4, 10)
    assert [round(f(s), 4) for s in range(11)] == [0.25, 0.5, 0.75, 1.0, 1.0, 0.8333, 0.6667, 0.5, 0.3333, 0.1667, 0.0]


def test_lr_scaling():
    assert scaled_lr(1e-4, "none", 8) == 1e-4
    assert scaled_lr(1e-4, "linear", 8) == pytest.approx(8e-4)
    assert scaled_lr(1e-4, "sqrt", 4) == pytest.approx(2e-4)


@pytest.mark.parametrize("text,seconds", [("20m", 1200), ("1h30m", 5400), ("90s", 90), ("1200", 1200),
                                          ("00:20:00", 1200), (45, 45)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("kwargs,field", [
    (dict(precision="fp8"), "precision"), (dict(grad_ckpt="half"), "grad_ckpt"), (dict(batch_size=0), "batch_size"),
    (dict(time_budget="twenty minutes"), "time_budget"), (dict(lr_decay="cosine"), "lr_decay"),
    (dict(eval_every="5 minutes"), "eval_every"), (dict(mask_prob=1.5), "mask_prob"), (dict(format="xlsx"), "format"),
    (dict(optimizer="sgd"), "optimizer"), (dict(max_seq_length=1024), "max_seq_length"), (dict(sampler="x"), "sampler"),
])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        RunConfig(**kwargs)


def test_a_glue_task_without_its_directory_is_refused_by_its_objective_naming_the_field():
    from hpcbert import objectives
    cfg = RunConfig(task="mrpc")
    with pytest.raises(ValueError, match=r"^data_dir: task 'mrpc' reads GLUE files"):
        objectives.get(cfg).check(cfg)


def test_eval_every_is_a_step_count_or_a_duration():
    assert (RunConfig(eval_every="500").eval_every_steps, RunConfig(eval_every="500").eval_every_seconds) == (500, None)
    assert (RunConfig(eval_every="10m").eval_every_steps, RunConfig(eval_every="10m").eval_every_seconds) == (None, 600.0)


def test_config_round_trip_and_unknown_keys():
    cfg = RunConfig(time_budget="20m", grad_ckpt="every:3")
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown field.*bogus"):
        RunConfig.from_dict({**cfg.to_dict(), "bogus": 1})


@pytest.mark.parametrize("scale,max_norm", [(0.01, 1.0), (10.0, 1.0), (1.0, None), (10.0, 0.0)])
def test_clip_grad_norm_gives_the_bits_of_torchs(scale, max_norm):
    # The reference is PyTorch's clip_grad_norm_ (max_norm None/0 in hpcbert = no clipping = inf
    # there): the same norm and the same gradients, bit for bit, whether the norm is inside the
    # bound (hpcbert skips the multiplication by 1) or over it (both scale).
    torch.manual_seed(0)
    shapes = [(30, 7), (7,), (5, 5, 3), (1,)]
    grads = [torch.randn(s) * scale for s in shapes] + [torch.randn(4).double() * scale]  # two dtypes
    ours = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for a, b, g in zip(ours, ref, grads):
        a.grad, b.grad = g.clone(), g.clone()
    ref.append(torch.nn.Parameter(torch.zeros(3)))  # a parameter without a gradient is left out by both
    ours.append(torch.nn.Parameter(torch.zeros(3)))
    n_ours = clip_grad_norm(ours, max_norm)
    n_ref = torch.nn.utils.clip_grad_norm_(ref, max_norm or float("inf"))
    assert torch.equal(n_ours, n_ref)
    clipped = scale == 10.0 and max_norm
    for a, b, g in zip(ours, ref, grads):
        assert torch.equal(a.grad, b.grad)
        assert torch.equal(a.grad, g) != bool(clipped)  # scaled exactly when the norm is over the bound
