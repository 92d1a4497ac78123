"""The training run: set-up, the loop, evaluation, and the run directory it leaves.

Read top to bottom: `train(cfg)` builds everything, runs `_loop`, evaluates, writes summary.json.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as tdist
from torch import nn

from . import PROCESS_START, __version__, batching, dist, meters, policies, zoo
from .config import RunConfig
from .data.features import Features, collate, epoch_order, global_batches, shard
from .data.metrics import accuracy, compute_metrics
from .data.tasks import TaskData, load_task_data
from .model import BertForSequenceClassification, flops_per_sequence, load_pretrained
from .optim import make_optimizer, warmup_linear
from .runfiles import SCHEMA_VERSION, MetricsWriter, write_json_atomic


def log(d: dist.Dist, msg: str) -> None:
    if d.is_main:
        print(f"[hpcbert {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def default_run_dir(cfg: RunConfig) -> Path:
    model = Path(cfg.model).name
    return Path("runs") / f"{cfg.task}-{model}-{cfg.grad_ckpt.replace(':', '')}-{time.strftime('%Y%m%d-%H%M%S')}"


def build_model(cfg: RunConfig, num_labels: int, d: dist.Dist) -> tuple[BertForSequenceClassification, zoo.ModelSource]:
    src = zoo.resolve(cfg.model)
    overrides = {"num_labels": num_labels}
    if cfg.dropout is not None:
        overrides.update(hidden_dropout_prob=cfg.dropout, attention_probs_dropout_prob=cfg.dropout)
    mcfg = type(src.config)(**{**src.config.to_dict(), **overrides})
    torch.manual_seed(cfg.seed)  # same initial head (and random model) on every rank
    model = BertForSequenceClassification(mcfg)
    if src.weights_dir is not None:
        rep = load_pretrained(model, src.weights_dir)
        if rep.unexpected:
            log(d, f"weights: ignored checkpoint tensors not in the model: {', '.join(rep.unexpected)}")
        if rep.mismatched:
            log(d, f"weights: shape mismatch, freshly initialised: {', '.join(rep.mismatched)}")
        if rep.missing:
            log(d, f"weights: not in the checkpoint, freshly initialised: {', '.join(rep.missing)}")
    else:
        log(d, f"model {cfg.model}: RANDOM weights ({mcfg.num_hidden_layers} layers, {mcfg.hidden_size} wide), for throughput work")
    return model.to(d.device), src


@dataclass
class LoopResult:
    steps: int
    sequences: int
    epochs_done: float
    stopped_by: str
    first_step_start: float
    last_step_end: float
    final_loss: float | None


class Progress:
    """A one-line progress bar on a terminal; periodic plain log lines otherwise."""

    def __init__(self, d: dist.Dist, total: int, every: int):
        self.d, self.total, self.every = d, total, every
        self.tty = d.is_main and sys.stderr.isatty()

    def update(self, step: int, loss: float, seq_per_s: float, elapsed: float) -> None:
        if not self.d.is_main:
            return
        eta = elapsed / step * (self.total - step)
        line = f"step {step}/{self.total} loss {loss:.4f} {seq_per_s:.1f} seq/s eta {eta:.0f}s"
        if self.tty:
            filled = int(30 * step / self.total)
            print(f"\r[{'#' * filled}{'.' * (30 - filled)}] {line}", end="", file=sys.stderr, flush=True)
        elif step % self.every == 0 or step == self.total:
            log(self.d, line)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr, flush=True)


def _agree_stop(d: dist.Dist, stop: bool) -> bool:
    """All ranks stop at the same step: any rank's stop request stops everyone."""
    if not d.active:
        return stop
    flag = torch.tensor([1.0 if stop else 0.0], device=d.device)
    tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
    return bool(flag.item())


def train(cfg: RunConfig) -> dict:
    """Run one training job and return its summary (rank 0 also writes the run directory)."""
    d = dist.init(cfg.threads, cfg.dist_timeout)
    try:
        return _train(cfg, d)
    finally:
        dist.shutdown(d)


