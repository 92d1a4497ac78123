"""The training run: one loop for every objective.

`train(cfg)` starts distribution, builds a `Trainer` for the task's objective (objectives/), and
runs it: restore (if resuming) -> fit (the loop) -> a final checkpoint -> evaluate -> summary.json.
The Trainer knows no task by name: features, head, loss, predictions and metrics are the
objective's; distribution, policies, batch arithmetic, time box, checkpoints and the run directory
are the Trainer's, written once.

Per optimizer step the ranks agree on everything they must (stop request, save request, loss for
the log, non-finite gradients, token counts) through one all-reduce (`dist.Agreement`). Only rank 0
reads the clock and the stop files; decisions about files (which run directory, which checkpoint)
are rank 0's and reach the others by broadcast.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from . import PROCESS_START, __version__, batching, dist, meters, objectives, policies, zoo
from . import plan as planner
from .checkpoint import Checkpoint, CheckpointError, CheckpointManager
from .config import RESUMABLE_CHANGES, RunConfig
from .data.features import epoch_order, global_batches, shard
from .model import batch_flops, load_pretrained, load_state_dict_file, load_weights
from .optim import clip_grad_norm, make_optimizer
from .runfiles import SCHEMA_VERSION, MetricsWriter, write_json_atomic, write_text_atomic
from .stopping import REASONS, StopConditions

# With --lr-horizon time-budget, the decay horizon is first fitted once this many steps have run, from
# the median time of the steps after the first (which pays for lazy initialisation); then fitted again
# after every further 25% of steps (at least REFIT_MIN_STEPS), from the wall time per step since the
# previous fit (evaluations and checkpoints included), so a first guess from two steps cannot end the
# decay early (or late) when the steps speed up (or slow down). Step-based, so every rank refits at
# the same step; the time comes from rank 0's clock.
FIT_HORIZON_AFTER = 3
REFIT_GROWTH, REFIT_MIN_STEPS = 1.25, 10


def log(d: dist.Dist, msg: str) -> None:
    if d.is_main:
        print(f"[hpcbert {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def default_run_dir(cfg: RunConfig) -> Path:
    model = Path(cfg.model).name
    return Path("runs") / f"{cfg.task}-{model}-{cfg.grad_ckpt.replace(':', '')}-{time.strftime('%Y%m%d-%H%M%S')}"


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
    nonfinite_steps: int = 0       # steps whose gradient norm was inf/nan (fp16: skipped by the scaler)
    lr_horizon: int | None = None  # step at which the LR reaches 0 (fitted to the time box, or planned)
    lr_warmup: int | None = None   # LR warm-up steps belonging to that horizon
    lr_horizon_source: str | None = None
    lr_anchor: list | None = None  # [step, LR multiplier] where a refit started the decay anew
    lr_fitted_at: list | None = None  # [step, rank 0's wall clock] of the latest fit
    lr_fits: int = 0               # fits of the horizon so far
    tokens: int = 0                # real (non-pad) training tokens done
    target: dict | None = None     # --target-mlm-accuracy reached: {step, tokens, time_s, value}


@dataclass
class LoopResult:
    stopped_by: str
    first_step_start: float
    last_step_end: float


@dataclass(frozen=True)
class StepRecord:
    """What the host knows of a step when it launches it; completed when its agreement arrives."""
    step: int
    start: float       # perf_counter at its first batch
    sequences: int
    lr: float
    epoch: float
    graphs: int = 0    # graphs torch.compile made while the host ran it (--compile)
    host_s: float = 0.0  # the host's part of the step (a compile in it included)


class LRSchedule:
    """LR multiplier: linear warm-up 0 -> 1 over `warmup` steps, then decay 1 -> 0 at `horizon`:
    (1 - progress) ** power over the steps after the warm-up (power 1: linear; --lr-decay poly
    --poly-power p: HF's polynomial decay with lr_end 0, NVIDIA's BERT LAMB schedule with p = 0.5).
    `refit` moves the horizon (and the warm-up with it), for a schedule fitted to the time box.
    A refit during the decay (`anchor` = (step, multiplier there)) keeps the LR continuous: from
    the anchor on, multiplier x (1 - progress from the anchor to the new horizon) ** power."""

    def __init__(self, warmup: int, horizon: int, power: float = 1.0):
        self.warmup, self.horizon, self.power = warmup, horizon, power
        self.anchor: tuple[int, float] | None = None

    def refit(self, warmup: int, horizon: int, anchor: tuple[int, float] | None = None) -> None:
        self.warmup, self.horizon, self.anchor = warmup, horizon, tuple(anchor) if anchor else None

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.anchor is not None and step >= self.anchor[0]:
            a, m = self.anchor
            return m * max(0.0, (self.horizon - step) / max(1, self.horizon - a)) ** self.power
        return max(0.0, (self.horizon - step) / max(1, self.horizon - self.warmup)) ** self.power


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


def train(cfg: RunConfig) -> dict:
    """Run one training job and return its summary (rank 0 also writes the run directory)."""
    d = dist.init(cfg.threads, cfg.dist_timeout)
    try:
        return Trainer(cfg, d, objectives.get(cfg)).run()
    finally:
        dist.shutdown(d)


class Trainer:
    """One run: distributed state, model + policies, optimizer, schedule, scaler, meters, loop
    position and checkpoints. `run()` = restore -> fit -> save -> evaluate -> summary."""

    def __init__(self, cfg: RunConfig, d: dist.Dist, objective: objectives.Objective):
        self.d, self.obj = d, objective
        objective.check(cfg)  # options the task cannot use fail here, before any file is read
        if cfg.target_mlm_accuracy is not None and objective.main_metric != "mlm_accuracy":
            raise ValueError(f"target_mlm_accuracy: task {cfg.task!r} has no masked-LM accuracy (its main metric is "
                             f"{objective.main_metric}); it is for --task mlm")
        self.src = zoo.resolve(cfg.model, cfg.tokenizer)
        # Files are rank 0's decisions: the run directory (a default one is timestamped) ...
        self.run_dir = Path(dist.decide(d, lambda: str(Path(cfg.out) if cfg.out else default_run_dir(cfg))))
        self.cfg = cfg = cfg.replace(out=str(self.run_dir))
        if "auto" in (cfg.batch_size, cfg.grad_ckpt):  # hpcbert plan, on rank 0, for every rank
            self.cfg = cfg = dist.decide(d, lambda: planner.resolve_auto(cfg, d.device, lambda m: log(d, m), d.world_size))
        # ... and the checkpoint to resume from, checked (sha256 once, on rank 0) before anything is loaded.
        self.ckman = CheckpointManager(self.run_dir / "checkpoints", cfg.keep_last, d.rank, d.world_size,
                                       lambda: dist.barrier(d), lambda item: dist.all_gather_objects(d, item))
        self.resume_from: Checkpoint | None = dist.decide(d, self._find_checkpoint)

        self.train_set, self.dev = self._load_data()
        if (cfg.eval_every or cfg.target_mlm_accuracy is not None) and not self.dev:
            raise ValueError(f"{'eval_every' if cfg.eval_every else 'target_mlm_accuracy'}: evaluates during "
                             f"training, but this run has nothing to evaluate on (--no-do-eval, or no dev split)")
        self.raw = self._build_model()
        self.precision = policies.resolve_precision(cfg.precision, d.device)
        self.tf32 = policies.enable_tf32(self.precision, d.device)
        policies.norm_precision(self.raw, cfg.norm_precision)
        self.ckpt_layers = policies.apply_grad_ckpt(self.raw, cfg.grad_ckpt)

        # Batch arithmetic, stated once (batching.py): global = sum of per-rank batches x accumulation.
        # auto: never more than the rank's share of the training set, so a small model on a large
        # GPU does not probe batches no step of this run could fill
        share = max(1, min(batching.PROBE_LIMIT, len(self.train_set) // d.world_size))
        self.per_rank = batching.per_rank_batches(
            cfg, d, lambda: batching.probe_max_batch(self.raw, self._example_loss, d.device, limit=share),
            lambda m: log(d, m))
        self.plan = batching.plan(cfg, len(self.train_set), self.per_rank)
        log(d, f"{objective.name}: {self.plan.describe(len(self.train_set))}; precision {self.precision}"
               f"{' (TF32 matmuls)' if self.tf32 else ''}{self._norm_note()}; grad_ckpt {cfg.grad_ckpt} (layers {self.ckpt_layers}); "
               f"{d.world_size} process(es) on {d.nodes} node(s), backend {d.backend or 'none'}, "
               f"{d.threads} thread(s) each")

        # Measurements taken before training (part of start-up).
        self.raw.train()
        self.act_bytes = meters.activation_bytes_per_sequence(self.raw, self._example_loss, d.device)
        # The run's peak is rank 0's (its summary's MFU). On CPU another rank measuring one would run
        # its matmuls beside rank 0's measurement, lowering it, and write the machine's peak cache
        # too, racing rank 0 (CI saw rank 1 create the cache's folder).
        self.peak, self.peak_src = (meters.peak_flops(d.device, self.precision) if d.is_main
                                    else (None, "measured by rank 0"))

        # Policies that change how the model runs, applied from outside: DDP, then compile.
        model: nn.Module = self.raw
        if d.active:
            model = dist.data_parallel(model, d)
        self.compiled = policies.resolve_compile(cfg.compile, d.device)
        self.token_multiple = policies.resolve_token_multiple(cfg.token_multiple, d.device, self.precision)
        if self.compiled:
            policies.use_compile_cache(cfg.compile_cache)
        else:
            for flag, value in (("--compile-cache", cfg.compile_cache),
                                ("--compile-mode", cfg.compile_mode if cfg.compile_mode != "default" else None)):
                if value:
                    log(d, f"{flag} {value}: not used, this run does not compile (--compile {cfg.compile})")
        self.model = policies.maybe_compile(model, self.compiled, cfg.compile_mode)
        self.compile_steps: list[dict] = []  # the steps in which torch.compile made graphs (summary)
        # compile steps posted and not yet recorded -> their host seconds; those whose host time an
        # earlier step's interval held, moved to them (`_record`)
        self.compiling: dict[int, float] = {}
        self.compile_moved: dict[int, float] = {}
        self.optimizer = make_optimizer(cfg, self.raw, self.plan.lr, d.device)
        self.schedule = LRSchedule(self.plan.warmup_steps, self.plan.total_steps,
                                   cfg.poly_power if cfg.lr_decay == "poly" else 1.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule)
        self.scaler = policies.grad_scaler(self.precision, d.device)
        self.meter, self.state = meters.StepMeter(), LoopState()
        self.writer: MetricsWriter | None = None
        self.evaluated_at: tuple[int, dict] | None = None  # (step, metrics) of the latest evaluation
        self.data_fp = self.train_set.fingerprint()
        self.last_saved_step: int | None = None
        torch.manual_seed(cfg.seed + 1000 * d.rank)  # dropout differs per rank, as in any DDP run
        if self.resume_from is not None:
            self.restore(self.resume_from)

        # The run can start: only now does its directory appear (a failed start leaves nothing behind).
        if d.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.run_dir / "config.json", cfg.to_dict())
            id2label = objective.hf_config().get("id2label")
            if id2label:  # the class names in index order (a classifier's outputs)
                write_json_atomic(self.run_dir / "labels.json", [id2label[str(i)] for i in range(len(id2label))])
            stale = self.run_dir / "STOP"
            # A stop request older than this process ended an earlier segment: not one for this run.
            # One made since (a job's trap during start-up) stands.
            if stale.exists() and stale.stat().st_mtime < PROCESS_START:
                stale.unlink()
                log(d, f"removed {stale}, the stop request that ended an earlier segment")
        dist.barrier(d)

    # --- start-up pieces ------------------------------------------------------------------------

    def _find_checkpoint(self) -> Checkpoint | None:
        """Rank 0: the checkpoint to resume from (verified), None to start fresh; ValueError otherwise."""
        mode = self.cfg.resume_mode()
        if mode == "never":
            return None
        if mode == "auto":
            ck = self.ckman.latest()
        else:
            path = Path(mode)
            if not path.is_dir():
                raise ValueError(f"resume: {path} does not exist or is not a directory; give a checkpoint "
                                 f"directory (RUN_DIR/checkpoints/step-NNNNNNNN), 'auto' or 'never'")
            ck = self.ckman.verify(path)
        if ck is not None and ck.world_size != self.d.world_size:
            raise CheckpointError(f"{ck.path}: written by {ck.world_size} ranks, this run has {self.d.world_size}; "
                                  f"resume with the same number of processes, or use another --out")
        return ck

    def _load_data(self) -> tuple[objectives.Dataset, dict[str, objectives.Dataset]]:
        """Rank 0 tokenises (or reads the cache) first; the others then read the cache. A bad file
        fails on every rank with rank 0's message, instead of leaving the others at a barrier."""
        loaded: dict = {}

        def first() -> None:
            loaded["data"] = self.obj.load(self.cfg, self.src)

        dist.decide(self.d, first)
        return loaded["data"] if self.d.is_main else self.obj.load(self.cfg, self.src)

    def _build_model(self) -> nn.Module:
        cfg, src, d = self.cfg, self.src, self.d
        mcfg = src.config
        if cfg.dropout is not None:
            mcfg = type(mcfg)(**{**mcfg.to_dict(), "hidden_dropout_prob": cfg.dropout,
                                 "attention_probs_dropout_prob": cfg.dropout})
        if cfg.max_seq_length > mcfg.max_position_embeddings:
            raise ValueError(f"max_seq_length: {cfg.max_seq_length} exceeds the {mcfg.max_position_embeddings} "
                             f"positions of model {cfg.model!r}")
        if src.ignored_config_keys:
            log(d, f"model {cfg.model}: config.json keys not used by this model (ignored): "
                   f"{', '.join(src.ignored_config_keys)}")
        torch.manual_seed(cfg.seed)  # same initial head (and random model) on every rank
        model = self.obj.build_model(mcfg)
        if src.weights_dir is not None:
            rep = load_pretrained(model, src.weights_dir)
            for what, names in (("ignored checkpoint tensors not in the model", rep.unexpected),
                                ("shape mismatch, freshly initialised", rep.mismatched),
                                ("not in the checkpoint, freshly initialised", rep.missing)):
                if names:
                    log(d, f"weights: {what}: {', '.join(names)}")
        else:
            log(d, f"model {cfg.model}: RANDOM weights ({mcfg.num_hidden_layers} layers, {mcfg.hidden_size} wide), "
                   f"for throughput work or training from scratch"
                   + (f"; {src.vocab_note}" if src.vocab_note else ""))
        if cfg.init_from and self.resume_from is None:
            self._init_from(model)
        elif cfg.init_from:
            log(d, f"init_from: not read; resuming from {self.resume_from.path}, this run's own weights")
        return model.to(d.device)

    def _init_from(self, model: nn.Module) -> None:
        """--init-from: the model weights of an earlier run (its final model, else its newest complete
        checkpoint) or of one checkpoint directory, by name; optimizer, LR schedule and loop start
        afresh. Rank 0 chooses (and verifies) the file; every rank reads it."""
        from .export import locate

        def find() -> tuple[str, str]:
            try:
                kind, where = locate(Path(self.cfg.init_from))
                if kind == "checkpoint":
                    CheckpointManager(where.parent).verify(where)
            except ValueError as e:
                raise ValueError(f"init_from: {e}") from None
            return kind, str(where)

        kind, where = dist.decide(self.d, find)
        state = (load_state_dict_file(where) if kind == "model" else
                 torch.load(Path(where) / "shared.pt", map_location="cpu", weights_only=False)["model"])
        rep = load_weights(model, state)
        lacking = [k for k in rep.missing if k.startswith(("bert.embeddings.", "bert.encoder."))]
        if rep.mismatched or lacking:
            raise ValueError(f"init_from: {where} does not hold the encoder of model {self.cfg.model!r} ("
                             + "; ".join(f"{what}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                                         for what, names in (("other shapes", rep.mismatched), ("missing", lacking))
                                         if names)
                             + "); give --model the shape it was trained with")
        log(self.d, f"init_from: model weights of {where} (weights only: optimizer, LR schedule and step start "
                    f"afresh)" + "".join(f"; {what}: {', '.join(names)}" for what, names in (
                        ("ignored, not in this model", rep.unexpected),
                        ("not in it, freshly initialised", rep.missing)) if names))

    @property
    def norm_precision(self) -> str:
        """The LayerNorms' precision as run: --norm-precision under autocast; fp32 in an fp32 run."""
        return "fp32" if self.precision == "fp32" else self.cfg.norm_precision

    def _norm_note(self) -> str:
        if self.precision == "fp32":
            return ""
        return f", LayerNorms in {self.precision if self.norm_precision == 'low' else 'fp32'} (--norm-precision {self.norm_precision})"

    def amp(self):
        """A fresh autocast context for the run's precision."""
        return policies.autocast(self.precision, self.d.device)

    def _example_loss(self, batch_size: int) -> torch.Tensor:
        """Forward + loss of a batch of `batch_size` sequences at --max-seq-length (memory probes)."""
        batch, norm = self.obj.example_batch(batch_size, self.cfg.max_seq_length, self.raw.config.vocab_size)
        batch = batch.to(self.d.device)
        with self.amp():
            return self.obj.loss(self.raw, self.obj.forward(self.raw, batch), batch, norm)

    # --- the run ----------------------------------------------------------------------------------

    def run(self) -> dict:
        cfg, d, st = self.cfg, self.d, self.state
        budget_left = cfg.time_budget - st.elapsed_s if cfg.time_budget else None
        stops = StopConditions.from_env(PROCESS_START + budget_left if budget_left is not None else None,
                                        run_dir=self.run_dir)
        stops.install_signal_handlers()
        writer = MetricsWriter(self.run_dir / "metrics.jsonl") if d.is_main else None
        try:
            result = self.fit(stops, writer)
        finally:
            stops.restore_signal_handlers()  # from here on a SIGTERM ends the process at once
            if writer:
                writer.close()
            self.writer = None
        early = result.stopped_by in ("signal", "stop_file", "job_deadline")
        if (cfg.checkpointing or early or self.resume_from is not None) and st.step and \
                st.step != self.last_saved_step:
            self.save()  # one complete checkpoint at the end of every segment: resubmitting continues here
        if cfg.save_model and not early and d.is_main:
            self.save_model()

        # Evaluation: after the time box; skipped when stopping early (the job's time is up).
        evals = {}
        if cfg.do_eval and self.dev and not early:
            if self.evaluated_at and self.evaluated_at[0] == st.step:
                evals = self.evaluated_at[1]  # evaluated at this very step (--eval-every, target reached)
            else:
                evals = self.evaluate()
                self._evaluated(evals)
        elif early:
            log(d, f"stopped early ({result.stopped_by}) at step {st.step}: run the same command again to resume")
        summary = self.summary(result, evals)
        if d.is_main:
            write_json_atomic(self.run_dir / "summary.json", summary)
            log(d, f"run directory: {self.run_dir}")
        return summary

    def fit(self, stops: StopConditions, writer: MetricsWriter | None) -> LoopResult:
        """The loop: step, agree, record, checkpoint, until the plan is done or a stop is agreed."""
        cfg, d, st = self.cfg, self.d, self.state
        total = self.plan.total_steps
        self.progress = Progress(d, total, cfg.log_every, stops.budget_deadline)
        self.writer, self.stops = writer, stops
        agree = dist.Agreement(d)
        self.lag = agree.lag
        order = lambda epoch: global_batches(  # noqa: E731 - reshuffled per epoch, the same on every rank
            epoch_order(self.train_set.lengths, cfg.sampler, cfg.seed, epoch, self.plan.global_batch),
            self.plan.global_batch)
        batches = order(st.epoch)
        stopped_by = "max_steps" if cfg.max_steps else "epochs"
        self.first_start = time.time()
        self.last_end = self.first_start
        self.last_observed = 0.0
        self.last_save = self.last_eval = time.time()
        # The decision before the first step (a stop file, a budget spent by earlier segments).
        agree.post(None, self._requests())
        stop, _, _ = self._take(agree.ready(flush=True))
        if stop is None and st.target and cfg.target_mlm_accuracy is not None \
                and st.target["value"] >= cfg.target_mlm_accuracy:
            stop = "target"  # resumed after reaching it: nothing left to do
        while stop is None and st.step < total:
            if st.pos == len(batches):
                st.epoch, st.pos = st.epoch + 1, 0
                batches = order(st.epoch)
            t0 = time.perf_counter()
            gb = batches[st.pos]
            graphs = policies.compiled_graphs() if self.compiled else 0
            loss, grad_norm, counts = self.step(gb, st.epoch)
            graphs = policies.compiled_graphs() - graphs if self.compiled else 0
            st.step, st.pos, st.sequences = st.step + 1, st.pos + 1, st.sequences + len(gb)
            rec = StepRecord(st.step, t0, len(gb), self.scheduler.get_last_lr()[0], st.epoch + st.pos / len(batches),
                             graphs, time.perf_counter() - t0)
            if graphs:
                self.compiling[st.step] = rec.host_s
            nonfinite = (~torch.isfinite(grad_norm)).to(torch.float64)
            agree.post(rec, [*self._requests(), *counts], [loss, nonfinite, grad_norm])
            stop, save_due, eval_due = self._take(agree.ready())
            # --eval-every: by steps (deterministic), or by time (rank 0's clock, agreed above).
            eval_due = eval_due or bool(cfg.eval_every_steps and st.step % cfg.eval_every_steps == 0)
            if stop is None and eval_due and self.dev and st.step < total:
                stop, _, _ = self._take(agree.ready(flush=True))  # every finished step recorded (tokens seen)
                if stop is None:
                    stop = self._evaluate_during_training()
            due_by_steps = bool(cfg.checkpoint_steps and st.step % cfg.checkpoint_steps == 0)
            if stop is None and (save_due or due_by_steps) and st.step < total and st.step != self.last_saved_step:
                stop, _, _ = self._take(agree.ready(flush=True))  # the checkpoint holds every finished step
                self.save()
                self.last_save = time.time()
        self._take(agree.ready(flush=True))  # steps still in flight: recorded; their requests come too late
        if stop is not None:
            stopped_by = stop
        self.progress.close()
        if st.window_loss:
            st.last_loss = float(np.mean(st.window_loss))
        return LoopResult(stopped_by, self.first_start, self.last_end)

    def step(self, gb: np.ndarray, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        """One optimizer step on global batch `gb` of `epoch` (this rank's share, in micro-batches).
        Returns the loss and gradient norm as device tensors (no host sync) and this rank's
        token/FLOP counts."""
        cfg, d = self.cfg, self.d
        micro = shard(gb, self.per_rank, d.rank, cfg.grad_accum)
        norm = self.obj.norm(self.train_set, gb, epoch)  # the global batch's normalisers, same on every rank
        pad_to = cfg.max_seq_length if cfg.pad_to_max_length else None
        loss_acc = torch.zeros((), device=d.device)
        real_tokens = padded = 0
        flops = 0.0
        for j, idx in enumerate(micro):
            # A short last batch can leave this rank no example; it must still join DDP's
            # all-reduce, so it runs one example with weight 0 (zero gradient, not counted).
            weight = 1.0 if len(idx) else 0.0
            batch = self.obj.collate(self.train_set, idx if len(idx) else gb[:1], pad_to, epoch).to(
                d.device, self.token_multiple, always_index=self.compiled, own_storage=self.compiled)
            B, T = batch.input_ids.shape
            if weight:
                real_tokens += batch.real_tokens
                padded += B * T
                lengths = batch.lengths if batch.lengths is not None else [T] * B
                flops += (batch_flops(self.raw.config, lengths, self.obj.head_rows(batch))
                          + self.obj.head_flops(batch, self.raw.config))
            # Gradients are all-reduced only on the last micro-batch of the step.
            sync = contextlib.nullcontext() if (not d.active or j == len(micro) - 1) else self.model.no_sync()
            with sync:
                with self.amp():
                    out = self.obj.forward(self.model, batch)
                    # This micro-batch's share of the global batch's loss, x world size because DDP
                    # averages gradients over ranks: the gradient is that of one big batch.
                    loss = self.obj.loss(self.raw, out, batch, norm) * (weight * d.world_size)
                self.scaler.scale(loss).backward()
            loss_acc += loss.detach()
            # The graph goes now, not when these names are next assigned: what its nodes hold
            # outside their saved tensors (a checkpointed layer's kept output, K and V, mask bits)
            # would stay through the next micro-batch's forward and the optimizer step
            del out, loss
        self.scaler.unscale_(self.optimizer)
        grad_norm = clip_grad_norm(self.raw.parameters(), cfg.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_acc, grad_norm, [float(real_tokens), float(padded), flops]

    def _requests(self) -> list[float]:
        """This rank's part of the agreement: [stop code, signal, save request, evaluation request].
        Stop code and requests are rank 0's alone (its clock and its view of the stop files)."""
        d, cfg = self.d, self.cfg
        signal = 1.0 if self.stops.signal_received is not None else 0.0
        if not d.is_main:
            return [0.0, signal, 0.0, 0.0]
        est = float(np.median(self.meter.times[-5:])) if len(self.meter) else 0.0
        # With a lag, one more step is already in flight when the others read the decision.
        reason = self.stops.reason(est * (1 + self.lag))
        due = bool(cfg.checkpoint_every and time.time() - self.last_save >= cfg.checkpoint_every)
        eval_due = bool(cfg.eval_every_seconds and time.time() - self.last_eval >= cfg.eval_every_seconds)
        return [float(REASONS.index(reason)), signal, 1.0 if due else 0.0, 1.0 if eval_due else 0.0]

    def _take(self, results: list) -> tuple[str | None, bool, bool]:
        """Record finished steps; return the agreed stop reason (or None), save and evaluation requests."""
        stop, save, evaluate = None, False, False
        for rec, values in results:
            code, signal, save_flag, eval_flag = values[:4]
            if rec is not None:
                self._record(rec, values[4:])
            if signal > 0:
                stop = "signal"
            elif code > 0 and stop is None:
                stop = REASONS[int(round(code))]
            save = save or save_flag > 0
            evaluate = evaluate or eval_flag > 0
        return stop, save, evaluate

    def _record(self, rec: StepRecord, values: list[float]) -> None:
        """A finished step's agreed figures: meter, log line, progress, time-fitted LR horizon."""
        d, st, cfg = self.d, self.state, self.cfg
        tokens, padded, flops, loss, nonfinite, grad_norm = values
        now = time.perf_counter()
        # From its start, or from the previous step's end when steps overlap on the device (lag).
        seconds = now - max(rec.start, self.last_observed)
        self.last_observed = now
        # Read `lag` steps late, this interval also holds the host part of the steps posted since. A
        # compile there (tens of seconds) is moved to the step that compiled, whose own interval
        # begins after it.
        for later, host_s in self.compiling.items():
            if later > rec.step and later not in self.compile_moved:
                self.compile_moved[later] = host_s
                seconds -= host_s
        seconds = max(seconds, 1e-6) + self.compile_moved.pop(rec.step, 0.0)
        self.compiling.pop(rec.step, None)
        end = self.last_end = time.time()
        deadline = self.stops.budget_deadline
        self.meter.add(seconds, rec.sequences, int(tokens), int(padded), flops, end,
                       in_budget=deadline is None or end <= deadline, compiled=bool(rec.graphs))
        if rec.graphs:  # a compile (or a recompile) inside this step: left out of the steady figures
            self.compile_steps.append({"step": rec.step, "graphs": rec.graphs, "step_s": round(seconds, 3),
                                       "host_s": round(rec.host_s, 3)})
            log(d, f"step {rec.step}: torch.compile made {rec.graphs} graph(s) in this step, which took "
                   f"{seconds:.1f} s ({rec.host_s:.1f} s on the host)")
        loss, grad_norm = loss / d.world_size, grad_norm / d.world_size
        st.tokens += int(tokens)
        st.window_loss.append(loss)
        if nonfinite:
            st.nonfinite_steps += 1
        self.progress.update(rec.step, loss, rec.sequences / seconds, end - self.first_start)
        if rec.step % cfg.log_every == 0 or rec.step == self.plan.total_steps:
            n = len(st.window_loss)
            st.last_loss = float(np.mean(st.window_loss))
            if self.writer:
                wt = sum(self.meter.times[-n:])
                self.writer.write({"step": rec.step, "epoch": rec.epoch, "loss": st.last_loss, "lr": rec.lr,
                                   "grad_norm": grad_norm, "step_time_s": wt / n,
                                   "sequences_per_sec": sum(self.meter.sequences[-n:]) / wt,
                                   "tokens_per_sec": sum(self.meter.tokens[-n:]) / wt,
                                   "elapsed_s": end - PROCESS_START})
            st.window_loss = []
        if cfg.lr_horizon == "time-budget" and rec.step >= FIT_HORIZON_AFTER and (
                st.lr_fitted_at is None
                or rec.step >= st.lr_fitted_at[0] + max(REFIT_MIN_STEPS, round((REFIT_GROWTH - 1) * st.lr_fitted_at[0]))):
            self._fit_horizon(rec.step)

    def _fit_horizon(self, step: int) -> None:
        """--lr-horizon time-budget: the decay reaches zero at the last step predicted to fit in the
        box (rank 0's clock; broadcast). First from the median step time, then from the wall time
        per step since the previous fit. `step` = the step just recorded (the LR of the next one
        is the first to change)."""
        st, cfg = self.state, self.cfg
        prev = st.lr_fitted_at

        def estimate() -> tuple[int, str, float]:
            now = time.time()
            if prev is None:
                t, how = float(np.median(self.meter.times[1:])), f"median {{:.3f}} s/step (steps 2..{len(self.meter)})"
            else:
                t, how = (now - prev[1]) / (step - prev[0]), f"{{:.3f}} s/step over steps {prev[0] + 1}..{step}"
            left = self.stops.budget_deadline - now
            horizon = max(step + 1, min(self.plan.total_steps, step + max(0, int(left / t))))
            return horizon, f"time budget: {left:.0f} s left after step {step} at {how.format(t)}", now

        horizon, source, now = dist.decide(self.d, estimate)
        if prev is None:
            st.lr_warmup = min(self.plan.warmup_steps, max(round(cfg.warmup_ratio * horizon), 0))
        # The multiplier in effect now (the scheduler has stepped once per optimizer step, possibly a
        # step or two past `step`) starts the decay to the new horizon: the LR stays continuous.
        at = self.scheduler.last_epoch
        anchor = [at, self.schedule(at)] if prev is not None and at >= st.lr_warmup else None
        moved = horizon != st.lr_horizon
        st.lr_horizon, st.lr_fitted_at, st.lr_fits = horizon, [step, now], st.lr_fits + 1
        if moved:
            st.lr_anchor = anchor if anchor is not None else st.lr_anchor
            st.lr_horizon_source = source + f" (fit {st.lr_fits})"
            self.schedule.refit(st.lr_warmup, horizon, st.lr_anchor)
            if prev is None:
                log(self.d, f"LR schedule fitted to the time box: decay to 0 at step {horizon}, {st.lr_warmup} LR "
                            f"warm-up steps ({source})")

    # --- checkpoints ------------------------------------------------------------------------------

    def save(self) -> None:
        t = time.perf_counter()
        st = self.state
        shared = {"model": self.raw.state_dict(), "optimizer": self.optimizer.state_dict(),
                  "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                  "meter": asdict(self.meter), "config": self.cfg.to_dict(), "data": self.data_fp,
                  "loop": {**asdict(st), "elapsed_s": st.elapsed_s + time.time() - PROCESS_START},
                  "model_config": self.raw.config.to_dict(), "hf_config": self.obj.hf_config()}  # for export
        mine = {"rng_cpu": torch.get_rng_state(),
                "rng_cuda": torch.cuda.get_rng_state(self.d.device) if self.d.device.type == "cuda" else None}
        path = self.ckman.save(st.step, shared, mine)
        self.last_saved_step = st.step
        log(self.d, f"checkpoint {path} ({time.perf_counter() - t:.1f}s)")

    def save_model(self) -> None:
        """Rank 0: the final weights as a Hugging Face directory, RUN_DIR/model (export.py's layout):
        `hpcbert train --model RUN_DIR/model` fine-tunes it, `hpcbert export` copies it."""
        from .export import FINAL_MODEL, write_hf_dir

        t = time.perf_counter()
        try:
            path = write_hf_dir(self.run_dir / FINAL_MODEL, self.raw, self.obj.hf_config(),
                                self.cfg.tokenizer or self.src.vocab_dir, self.state.step)
        except OSError as e:  # disk full, quota: one line, like a checkpoint that cannot be written
            raise ValueError(f"{self.run_dir / FINAL_MODEL}: final model not saved: {e.strerror or e}") from None
        log(self.d, f"final model {path} ({time.perf_counter() - t:.1f}s)")

    def restore(self, ck: Checkpoint) -> None:
        cfg, st = self.cfg, self.state
        shared, mine = self.ckman.load(ck, map_location=self.d.device)
        changed = sorted(k for k, v in shared["config"].items()
                         if k not in RESUMABLE_CHANGES and getattr(cfg, k, None) != v)
        if changed:
            detail = ", ".join(f"{k} (checkpoint {shared['config'][k]!r}, now {getattr(cfg, k, None)!r})"
                               for k in changed)
            raise ValueError(f"resume: {ck.path} was written with other settings: {detail}; "
                             f"use another --out or --resume never")
        if "norm_precision" not in shared["config"] and self.precision != "fp32" and cfg.norm_precision != "fp32":
            # hpcbert before --norm-precision: autocast's rule, fp32 LayerNorms; a run continues as it began
            raise ValueError(f"resume: {ck.path} was written before --norm-precision, by a run whose LayerNorms "
                             f"were fp32; resume it with --norm-precision fp32, or use another --out or --resume never")
        if shared["data"] != self.data_fp:
            raise ValueError(f"resume: {ck.path} was trained on other token ids (vocabulary or training data "
                             f"changed); use another --out or --resume never")
        self.raw.load_state_dict(shared["model"])
        self.optimizer.load_state_dict(shared["optimizer"])
        self.scheduler.load_state_dict(shared["scheduler"])
        self.scaler.load_state_dict(shared["scaler"])
        for k, v in shared["meter"].items():
            setattr(self.meter, k, list(v))
        if len(self.meter.compiled) < len(self.meter):  # a checkpoint from before the meter kept it
            self.meter.compiled = [False] * len(self.meter)
        for k, v in shared["loop"].items():
            setattr(st, k, v)
        st.resumed_from_step = ck.step
        if st.lr_horizon is not None:
            self.schedule.refit(st.lr_warmup, st.lr_horizon, st.lr_anchor)
            # The next refit measures this segment's steps, not the time between the segments.
            st.lr_fitted_at = [st.step, time.time()]
        self.last_saved_step = ck.step
        torch.set_rng_state(mine["rng_cpu"].cpu())
        if mine.get("rng_cuda") is not None:
            torch.cuda.set_rng_state(mine["rng_cuda"].cpu(), self.d.device)
        log(self.d, f"resumed from {ck.path} (step {st.step}, epoch {st.epoch}, batch {st.pos})")
        if self.d.is_main:
            _truncate_metrics(self.run_dir / "metrics.jsonl", st.step)

    # --- evaluation and summary ------------------------------------------------------------------

    def _evaluate_during_training(self) -> str | None:
        """--eval-every: evaluate now (every rank) and record it; "target" when it reached the target."""
        evals = self.evaluate()
        self.last_eval = time.time()
        return "target" if self._evaluated(evals) else None

    def _evaluated(self, evals: dict[str, dict[str, float]]) -> bool:
        """Record an evaluation of the current step: with --eval-every a metrics.jsonl line (rank 0;
        "loss" is null, the training loss being the other lines'), and the first time the main metric
        reaches --target-mlm-accuracy, where (the summary's time, steps and tokens to target).
        Returns whether the target is reached; every rank decides alike (the metrics are gathered)."""
        st, cfg, now = self.state, self.cfg, time.time()
        self.evaluated_at = (st.step, evals)
        if self.d.is_main and (cfg.eval_every or cfg.target_mlm_accuracy is not None):
            writer = self.writer or MetricsWriter(self.run_dir / "metrics.jsonl")
            writer.write({"step": st.step, "epoch": st.epoch + st.pos / self.plan.steps_per_epoch, "loss": None,
                          "eval": evals, "tokens_seen": st.tokens, "sequences_seen": st.sequences,
                          "elapsed_s": now - PROCESS_START, "run_time_s": st.elapsed_s + now - PROCESS_START})
            if writer is not self.writer:
                writer.close()
        target, main = cfg.target_mlm_accuracy, self.obj.main_metric
        if target is None:
            return False
        value = next((m[main] for m in evals.values() if main in m), None)
        if st.target is None and value is not None and value >= target:
            st.target = {"step": st.step, "tokens": st.tokens, "time_s": st.elapsed_s + now - PROCESS_START,
                         "value": value}
            log(self.d, f"target {main} {target} reached at step {st.step}: {value:.4f} after {st.tokens:,} tokens, "
                        f"{st.target['time_s']:.1f} s from the start of the run")
        return st.target is not None

    @torch.no_grad()
    def evaluate(self) -> dict[str, dict[str, float]]:
        """Score every dev/test example exactly once across ranks (rank r takes r, r+W, ... of the
        length-sorted order: no padding duplicates). The objective turns the predictions, put back
        in dataset order, into metrics and files; rank 0 writes the files into the run directory."""
        d, obj, cfg = self.d, self.obj, self.cfg
        self.raw.eval()
        out: dict[str, dict[str, float]] = {}
        for split, data in self.dev.items():
            order = np.argsort(-data.lengths, kind="stable")  # least padding; same result
            mine = order[d.rank::d.world_size]
            preds: list[dict[str, np.ndarray]] = []
            for i in range(0, len(mine), cfg.eval_batch_size):
                batch = obj.collate(data, mine[i:i + cfg.eval_batch_size]).to(d.device, self.token_multiple)
                with self.amp():
                    outputs = obj.forward(self.raw, batch)
                # the outputs go with predict's return, not with the next batch's forward
                preds.append(objectives.to_host(obj.predict(outputs, batch)))
                del outputs
            gathered = dist.all_gather_objects(d, (mine, preds))
            idx = np.concatenate([g[0] for g in gathered])
            assert len(idx) == len(data) and len(np.unique(idx)) == len(data), "every dev example exactly once"
            batches = [p for g in gathered for p in g[1]]  # a rank may have had no example
            ordered = {}
            for name in batches[0]:
                rows = np.concatenate([p[name] for p in batches])
                ordered[name] = np.empty_like(rows)
                ordered[name][idx] = rows
            result = obj.evaluate(split, ordered, data)
            if d.is_main:
                for name, text in result.files.items():
                    write_text_atomic(self.run_dir / name, text)
            if result.metrics:  # an unlabelled split gives files only
                out[split] = result.metrics
            log(d, f"eval {split}: " + (", ".join(f"{k} {v:.4f}" for k, v in result.metrics.items()) or "no labels")
                   + (f"; wrote {', '.join(result.files)}" if result.files else ""))
        self.raw.train()
        return out

    def summary(self, result: LoopResult, evals: dict) -> dict:
        cfg, d, st, meter = self.cfg, self.d, self.state, self.meter
        mcfg = self.raw.config
        warmup = cfg.warmup_steps_excluded if cfg.warmup_steps_excluded is not None else meter.default_warmup(len(meter))
        warmup = min(warmup, max(0, len(meter) - 1))
        steady = meter.steady(warmup)
        mem, mem_kind = meters.peak_memory(d.device)
        in_budget = None
        if cfg.time_budget is not None:
            done = [i for i, inside in enumerate(meter.in_budget) if inside]
            in_budget = (len(done), sum(meter.sequences[i] for i in done))
        wall = st.elapsed_s + (result.last_step_end - PROCESS_START)  # all segments, from process start
        peak, peak_src = self.peak, self.peak_src
        mfu = steady["model_flops_per_sec"] / peak if (peak and steady["model_flops_per_sec"]) else None
        if mfu is not None and mfu > 1:
            # The run itself beat the measured "peak": other work slowed that measurement. No MFU
            # rather than a wrong one.
            peak_src += "; below the achieved model FLOP/s (machine busy while measuring): MFU withheld"
            mfu = None
        per_rank = self.per_rank
        return {
            "schema_version": SCHEMA_VERSION,
            "hpcbert_version": __version__,
            "run": self.run_dir.name,
            "task": self.obj.name,
            "model": cfg.model,
            "model_is_random": self.src.is_random,
            "num_layers": mcfg.num_hidden_layers,
            "hidden_size": mcfg.hidden_size,
            "max_seq_length": cfg.max_seq_length,
            "precision": self.precision,
            "tf32": self.tf32,
            "norm_precision": self.norm_precision,
            "host_allocator": d.host_allocator,
            "compile": self.compiled,
            "compile_steps": self.compile_steps if self.compiled else None,
            "compile_cache": policies.compile_cache_use() if self.compiled else None,
            "token_multiple": self.token_multiple,
            "grad_ckpt": cfg.grad_ckpt,
            "ckpt_layers": self.ckpt_layers,
            "optimizer": cfg.optimizer,
            "lr": self.plan.lr,
            "lr_scaling": cfg.lr_scaling,
            "lr_horizon_steps": st.lr_horizon if st.lr_horizon is not None else self.plan.total_steps,
            "lr_horizon_source": st.lr_horizon_source or "planned steps (--epochs / --max-steps)",
            "seed": cfg.seed,
            "world_size": d.world_size,
            "nodes": d.nodes,
            "gpus_per_node": d.local_world_size,
            "dist_backend": d.backend,
            "per_device_batch_size": per_rank[0] if len(set(per_rank)) == 1 else per_rank,
            "grad_accum": cfg.grad_accum,
            "global_batch_size": self.plan.global_batch,
            "steps": st.step,
            "epochs_done": st.sequences / len(self.train_set),
            "sequences": st.sequences,
            "resumed_from_step": st.resumed_from_step,
            "nonfinite_grad_steps": st.nonfinite_steps,
            "startup_s": result.first_step_start - PROCESS_START,
            "train_s": result.last_step_end - result.first_step_start,
            "warmup_steps_excluded": warmup,
            "steady_steps_per_sec": steady["steady_steps_per_sec"],
            "steady_sequences_per_sec": steady["steady_sequences_per_sec"],
            "steady_step_time_s": steady["steady_step_time_s"],
            "e2e_sequences_per_sec": st.sequences / wall if st.step else None,
            "tokens_per_sec": steady["tokens_per_sec"],
            "padded_tokens_per_sec": steady["padded_tokens_per_sec"],
            "throughput_method": (f"summed step times of steps {warmup + 1}..{len(meter)} (the first {warmup} "
                                  f"excluded from timing{self._compiles_left_out(warmup)}); a step runs from its first "
                                  f"batch to the end of the optimizer step, so evaluation, checkpoint and logging time is "
                                  f"excluded"),
            "time_budget_s": cfg.time_budget,
            "steps_in_budget": in_budget[0] if in_budget else None,
            "sequences_in_budget": in_budget[1] if in_budget else None,
            "stopped_by": result.stopped_by,
            "activation_bytes_per_sequence": self.act_bytes,
            "peak_memory_bytes": mem,
            "peak_memory_kind": mem_kind,
            "model_flops_per_sec": steady["model_flops_per_sec"],
            "peak_flops": peak,
            "peak_flops_source": peak_src,
            "mfu": mfu,
            "final_loss": st.last_loss,
            "time_to_target_s": st.target["time_s"] if st.target else None,
            "steps_to_target": st.target["step"] if st.target else None,
            "tokens_to_target": st.target["tokens"] if st.target else None,
            "eval": evals,
            "main_metric": self.obj.main_metric,
            "per_rank_step_time_s": self._per_rank_step_times(warmup),
            "versions": meters.versions(),
            "hardware": meters.hardware(d.device),
            "git_commit": meters.git_commit(),
        }

    def _compiles_left_out(self, warmup: int) -> str:
        """', and step 16, in which torch.compile compiled' for compile steps among the timed ones."""
        late = [str(i + 1) for i in sorted(set(range(warmup, len(self.meter))) - set(self.meter.timed(warmup)))]
        return f", and step{'s' if len(late) > 1 else ''} {', '.join(late)}, in which torch.compile compiled" \
            if late else ""

    def _per_rank_step_times(self, warmup: int) -> dict | None:
        """Median steady step time of every rank, gathered: a slow GPU or node shows up here."""
        t = [self.meter.times[i] for i in self.meter.timed(warmup)]
        values = dist.all_gather_floats(self.d, float(np.median(t)) if t else float("nan"))
        if not t:
            return None
        return {"min": min(values), "median": float(np.median(values)), "max": max(values),
                "slowest_rank": int(np.argmax(values)), "per_rank": values}


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines the interrupted segment wrote after the checkpoint we resume from."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)
