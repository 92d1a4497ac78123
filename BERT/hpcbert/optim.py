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

from .config import RunConfig


class Lamb(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0):
        if lr <= 0:
            raise ValueError(f"lr: must be > 0, got {lr}")
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