def _train(cfg: RunConfig, d: dist.Dist) -> dict:
    run_dir = Path(cfg.out) if cfg.out else default_run_dir(cfg)
    cfg = cfg.replace(out=str(run_dir))
    if d.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(run_dir / "config.json", cfg.to_dict())

    # --- data and model ---
    src = zoo.resolve(cfg.model)
    if d.is_main:  # rank 0 tokenises (or reads the cache); the others wait and read the cache
        data = load_task_data(cfg, src.vocab_dir, src.config.vocab_size)
    dist.barrier(d)
    if not d.is_main:
        data = load_task_data(cfg, src.vocab_dir, src.config.vocab_size)
    spec = data.spec
    model, src = build_model(cfg, spec.num_labels, d)
    precision = policies.resolve_precision(cfg.precision, d.device)
    ckpt_layers = policies.apply_grad_ckpt(model, cfg.grad_ckpt)
    amp = lambda: policies.autocast(precision, d.device)  # noqa: E731 - a fresh context each use

    # --- batch arithmetic, stated once (batching.py): global = sum of per-rank batches x accumulation ---
    per_rank = batching.per_rank_batches(
        cfg, d, lambda: batching.probe_max_batch(model, cfg.max_seq_length, amp, d.device), lambda m: log(d, m))
    bp = batching.plan(cfg, len(data.train), per_rank)
    global_batch, steps_per_epoch, total_steps, warmup_steps, lr = (
        bp.global_batch, bp.steps_per_epoch, bp.total_steps, bp.warmup_steps, bp.lr)
    log(d, f"{spec.name}: {bp.describe(len(data.train))}; precision {precision}; "
           f"grad_ckpt {cfg.grad_ckpt} (layers {ckpt_layers}); {d.world_size} process(es) on {d.nodes} node(s), "
           f"backend {d.backend or 'none'}, {d.threads} thread(s) each")

    # --- measurements taken before training (part of start-up) ---
    model.train()
    act_bytes = meters.activation_bytes_per_sequence(model, cfg.max_seq_length, amp(), d.device)
    peak, peak_src = meters.peak_flops(d.device, precision)

    # --- policies that change how the model runs ---
    raw = model
    if d.active:
        # Gradients are all-reduced in 25 MB buckets, overlapping the rest of the backward pass.
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[d.local_rank] if d.device.type == "cuda" else None, bucket_cap_mb=25)
    model = policies.maybe_compile(model, cfg.compile)
    optimizer = make_optimizer(cfg, raw, lr, d.device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_linear(warmup_steps, total_steps))
    scaler = policies.grad_scaler(precision, d.device)

    meter = meters.StepMeter()
    writer = MetricsWriter(run_dir / "metrics.jsonl") if d.is_main else None
    deadline = PROCESS_START + cfg.time_budget if cfg.time_budget else None
    torch.manual_seed(cfg.seed + 1000 * d.rank)  # dropout differs per rank, as in any DDP run
    result = _loop(cfg, d, model, raw, optimizer, scheduler, scaler, amp, data.train, per_rank, global_batch,
                   total_steps, steps_per_epoch, deadline, meter, writer)
    if writer:
        writer.close()

    # --- evaluation (after the time box) ---
    evals = {}
    if cfg.do_eval and data.dev:
        for split, feats in data.dev.items():
            evals[split] = evaluate(raw, feats, spec, cfg, d, amp)
            log(d, f"eval {split}: " + ", ".join(f"{k} {v:.4f}" for k, v in evals[split].items()))

    summary = _summary(cfg, d, src, raw, spec, precision, ckpt_layers, lr, per_rank, global_batch, result, meter,
                       deadline, act_bytes, peak, peak_src, evals, run_dir)
    if d.is_main:
        write_json_atomic(run_dir / "summary.json", summary)
        log(d, f"run directory: {run_dir}")
    return summary


