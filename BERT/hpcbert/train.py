"""The training run: set-up, the loop, evaluation, and the run directory it leaves.

Read top to bottom: `train(cfg)` builds everything, runs `_loop`, evaluates, writes summary.json.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as tdist
from torch import nn

from . import PROCESS_START, __version__, batching, dist, meters, policies, zoo
from .checkpoint import Checkpoint, CheckpointManager
from .config import RESUMABLE_CHANGES, RunConfig
from .data.features import Features, collate, epoch_order, global_batches, shard
from .data.metrics import accuracy, compute_metrics
from .data.tasks import load_task_data
from .model import BertForSequenceClassification, flops_per_sequence, load_pretrained
from .optim import make_optimizer, warmup_linear
from .runfiles import SCHEMA_VERSION, MetricsWriter, write_json_atomic
from .stopping import REASONS, StopConditions


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
class LoopState:
    """Where training stands. Saved in every checkpoint, so a resumed run continues exactly."""

    step: int = 0                  # optimizer steps done
    epoch: int = 0                 # current epoch
    pos: int = 0                   # global batches of `epoch` done
    sequences: int = 0             # training sequences done
    window_loss: list[float] = field(default_factory=list)   # losses since the last log line
    last_loss: float | None = None
    elapsed_s: float = 0.0         # wall time of earlier segments (process start to their checkpoint);
                                   # it counts against the time box and the end-to-end rate
    resumed_from_step: int | None = None


@dataclass
class LoopResult:
    stopped_by: str
    first_step_start: float
    last_step_end: float


class Progress:
    """A one-line progress bar on a terminal; periodic plain log lines otherwise."""

    def __init__(self, d: dist.Dist, total: int, every: int, deadline: float | None = None):
        self.d, self.total, self.every, self.deadline = d, total, every, deadline
        self.tty = d.is_main and sys.stderr.isatty()

    def update(self, step: int, loss: float, seq_per_s: float, elapsed: float) -> None:
        if not self.d.is_main:
            return
        eta = elapsed / step * (self.total - step)
        if self.deadline is not None:  # the time box ends the run first
            eta = max(0.0, min(eta, self.deadline - time.time()))
        line = f"step {step}/{self.total} loss {loss:.4f} {seq_per_s:.1f} seq/s eta {eta:.0f}s"
        if self.tty:
            filled = int(30 * step / self.total)
            print(f"\r[{'#' * filled}{'.' * (30 - filled)}] {line}", end="", file=sys.stderr, flush=True)
        elif step % self.every == 0 or step == self.total:
            log(self.d, line)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr, flush=True)


def _agree_reason(d: dist.Dist, reason: str | None) -> str | None:
    """All ranks stop at the same step: the strongest reason any rank has stops everyone."""
    if not d.active:
        return reason
    code = torch.tensor([REASONS.index(reason)], device=d.device)
    tdist.all_reduce(code, op=tdist.ReduceOp.MAX)
    return REASONS[int(code.item())]


def _agree_flag(d: dist.Dist, flag: bool) -> bool:
    if not d.active:
        return flag
    t = torch.tensor([1 if flag else 0], device=d.device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return bool(t.item())


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
    global_batch, total_steps, warmup_steps, lr = bp.global_batch, bp.total_steps, bp.warmup_steps, bp.lr
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

    # --- resume: the newest complete checkpoint of this run directory, if asked ---
    meter, state = meters.StepMeter(), LoopState()
    ckman = CheckpointManager(run_dir / "checkpoints", cfg.keep_last, d.rank, d.world_size, lambda: dist.barrier(d))
    torch.manual_seed(cfg.seed + 1000 * d.rank)  # dropout differs per rank, as in any DDP run
    data_fp = _data_fingerprint(data.train)
    ck = _find_checkpoint(cfg, ckman, d)
    if ck is not None:
        _restore(ck, ckman, cfg, data_fp, raw, optimizer, scheduler, scaler, state, meter, d)
        log(d, f"resumed from {ck.path} (step {state.step}, epoch {state.epoch}, batch {state.pos})")
        if d.is_main:
            _truncate_metrics(run_dir / "metrics.jsonl", state.step)

    def save() -> None:
        t = time.perf_counter()
        shared = {"model": raw.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                  "scaler": scaler.state_dict(), "meter": asdict(meter), "config": cfg.to_dict(), "data": data_fp,
                  "loop": {**asdict(state), "elapsed_s": state.elapsed_s + time.time() - PROCESS_START}}
        mine = {"rng_cpu": torch.get_rng_state(),
                "rng_cuda": torch.cuda.get_rng_state(d.device) if d.device.type == "cuda" else None}
        path = ckman.save(state.step, shared, mine)
        log(d, f"checkpoint {path} ({time.perf_counter() - t:.1f}s)")

    writer = MetricsWriter(run_dir / "metrics.jsonl") if d.is_main else None
    budget_left = cfg.time_budget - state.elapsed_s if cfg.time_budget else None
    stops = StopConditions.from_env(PROCESS_START + budget_left if budget_left is not None else None)
    stops.install_signal_handlers()
    try:
        result = _loop(cfg, d, model, raw, optimizer, scheduler, scaler, amp, data.train, per_rank, global_batch,
                       total_steps, stops, meter, state, writer, save if cfg.checkpointing else None)
    finally:
        stops.restore_signal_handlers()  # from here on a SIGTERM ends the process at once
        if writer:
            writer.close()
    early = result.stopped_by in ("signal", "stop_file", "job_deadline")
    if (cfg.checkpointing or early or ck is not None) and state.step and state.step != _last_saved(ckman):
        save()  # one complete checkpoint at the end of every segment: resubmitting continues from here

    # --- evaluation (after the time box; skipped when stopping early: the job's time is up) ---
    evals = {}
    if cfg.do_eval and data.dev and not early:
        for split, feats in data.dev.items():
            evals[split] = evaluate(raw, feats, spec, cfg, d, amp)
            log(d, f"eval {split}: " + ", ".join(f"{k} {v:.4f}" for k, v in evals[split].items()))
    elif early:
        log(d, f"stopped early ({result.stopped_by}) at step {state.step}: run the same command again to resume")

    summary = _summary(cfg, d, src, raw, spec, precision, ckpt_layers, lr, per_rank, global_batch, result, meter,
                       state, len(data.train), act_bytes, peak, peak_src, evals, run_dir)
    if d.is_main:
        write_json_atomic(run_dir / "summary.json", summary)
        log(d, f"run directory: {run_dir}")
    return summary


def _loop(cfg, d, model, raw, optimizer, scheduler, scaler, amp, train: Features, per_rank, global_batch,
          total_steps, stops: StopConditions, meter: meters.StepMeter, state: LoopState, writer, save) -> LoopResult:
    mcfg = raw.config
    progress = Progress(d, total_steps, cfg.log_every, stops.budget_deadline)
    pad_to = cfg.max_seq_length if cfg.pad_to_max_length else None
    order = lambda epoch: global_batches(epoch_order(train.lengths, cfg.sampler, cfg.seed, epoch, global_batch),  # noqa: E731
                                         global_batch)
    batches = order(state.epoch)
    stopped_by = "max_steps" if cfg.max_steps else "epochs"
    first_start = last_end = time.time()
    last_save = time.time()
    while state.step < total_steps:
        if state.pos == len(batches):
            state.epoch, state.pos = state.epoch + 1, 0
            batches = order(state.epoch)  # reshuffled per epoch, the same on every rank
        # Stop before a step that would not finish in time, or on a signal / stop file.
        est = float(np.median(meter.times[-5:])) if len(meter) else 0.0
        reason = _agree_reason(d, stops.reason(est))
        if reason is not None:
            stopped_by = reason
            break
        t0 = time.perf_counter()
        gb = batches[state.pos]
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
        state.step, state.pos, state.sequences = state.step + 1, state.pos + 1, state.sequences + len(gb)
        if d.active:  # per-rank token counts differ; the global figures are what a user wants
            counts = torch.tensor([real_tokens, padded, flops], dtype=torch.float64, device=d.device)
            tdist.all_reduce(counts)
            real_tokens, padded, flops = int(counts[0]), int(counts[1]), float(counts[2])
        end = last_end = time.time()
        meter.add(t1 - t0, len(gb), real_tokens, padded, flops, end,
                  in_budget=stops.budget_deadline is None or end <= stops.budget_deadline)
        state.window_loss.append(loss_value)
        progress.update(state.step, loss_value, len(gb) / (t1 - t0), end - first_start)
        if state.step % cfg.log_every == 0 or state.step == total_steps:
            n = len(state.window_loss)
            state.last_loss = float(np.mean(state.window_loss))
            if writer:
                wt = sum(meter.times[-n:])
                writer.write({"step": state.step, "epoch": state.epoch + state.pos / len(batches),
                              "loss": state.last_loss, "lr": scheduler.get_last_lr()[0], "grad_norm": float(grad_norm),
                              "step_time_s": wt / n, "sequences_per_sec": sum(meter.sequences[-n:]) / wt,
                              "tokens_per_sec": sum(meter.tokens[-n:]) / wt, "elapsed_s": end - PROCESS_START})
            state.window_loss = []
        # Periodic checkpoints, outside the timed step. Time-based: rank 0's clock decides for all.
        if save is not None and state.step < total_steps:
            due = bool(cfg.checkpoint_steps and state.step % cfg.checkpoint_steps == 0)
            if cfg.checkpoint_every:
                due = _agree_flag(d, due or (d.is_main and time.time() - last_save >= cfg.checkpoint_every))
            if due:
                save()
                last_save = time.time()
    progress.close()
    if state.window_loss:
        state.last_loss = float(np.mean(state.window_loss))
    return LoopResult(stopped_by, first_start, last_end)


def _data_fingerprint(train: Features) -> str:
    """Token ids and labels of the training set: a different vocabulary or data changes it."""
    h = hashlib.sha256(train.ids.tobytes())
    h.update(train.offsets.tobytes())
    h.update(np.asarray(train.labels).tobytes())
    return h.hexdigest()[:16]


def _find_checkpoint(cfg: RunConfig, ckman: CheckpointManager, d: dist.Dist) -> Checkpoint | None:
    mode = cfg.resume_mode()
    if mode == "never":
        return None
    if mode == "auto":
        return ckman.latest()
    return ckman.verify(Path(mode))


def _last_saved(ckman: CheckpointManager) -> int | None:
    cks = ckman.list()
    return cks[-1].step if cks else None


def _restore(ck: Checkpoint, ckman: CheckpointManager, cfg: RunConfig, data_fp: str, raw, optimizer, scheduler,
             scaler, state: LoopState, meter: meters.StepMeter, d: dist.Dist) -> None:
    shared, mine = ckman.load(ck, map_location=d.device)
    changed = sorted(k for k, v in shared["config"].items()
                     if k not in RESUMABLE_CHANGES and getattr(cfg, k, None) != v)
    if changed:
        detail = ", ".join(f"{k} (checkpoint {shared['config'][k]!r}, now {getattr(cfg, k, None)!r})" for k in changed)
        raise ValueError(f"resume: {ck.path} was written with other settings: {detail}; "
                         f"use another --out or --resume never")
    if shared["data"] != data_fp:
        raise ValueError(f"resume: {ck.path} was trained on other token ids (vocabulary or training data changed); "
                         f"use another --out or --resume never")
    raw.load_state_dict(shared["model"])
    optimizer.load_state_dict(shared["optimizer"])
    scheduler.load_state_dict(shared["scheduler"])
    scaler.load_state_dict(shared["scaler"])
    for k, v in shared["meter"].items():
        setattr(meter, k, list(v))
    for k, v in shared["loop"].items():
        setattr(state, k, v)
    state.resumed_from_step = ck.step
    torch.set_rng_state(mine["rng_cpu"].cpu())
    if mine.get("rng_cuda") is not None:
        torch.cuda.set_rng_state(mine["rng_cuda"].cpu(), d.device)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines the interrupted segment wrote after the checkpoint we resume from."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    write_json_lines = "".join(line + "\n" for line in keep)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(write_json_lines)
    tmp.replace(path)


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
             meter: meters.StepMeter, state: LoopState, n_train: int, act_bytes, peak, peak_src, evals,
             run_dir) -> dict:
    mcfg = raw.config
    warmup = cfg.warmup_steps_excluded if cfg.warmup_steps_excluded is not None else meter.default_warmup(len(meter))
    warmup = min(warmup, max(0, len(meter) - 1))
    steady = meter.steady(warmup)
    startup = result.first_step_start - PROCESS_START
    train_s = result.last_step_end - result.first_step_start
    mem, mem_kind = meters.peak_memory(d.device)
    per_rank_t = _per_rank_step_times(d, meter, warmup)
    in_budget = None
    if cfg.time_budget is not None:
        done = [i for i, inside in enumerate(meter.in_budget) if inside]
        in_budget = (len(done), sum(meter.sequences[i] for i in done))
    wall = state.elapsed_s + (result.last_step_end - PROCESS_START)  # all segments, from process start
    mfu = steady["model_flops_per_sec"] / peak if (peak and steady["model_flops_per_sec"]) else None
    if mfu is not None and mfu > 1:
        # The run itself beat the measured "peak": other work slowed that measurement. No MFU
        # rather than a wrong one.
        peak_src += "; below the achieved model FLOP/s (machine busy while measuring): MFU withheld"
        mfu = None
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
        "steps": state.step,
        "epochs_done": state.sequences / n_train,
        "sequences": state.sequences,
        "resumed_from_step": state.resumed_from_step,
        "startup_s": startup,
        "train_s": train_s,
        "warmup_steps_excluded": warmup,
        "steady_steps_per_sec": steady["steady_steps_per_sec"],
        "steady_sequences_per_sec": steady["steady_sequences_per_sec"],
        "steady_step_time_s": steady["steady_step_time_s"],
        "e2e_sequences_per_sec": state.sequences / wall if state.step else None,
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
        "final_loss": state.last_loss,
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
