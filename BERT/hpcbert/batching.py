"""Batch arithmetic, stated once, and per-rank batch sizes for mixed GPU types.

    global batch  = sum of per-rank micro-batches x accumulation   (= per-device x accum x world
                    size when every rank has the same batch)
    steps/epoch   = ceil(train examples / global batch)            (the last step may be short)
    total steps   = --max-steps, or ceil(epochs x steps/epoch)
    warm-up steps = round(warmup_ratio x total steps)
    learning rate = --lr x {none: 1, linear: world size, sqrt: sqrt(world size)}

Per-rank batches (`--per-rank-batch 32,32,16,16` or `auto`) let a fast GPU beside a slow one carry
a bigger share: each rank draws a share of every global batch in proportion to its batch
(`data.features.shard`), and the loss is normalised by the global number of examples, so the
gradient equals that of one big batch and an epoch still covers every example once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import dist
from .config import RunConfig, parse_per_rank_batch
from .optim import scaled_lr


@dataclass(frozen=True)
class BatchPlan:
    per_rank: list[int]      # micro-batch of every global rank
    grad_accum: int
    global_batch: int        # sequences per optimizer step over all ranks
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    lr: float                # peak LR after --lr-scaling
    lr_scaling: str

    def describe(self, train_examples: int) -> str:
        b = self.per_rank
        per = f"{b[0]}/device x {len(b)} ranks" if len(set(b)) == 1 else f"per-rank {'+'.join(map(str, b))}"
        return (f"{train_examples} train examples; batch {per} x {self.grad_accum} accum = {self.global_batch} "
                f"global; {self.steps_per_epoch} steps/epoch, {self.total_steps} steps ({self.warmup_steps} "
                f"of LR warm-up); lr {self.lr:g} (scaling {self.lr_scaling})")


def plan(cfg: RunConfig, train_examples: int, per_rank: list[int]) -> BatchPlan:
    """Every derived batch figure, from the per-rank micro-batches and the config."""
    global_batch = sum(per_rank) * cfg.grad_accum
    steps_per_epoch = math.ceil(train_examples / global_batch)
    total_steps = cfg.max_steps or math.ceil(cfg.epochs * steps_per_epoch)
    return BatchPlan(list(per_rank), cfg.grad_accum, global_batch, steps_per_epoch, total_steps,
                     round(cfg.warmup_ratio * total_steps), scaled_lr(cfg.lr, cfg.lr_scaling, len(per_rank)),
                     cfg.lr_scaling)


def per_rank_batches(cfg: RunConfig, d: dist.Dist, probe=None, log=print) -> list[int]:
    """The micro-batch of every rank: --batch-size everywhere, the --per-rank-batch list, or
    'auto' (this rank's `probe()`, then all_gather so every rank knows every batch)."""
    spec = parse_per_rank_batch(cfg.per_rank_batch)
    if spec is None:
        return [cfg.batch_size] * d.world_size
    if isinstance(spec, list):
        if len(spec) != d.world_size:
            raise ValueError(f"per_rank_batch: {cfg.per_rank_batch!r} has {len(spec)} entr"
                             f"{'y' if len(spec) == 1 else 'ies'} but WORLD_SIZE={d.world_size}; give one "
                             f"batch per global rank (or 'auto')")
        return spec
    if d.device.type != "cuda" or probe is None:
        log(f"per_rank_batch auto: no device memory to probe on {d.device.type}; every rank uses "
            f"--batch-size {cfg.batch_size}")
        mine = cfg.batch_size
    else:
        mine = probe()
    return dist.all_gather_ints(d, mine)


def largest_that_fits(fits, limit: int) -> int:
    """Largest b in 1..limit with fits(b) (fits is monotone: True up to some size, then False);
    0 when even 1 does not fit. Doubles, then bisects: about 2 log2(b) trials."""
    lo, b = 0, 1  # lo fits
    while b <= limit and fits(b):
        lo, b = b, b * 2
    hi = min(b, limit + 1)  # hi does not fit (or is past the limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


PROBE_LIMIT = 4096  # the largest micro-batch --per-rank-batch auto tries


def probe_max_batch(model: torch.nn.Module, loss_of, device: torch.device, limit: int = PROBE_LIMIT,
                    reserve_factor: float = 3.0, margin: float = 0.9) -> int:
    """Largest micro-batch whose forward + backward fits this GPU, with the model as it will train
    (checkpointing policy applied); `loss_of(b)` runs the objective's forward and loss on a batch
    of b sequences at the run's longest length. Doubles until out of memory or past `limit` (the
    trainer passes the rank's share of the training set), then bisects.

    Memory that training adds later is held during the probe: `reserve_factor` x parameter
    bytes (AdamW's two moments + DDP's gradient buckets). The result keeps `margin` of the
    largest size that fit, for fragmentation and length variation."""
    assert device.type == "cuda"
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def fits(b: int) -> bool:
        reserve = None
        try:
            reserve = torch.empty(int(reserve_factor * param_bytes), dtype=torch.uint8, device=device)
            loss_of(b).backward()
            torch.cuda.synchronize(device)
            return True
        except torch.cuda.OutOfMemoryError:  # torch.OutOfMemoryError is torch >= 2.5 only
            return False
        finally:
            del reserve
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

    was_training = model.training
    model.train()
    lo = largest_that_fits(fits, limit)
    model.train(was_training)
    torch.cuda.reset_peak_memory_stats(device)
    if lo == 0:
        raise ValueError(f"per_rank_batch auto: not even one sequence fits on {device}; "
                         f"use --grad-ckpt all, a shorter --max-seq-length or a smaller model")
    return max(1, int(lo * margin))