def _loop(cfg, d, model, raw, optimizer, scheduler, scaler, amp, train: Features, per_rank, global_batch,
          total_steps, steps_per_epoch, deadline, meter: meters.StepMeter, writer) -> LoopResult:
    mcfg = raw.config
    progress = Progress(d, total_steps, cfg.log_every)
    pad_to = cfg.max_seq_length if cfg.pad_to_max_length else None
    epoch, batches, pos = 0, None, 0
    step, seqs, stopped_by = 0, 0, "max_steps" if cfg.max_steps else "epochs"
    window_loss: list[float] = []
    last_loss = None
    first_start = time.time()
    while step < total_steps:
        if batches is None or pos == len(batches):
            if batches is not None:
                epoch, pos = epoch + 1, 0
            batches = global_batches(epoch_order(train.lengths, cfg.sampler, cfg.seed, epoch, global_batch), global_batch)
        # Time box: stop before a step that would not finish inside the budget.
        if deadline is not None:
            est = float(np.median(meter.times[-5:])) if len(meter) else 0.0
            if _agree_stop(d, time.time() + est > deadline):
                stopped_by = "time_budget"
                break
        t0 = time.perf_counter()
        gb = batches[pos]
        micro = shard(gb, per_rank, d.rank, cfg.grad_accum)
        loss_acc = torch.zeros((), device=d.device)
        real_tokens = padded = 0
        flops = 0.0
        for j, idx in enumerate(micro):
            # A short last batch can leave this rank no example; it must still join DDP's
            # all-reduce, so it runs one example with weight 0 (zero gradient, not counted).
            weight = 1.0 if len(idx) else 0.0
            batch = collate(train, idx if len(idx) else gb[:1], pad_to).to(d.device)
            B, T = batch.input_ids.shape
            if weight:
                real_tokens += batch.real_tokens
                padded += B * T
                flops += B * flops_per_sequence(mcfg, T)
            # Gradients are all-reduced only on the last micro-batch of the step.
            sync = contextlib.nullcontext() if (not d.active or j == len(micro) - 1) else model.no_sync()
            with sync:
                with amp():
                    logits = model(batch.input_ids, batch.attention_mask, batch.token_type_ids)
                    # Sum over the micro-batch / examples in the global batch, x world size because
                    # DDP averages gradients over ranks: the gradient is that of one big batch.
                    loss = raw.loss_sum(logits, batch.labels) * (weight * d.world_size / len(gb))
                scaler.scale(loss).backward()
            loss_acc += loss.detach()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.max_grad_norm or float("inf"))
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if d.active:
            tdist.all_reduce(loss_acc)
            loss_acc /= d.world_size
        loss_value = float(loss_acc)  # CPU-GPU sync point: the step's work is done here
        t1 = time.perf_counter()
        step, pos, seqs = step + 1, pos + 1, seqs + len(gb)
        if d.active:  # per-rank token counts differ; the global figures are what a user wants
            counts = torch.tensor([real_tokens, padded, flops], dtype=torch.float64, device=d.device)
            tdist.all_reduce(counts)
            real_tokens, padded, flops = int(counts[0]), int(counts[1]), float(counts[2])
        meter.add(t1 - t0, len(gb), real_tokens, padded, flops, time.time())
        window_loss.append(loss_value)
        progress.update(step, loss_value, len(gb) / (t1 - t0), time.time() - first_start)
        if step % cfg.log_every == 0 or step == total_steps:
            last_loss = float(np.mean(window_loss))
            if writer:
                n = len(window_loss)
                wt = sum(meter.times[-n:])
                writer.write({"step": step, "epoch": epoch + pos / len(batches), "loss": last_loss,
                              "lr": scheduler.get_last_lr()[0], "grad_norm": float(grad_norm),
                              "step_time_s": wt / n, "sequences_per_sec": sum(meter.sequences[-n:]) / wt,
                              "tokens_per_sec": sum(meter.tokens[-n:]) / wt, "elapsed_s": time.time() - PROCESS_START})
            window_loss = []
    progress.close()
    if window_loss:
        last_loss = float(np.mean(window_loss))
    epochs_done = (epoch + (pos / len(batches) if batches else 0)) if step else 0.0
    return LoopResult(step, seqs, epochs_done, stopped_by, first_start, meter.ends[-1] if len(meter) else first_start,
                      last_loss)


@torch.no_grad()
def evaluate(model: BertForSequenceClassification, feats: Features, spec, cfg: RunConfig, d: dist.Dist, amp) -> dict:
    """Score every dev example exactly once across ranks (rank r takes r, r+W, ...; no padding
    duplicates), with the task's official metric and the mean dev loss."""
    model.eval()
    order = np.argsort(-feats.lengths, kind="stable")  # length-sorted: least padding, same result
    mine = order[d.rank::d.world_size]
    preds, loss_sum = [], 0.0
    for i in range(0, len(mine), cfg.eval_batch_size):
        idx = mine[i:i + cfg.eval_batch_size]
        batch = collate(feats, idx).to(d.device)
        with amp():
            logits = model(batch.input_ids, batch.attention_mask, batch.token_type_ids)
        loss_sum += float(model.loss_sum(logits, batch.labels))
        out = logits.float().squeeze(-1) if spec.is_regression else logits.argmax(-1)
        preds.append(out.cpu().numpy())
    # A rank can have no dev example (dev set smaller than the world): an empty array of the right dtype.
    local = (mine, np.concatenate(preds) if preds else np.zeros(0, np.float32 if spec.is_regression else np.int64),
             loss_sum)
    if d.active:
        gathered: list = [None] * d.world_size
        tdist.all_gather_object(gathered, local)
    else:
        gathered = [local]
    idx = np.concatenate([g[0] for g in gathered])
    pred = np.concatenate([g[1] for g in gathered])
    assert len(idx) == len(feats) and len(np.unique(idx)) == len(feats), "every dev example exactly once"
    ordered = np.empty_like(pred)
    ordered[idx] = pred
    model.train()
    metrics = (compute_metrics(spec, ordered, feats.labels) if spec.name != "synthetic"
               else {"accuracy": accuracy(ordered, feats.labels)})
    metrics["loss"] = sum(g[2] for g in gathered) / len(feats)
    return metrics


