"""Optimizers and the learning-rate schedule.

AdamW is PyTorch's (fused kernel on CUDA, and on CPU from torch 2.4). LAMB is not in PyTorch; this
is the algorithm of You et al. 2020 ("Large Batch Optimization for Deep Learning", Algorithm 2) as NVIDIA's and the HPC-AI
2020 kit used it: Adam moments with bias correction, decoupled weight decay inside the update, and
a per-tensor trust ratio ||w|| / ||update|| (1 where either norm is 0).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from .config import RunConfig
from .model import cpu_value


@torch.no_grad()
def clip_grad_norm(params, max_norm: float | None) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` (2-norm over all gradients, then every gradient times
    min(max_norm / (norm + 1e-6), 1)), returning the norm; max_norm None or 0: the norm only.

    PyTorch multiplies every gradient even when that factor is 1, so that a GPU never waits for
    the host to read the norm. On a CPU there is no such wait, and in fine-tuning the norm is mostly
    within the bound (an SST-2 run: 37 of 40 steps): the multiplication by 1, a read and a write of
    every gradient (91 MB for minilm-l6), is skipped there. The gradients are the same bits either
    way (x * 1.0 == x)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    # grouped by (device, dtype) as clip_grad_norm_ groups them (the order of the norms is the
    # order of the sum that makes the total)
    groups = [g for (_, _), ([g], _) in _group_tensors_by_device_and_dtype([grads]).items()]
    norms = [n for g in groups for n in torch._foreach_norm(g, 2.0)]
    device = grads[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2.0)
    if not max_norm:
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if device.type == "cpu" and all(g.device.type == "cpu" for g in grads) and cpu_value(coef) == 1.0:
        return total
    for g in groups:
        torch._foreach_mul_(g, coef.to(g[0].device))
    return total


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020, Algorithm 2) as multi-tensor ``torch._foreach_*`` ops.

    Per parameter tensor w with gradient g, at its own step t (a tensor whose grad is None is
    skipped and its t does not advance):
        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        r = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay w
        w = w - lr * trust * r,  trust = ||w|| / ||r||, or 1 where either norm is 0.
    Every operation runs once over all tensors of a (device, dtype) set (about a dozen foreach ops
    per set and step) instead of once per tensor from Python; the per-tensor norms come from
    ``torch._foreach_norm`` and the trust ratios stay on the device, so a step never waits for the
    device. Equal to the per-tensor loop it replaced (kept in tests/test_lamb.py). State per tensor:
    "step" (a Python int, as the per-tensor version kept it: the bias corrections are host
    arithmetic, not device reads), "exp_avg", "exp_avg_sq".
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0):
        if not lr > 0:
            raise ValueError(f"lr: must be > 0, got {lr}")
        if not (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"betas: must be two numbers in [0, 1), got {betas}")
        if not eps >= 0:
            raise ValueError(f"eps: must be >= 0, got {eps}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay: must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        # A step saved as a tensor (torch's Adam layout) becomes the int that step() counts with;
        # one read per tensor at load time, never inside step().
        for state in self.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = int(state["step"].item())

    def _gather(self, group: dict) -> dict[tuple, list[list]]:
        """(device, dtype) -> [params, grads, exp_avgs, exp_avg_sqs, steps] of the tensors that have
        a gradient; creates missing state and advances each tensor's step."""
        sets: dict[tuple, list[list]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise ValueError("Lamb: sparse gradients are not supported (use a dense embedding)")
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            lists = sets.setdefault((p.device, p.dtype), [[], [], [], [], []])
            for lst, x in zip(lists, (p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"])):
                lst.append(x)
        return sets

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for params, grads, exp_avgs, exp_avg_sqs, steps in self._gather(group).values():
                torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)  # m + (1 - b1)(g - m): one pass, as torch's Adam
                torch._foreach_mul_(exp_avg_sqs, beta2)
                torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
                # Bias corrections per tensor, in float64 on the host (steps differ where a grad was None).
                bc1 = [1 - beta1 ** t for t in steps]
                bc2 = [1 - beta2 ** t for t in steps]
                # r = (m / bc1) / (sqrt(v / bc2) + eps) = m / (sqrt(v) bc1 / sqrt(bc2) + bc1 eps), built in
                # one buffer (peak: one extra copy of the parameters, as torch's foreach Adam).
                update = torch._foreach_sqrt(exp_avg_sqs)
                torch._foreach_mul_(update, [b1 / math.sqrt(b2) for b1, b2 in zip(bc1, bc2)])
                torch._foreach_add_(update, [b1 * eps for b1 in bc1])
                torch._foreach_reciprocal_(update)
                torch._foreach_mul_(update, exp_avgs)
                if wd:
                    torch._foreach_add_(update, params, alpha=wd)
                w_norm = torch.stack(torch._foreach_norm(params))  # (N,)
                u_norm = torch.stack(torch._foreach_norm(update))  # (N,)
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                # w -= lr * trust * r in one pass; the (N,) trust ratios stay on the device (no sync).
                torch._foreach_addcmul_(params, update, (trust * -lr).unbind(0))
        return loss


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases and LayerNorm weights (BERT's exclusion list)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "LayerNorm" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(cfg: RunConfig, model: nn.Module, lr: float, device: torch.device) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "lamb":
        return Lamb(groups, lr=lr)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, fused=adamw_fused(device))


def adamw_fused(device: torch.device) -> bool:
    """PyTorch's fused AdamW kernel (one pass over each tensor instead of a dozen elementwise ops):
    on CUDA, and on CPU from torch 2.4 (a container's older torch keeps the per-tensor loop)."""
    return device.type == "cuda" or (device.type == "cpu" and torch.__version__ >= "2.4")


def scaled_lr(lr: float, scaling: str, world_size: int) -> float:
    """--lr-scaling: none keeps the given LR; linear multiplies by world size; sqrt by its root."""
    return {"none": lr, "linear": lr * world_size, "sqrt": lr * math.sqrt(world_size)}[scaling]


def warmup_linear(warmup_steps: int, total_steps: int):
    """LR multiplier: linear 0 -> 1 over warm-up, then linear 1 -> 0 at total_steps."""
    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))
    return f