def _summary(cfg, d, src, raw, spec, precision, ckpt_layers, lr, per_rank, global_batch, result: LoopResult,
             meter: meters.StepMeter, deadline, act_bytes, peak, peak_src, evals, run_dir) -> dict:
    mcfg = raw.config
    warmup = cfg.warmup_steps_excluded if cfg.warmup_steps_excluded is not None else meter.default_warmup(len(meter))
    warmup = min(warmup, max(0, len(meter) - 1))
    steady = meter.steady(warmup)
    startup = result.first_step_start - PROCESS_START
    train_s = result.last_step_end - result.first_step_start
    mem, mem_kind = meters.peak_memory(d.device)
    per_rank_t = _per_rank_step_times(d, meter, warmup)
    in_budget = None
    if deadline is not None:
        done = [i for i, end in enumerate(meter.ends) if end <= deadline]
        in_budget = (len(done), sum(meter.sequences[i] for i in done))
    mfu = steady["model_flops_per_sec"] / peak if (peak and steady["model_flops_per_sec"]) else None
    return {
        "schema_version": SCHEMA_VERSION,
        "hpcbert_version": __version__,
        "run": run_dir.name,
        "task": spec.name,
        "model": cfg.model,
        "model_is_random": src.is_random,
        "num_layers": mcfg.num_hidden_layers,
        "hidden_size": mcfg.hidden_size,
        "max_seq_length": cfg.max_seq_length,
        "precision": precision,
        "compile": cfg.compile,
        "grad_ckpt": cfg.grad_ckpt,
        "ckpt_layers": ckpt_layers,
        "optimizer": cfg.optimizer,
        "lr": lr,
        "lr_scaling": cfg.lr_scaling,
        "seed": cfg.seed,
        "world_size": d.world_size,
        "nodes": d.nodes,
        "gpus_per_node": d.local_world_size,
        "dist_backend": d.backend,
        "per_device_batch_size": per_rank[0] if len(set(per_rank)) == 1 else per_rank,
        "grad_accum": cfg.grad_accum,
        "global_batch_size": global_batch,
        "steps": result.steps,
        "epochs_done": result.epochs_done,
        "sequences": result.sequences,
        "startup_s": startup,
        "train_s": train_s,
        "warmup_steps_excluded": warmup,
        "steady_steps_per_sec": steady["steady_steps_per_sec"],
        "steady_sequences_per_sec": steady["steady_sequences_per_sec"],
        "steady_step_time_s": steady["steady_step_time_s"],
        "e2e_sequences_per_sec": result.sequences / (startup + train_s) if result.steps else None,
        "tokens_per_sec": steady["tokens_per_sec"],
        "padded_tokens_per_sec": steady["padded_tokens_per_sec"],
        "throughput_method": (f"summed step times of steps {warmup + 1}..{len(meter)} (first {warmup} excluded as "
                              f"warm-up); a step runs from its first batch to the end of the optimizer step, so "
                              f"evaluation, checkpoint and logging time is excluded"),
        "time_budget_s": cfg.time_budget,
        "steps_in_budget": in_budget[0] if in_budget else None,
        "sequences_in_budget": in_budget[1] if in_budget else None,
        "stopped_by": result.stopped_by,
        "activation_bytes_per_sequence": act_bytes,
        "peak_memory_bytes": mem,
        "peak_memory_kind": mem_kind,
        "model_flops_per_sec": steady["model_flops_per_sec"],
        "peak_flops": peak,
        "peak_flops_source": peak_src,
        "mfu": mfu,
        "final_loss": result.final_loss,
        "eval": evals,
        "main_metric": spec.main_metric,
        "per_rank_step_time_s": per_rank_t,
        "versions": meters.versions(),
        "hardware": meters.hardware(d.device),
        "git_commit": meters.git_commit(),
    }


def _per_rank_step_times(d: dist.Dist, meter: meters.StepMeter, warmup: int) -> dict | None:
    """Median steady step time of every rank, gathered: a slow GPU or node shows up here."""
    t = meter.times[warmup:]
    mine = float(np.median(t)) if t else float("nan")
    if d.active:
        allt = torch.zeros(d.world_size, dtype=torch.float64, device=d.device)
        allt[d.rank] = mine
        tdist.all_reduce(allt)
        values = allt.tolist()
    else:
        values = [mine]
    if not t:
        return None
    return {"min": min(values), "median": float(np.median(values)), "max": max(values),
            "slowest_rank": int(np.argmax(values)), "per_rank": values}
