"""Typed run configuration: one source of truth for every option of `hpcbert train` and `bench`.

Every field has a docstring (the text after it) which is also the CLI help. Validation happens on
construction and names the field and the accepted values. The resolved config is saved as
`config.json` in the run directory and can be read back with `RunConfig.from_dict`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, fields
from typing import Any

GRAD_CKPT_HELP = ("none | alternate (every second layer reruns its attention; the others as selective) | all | "
                  "every:K (every K-th layer recomputed) | selective (every "
                  "layer recomputes its GELU outputs and the LayerNorm outputs a matmul reads, keeps the rest) "
                  "| offload (CUDA: saved "
                  "activations wait in pinned host memory) | auto (hpcbert plan's fastest that fits)")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
NORM_PRECISIONS = ("low", "fp32")
OPTIMIZERS = ("adamw", "lamb")
SAMPLERS = ("random", "length-grouped", "sequential")
LR_SCALINGS = ("none", "linear", "sqrt")
LR_HORIZONS = ("steps", "time-budget")
LR_DECAYS = ("linear", "poly")
FILE_FORMATS = ("csv", "tsv", "jsonl")
SQUAD_VERSIONS = ("auto", "1.1", "2.0")


def parse_duration(text: str | float | int | None, what: str = "duration") -> float | None:
    """'20m', '1h30m', '90s', '1200', '00:20:00' -> seconds. None/'' -> None."""
    if text is None or text == "":
        return None
    if isinstance(text, (int, float)):
        if text <= 0:
            raise ValueError(f"{what}: must be positive, got {text}")
        return float(text)
    s = str(text).strip()
    if re.fullmatch(r"\d+(\.\d+)?", s):
        value = float(s)
    elif re.fullmatch(r"\d+:\d{1,2}:\d{1,2}", s):
        h, m, sec = (int(x) for x in s.split(":"))
        value = float(h * 3600 + m * 60 + sec)
    else:
        parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", s)
        if not parts or "".join(n + u for n, u in parts) != s:
            raise ValueError(
                f"{what}: cannot read {text!r}; accepted: seconds ('1200'), units ('20m', '1h30m', "
                f"'90s') or HH:MM:SS ('00:20:00')"
            )
        value = sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)
    if value <= 0:
        raise ValueError(f"{what}: must be positive, got {text!r}")
    return value


def parse_grad_ckpt(policy: str) -> str:
    """Validate a checkpointing policy string; returns it normalised."""
    p = policy.strip().lower()
    if p in ("none", "alternate", "all", "selective", "offload", "auto"):
        return p
    m = re.fullmatch(r"every:(\d+)", p)
    if m and int(m.group(1)) >= 1:
        return f"every:{int(m.group(1))}"
    raise ValueError(f"grad_ckpt: unknown policy {policy!r}; accepted: {GRAD_CKPT_HELP}")


def parse_batch_size(value: int | str) -> int | str:
    """32, '32' -> 32; 'auto' -> 'auto' (the planner's batch); anything else is refused."""
    s = str(value).strip().lower()
    if s == "auto":
        return "auto"
    if isinstance(value, bool) or not re.fullmatch(r"\d+", s) or int(s) < 1:
        raise ValueError(f"batch_size: {value!r} is not accepted; give an integer >= 1 or 'auto'")
    return int(s)


COMPILE_MODES = ("auto", "on", "off")
# torch.compile's modes offered by --compile-mode. Those that capture CUDA graphs (reduce-overhead,
# max-autotune) are not: batches change shape from step to step (dynamic, unpadded), so a graph
# would be recorded per shape, and the loop reads a step's loss after the next step has started,
# when a graph's replay has overwritten its outputs.
TORCH_COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def parse_compile(value: str | bool) -> str:
    """'auto' | 'on' | 'off'; true/false (config.json of runs before --compile auto) -> on/off."""
    if isinstance(value, bool):
        return "on" if value else "off"
    s = str(value).strip().lower()
    s = {"true": "on", "false": "off"}.get(s, s)
    _choice("compile", s, COMPILE_MODES)
    return s


def parse_per_rank_batch(text: str | None) -> list[int] | str | None:
    """'32,32,16,16' -> [32, 32, 16, 16]; 'auto' -> 'auto'; None/'' -> None (use --batch-size)."""
    if text is None or str(text).strip() == "":
        return None
    s = str(text).strip().lower()
    if s == "auto":
        return "auto"
    parts = [p.strip() for p in s.split(",")]
    if not all(re.fullmatch(r"\d+", p) for p in parts) or any(int(p) < 1 for p in parts):
        raise ValueError(f"per_rank_batch: cannot read {text!r}; accepted: 'auto' or one integer >= 1 per "
                         f"global rank, comma-separated ('32,32,16,16')")
    return [int(p) for p in parts]


def format_per_rank_batch(value: list[int] | str | None) -> str | None:
    return ",".join(map(str, value)) if isinstance(value, list) else value


def _choice(name: str, value: str, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ValueError(f"{name}: {value!r} is not accepted; choose one of {', '.join(accepted)}")


@dataclass
class RunConfig:
    """Everything that defines a training run. Field docstrings double as CLI help."""

    # --- what to train ---
    task: str = "synthetic"
    """What to train: a GLUE task (cola, sst-2, mrpc, sts-b, qqp, mnli, qnli, rte, wnli), squad (--train-file/--dev-file), classify (your own CSV/TSV/JSONL files), mlm (masked-LM pre-training on the output of hpcbert prepare-pretraining) or synthetic (no files needed)."""
    data_dir: str | None = None
    """GLUE tasks: the GLUE directory (the GLUE_DIR layout: one sub-folder per task). mlm: the prepared pre-training data (hpcbert prepare-pretraining --out)."""
    train_file: str | None = None
    """squad: a SQuAD JSON file (v1.1, or v2.0 with is_impossible). classify: a CSV, TSV or JSON Lines file with a header (one object per line for JSONL)."""
    dev_file: str | None = None
    """squad / classify: the evaluation file, in the training file's format."""
    test_file: str | None = None
    """classify: a file to predict (labels not needed); the predictions are written to RUN_DIR/predictions.tsv."""
    text_fields: str | None = None
    """classify: the text column, or two comma-separated columns for sentence pairs ('question,sentence')."""
    label_field: str = "label"
    """classify: the label column."""
    format: str | None = None
    """classify: csv, tsv or jsonl (default: from the file extension: .csv, .tsv, .jsonl / .ndjson)."""
    regression: bool = False
    """classify: the labels are numbers (one output, MSE loss, Pearson and Spearman) instead of classes."""
    model: str = "minilm-l6"
    """Named model (minilm-l6 pretrained; bert-tiny, bert-mini, bert-small, bert-medium, bert-base, bert-large random init) or a Hugging Face-format directory (with config.json but no weights: that shape, random init)."""
    tokenizer: str | None = None
    """Tokenizer directory or file (vocab.txt / tokenizer.json). Default: the model's own, or minilm-l6's uncased vocabulary for random models. A random model's word embeddings are sized to this vocabulary."""
    max_seq_length: int = 128
    """Longest tokenised sequence; longer inputs are truncated (longest first)."""

    # --- batch arithmetic: global = per-device x accumulation x world size ---
    batch_size: int | str = 32
    """Per-device micro-batch size (sequences per forward pass on one device), or auto: hpcbert plan's batch for this device's free memory at --max-seq-length and --grad-ckpt (the smallest within 2% of the predicted throughput of the largest that fits)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    per_rank_batch: str | None = None
    """Mixed GPU types: micro-batch per global rank, one entry per rank ('32,32,16,16'), or 'auto' (each rank probes the largest batch that fits its GPU at the chosen --grad-ckpt, then all agree). Replaces --batch-size; each rank's data share is proportional to its batch."""
    eval_batch_size: int = 64
    """Per-device batch size for evaluation."""

    # --- optimisation ---
    optimizer: str = "adamw"
    """adamw (PyTorch's fused kernel on CUDA, and on CPU from torch 2.4) or lamb."""
    lr: float = 2e-5
    """Peak learning rate (before --lr-scaling)."""
    lr_scaling: str = "none"
    """Scale the learning rate with world size: none, linear or sqrt."""
    weight_decay: float = 0.01
    """Decoupled weight decay (not applied to biases and LayerNorm weights)."""
    warmup_ratio: float = 0.1
    """Fraction of optimizer steps of linear warm-up, followed by linear decay to zero."""
    lr_decay: str = "linear"
    """After warm-up: linear decay to zero, or poly ((1 - progress) ** --poly-power, as BERT's LAMB pre-training)."""
    poly_power: float = 1.0
    """Power of --lr-decay poly (1.0 is linear; NVIDIA's BERT pre-training uses 0.5)."""
    lr_horizon: str = "steps"
    """Where the linear LR decay reaches zero: steps (the planned --epochs / --max-steps) or time-budget (the last step predicted to fit in --time-budget, from the step time measured over the first steps; recorded in the summary). A run cut by its time box should use time-budget, or it is evaluated near its peak LR."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    epochs: float = 3.0
    """Training epochs (ignored when --max-steps is given)."""
    max_steps: int | None = None
    """Optimizer steps to run; overrides --epochs."""
    time_budget: float | None = None
    """Wall-clock budget counted from process start ('20m', '1h', seconds). Training stops before it runs out."""
    seed: int = 42
    """Seed for initialisation, dropout and data order."""

    # --- policies applied from outside the model ---
    precision: str = "auto"
    """auto (bf16 where the device has native bf16, else fp32), fp32, bf16 (autocast) or fp16 (autocast + loss scaler)."""
    norm_precision: str = "low"
    """Under bf16/fp16: low (every LayerNorm takes and returns the autocast dtype, and so does the residual stream its outputs are: MosaicML Composer's LowPrecisionLayerNorm, as MosaicBERT trains; no fp32 casts around each LayerNorm, half the bytes in the residual sums, LayerNorms and the tensors they save; the kernel still normalises in fp32) or fp32 (autocast's own rule, as Hugging Face's BERT runs: LayerNorms and the residual stream in fp32). No effect at fp32."""
    grad_ckpt: str = "none"
    """Gradient checkpointing policy: none, alternate (every second layer reruns its attention in backward, the others keep what selective keeps), all, every:K, selective (every layer keeps what none keeps but its GELU outputs and the LayerNorm outputs a matmul reads, which backward recomputes: no matmul, attention or dropout draw runs again), offload (CUDA: saved activations wait in pinned host memory), or auto (hpcbert plan's fastest policy that fits this device's free memory)."""
    compile: str = "auto"
    """torch.compile the model: on, off, or auto (on where it was measured faster and exact: see policies.COMPILE_AUTO). --compile alone is on; config.json files of older runs with true/false read as on/off."""
    compile_mode: str = "default"
    """Under torch.compile, its mode: default, or max-autotune-no-cudagraphs (inductor times several kernels for each matmul and fused operation and keeps the fastest: minutes more to compile, for a faster step on some GPUs). The CUDA-graph modes (reduce-overhead, max-autotune) are not offered: batches change shape from step to step."""
    compile_cache: str | None = None
    """Under torch.compile: the folder where it keeps what it compiled (TORCHINDUCTOR_CACHE_DIR: graphs, kernels), so that a later run of the same model and shapes compiles from it in a fraction of the time (bert-tiny's first step on the 2-core CPU machine: 16.6 s cold, 3.4 s from the cache); on a shared file system, also a job on another node. Default: torch's own, a folder under the node's /tmp (TORCHINDUCTOR_CACHE_DIR where it is set). The summary's compile_cache says what came from it."""
    token_multiple: int | None = None
    """Round a padded batch's real-token count up to a multiple of N with filler rows that no head reads (at most N - 1 a micro-batch), so that the token-wise matmuls meet a few shapes again and again instead of a new one at nearly every step: on CUDA, cuBLAS picks a kernel for every new shape on the host (benchmarks/gpu.py hostcost). Default (policies.TOKEN_MULTIPLE_AUTO): 32 on CPU under bf16/fp16 (oneDNN builds a matmul per new shape: 1.027-1.055x measured), 64 on a GPU under bf16/fp16 (2-5% faster measured on an H200), else 1 (no filler). Losses and gradients are those without filler (dropout draws differ: filler rows draw too)."""
    dropout: float | None = None
    """Override the model's dropout probabilities (hidden and attention)."""
    init_from: str | None = None
    """Start from the model weights of an earlier run: its run directory (its final weights, else its newest complete checkpoint) or one checkpoint directory. Weights only: optimizer, LR schedule and step start afresh (pre-training phase 2 from phase 1; fine-tuning from pre-training). Not --resume."""

    # --- SQuAD ---
    doc_stride: int = 128
    """squad: tokens between the starts of consecutive windows over a long context."""
    max_query_length: int = 64
    """squad: question tokens kept (longer questions are truncated)."""
    n_best_size: int = 20
    """squad: start and end candidates per window, and answers kept per question in nbest_predictions.json."""
    max_answer_length: int = 30
    """squad: longest answer span predicted, in tokens."""
    null_score_diff_threshold: float = 0.0
    """squad v2.0: predict no answer when the null score beats the best span by more than this."""
    squad_version: str = "auto"
    """squad: 1.1, 2.0 or auto (the version of --train-file); a 1.1 run given a 2.0 file is refused, naming the file."""

    # --- masked-LM pre-training ---
    mask_prob: float = 0.15
    """mlm: fraction of tokens selected for prediction (of those, 80% become [MASK], 10% a random token, 10% stay)."""
    whole_word_masking: bool = False
    """mlm: select whole words (a word and all its ## pieces) instead of single tokens."""
    nsp: bool = False
    """mlm: BERT's sentence pairs with the next-sentence-prediction head and loss (50% random next segment) instead of packed full sentences."""
    eval_data: str | None = None
    """mlm: evaluate on the held-out documents of another prepared corpus instead of this one's."""
    target_mlm_accuracy: float | None = None
    """mlm: stop when an evaluation reaches this masked-token accuracy (MLPerf: 0.720); the summary gives time, steps and tokens to target."""
    eval_every: str | None = None
    """Also evaluate during training: every N optimizer steps ('500') or every period of wall time ('10m'); each evaluation is a metrics.jsonl line."""

    # --- data pipeline ---
    sampler: str = "length-grouped"
    """random, length-grouped (random mega-batches sorted by length: less padding) or sequential."""
    pad_to_max_length: bool = False
    """Pad every batch to --max-seq-length instead of the longest sequence in the batch."""
    cache_dir: str | None = None
    """Where tokenised features are cached (default: $HPCBERT_CACHE or ~/.cache/hpcbert)."""
    synthetic_train_size: int = 4096
    """Training examples of --task synthetic."""
    synthetic_dev_size: int = 512
    """Dev examples of --task synthetic."""

    # --- run directory and measurement ---
    out: str | None = None
    """Run directory (config.json, metrics.jsonl, summary.json). Default: runs/<task>-<model>-<time>."""
    log_every: int = 10
    """Write a metrics.jsonl line (and a log line) every N optimizer steps."""
    warmup_steps_excluded: int | None = None
    """Steps excluded from steady-state throughput (default: min(10, 20% of the steps), at least 1)."""
    do_eval: bool = True
    """Evaluate on the dev split(s) after training."""
    save_model: bool = True
    """Write the final weights at the end of a run (not of one stopped early) as a Hugging Face directory, RUN_DIR/model (config.json, model.safetensors, tokenizer files): --model RUN_DIR/model fine-tunes it, hpcbert export RUN_DIR --out DIR copies it."""
    checkpoint_every: float | None = None
    """Save a checkpoint every this much wall-clock time ('20m', '600'); off when not given."""
    checkpoint_steps: int | None = None
    """Save a checkpoint every N optimizer steps; off when not given."""
    keep_last: int = 2
    """Complete checkpoints kept in RUN_DIR/checkpoints (>= 2: the newest may be damaged)."""
    resume: str | None = None
    """auto (newest complete checkpoint in RUN_DIR, if any), never, or a checkpoint directory. Default: auto under a scheduler (SLURM_JOB_ID / PBS_JOBID set), never otherwise."""
    threads: int | None = None
    """torch intra-op threads per process (default: cores / local processes)."""
    dist_timeout: float = 600.0
    """Seconds a rank waits for the others: at start-up (ranks that never arrive are named) and in every collective."""

    def __post_init__(self) -> None:
        self.task = self.task.lower()
        self.grad_ckpt = parse_grad_ckpt(self.grad_ckpt)
        _choice("precision", self.precision, PRECISIONS)
        _choice("norm_precision", self.norm_precision, NORM_PRECISIONS)
        if self.token_multiple is not None and self.token_multiple < 1:
            raise ValueError(f"token_multiple: {self.token_multiple}; a positive number of rows (1: no filler)")
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("sampler", self.sampler, SAMPLERS)
        _choice("lr_scaling", self.lr_scaling, LR_SCALINGS)
        _choice("lr_horizon", self.lr_horizon, LR_HORIZONS)
        _choice("lr_decay", self.lr_decay, LR_DECAYS)
        _choice("squad_version", self.squad_version, SQUAD_VERSIONS)
        if self.format is not None:
            _choice("format", self.format, FILE_FORMATS)
        if self.poly_power <= 0:
            raise ValueError(f"poly_power: must be > 0, got {self.poly_power}")
        if self.poly_power != 1.0 and self.lr_decay != "poly":
            raise ValueError(f"poly_power: {self.poly_power} is the power of --lr-decay poly, which this run does "
                             f"not use (--lr-decay {self.lr_decay}); add --lr-decay poly or leave it out")
        if not 0 < self.mask_prob < 1:
            raise ValueError(f"mask_prob: must be in (0, 1), got {self.mask_prob}")
        if self.target_mlm_accuracy is not None and not 0 < self.target_mlm_accuracy <= 1:
            raise ValueError(f"target_mlm_accuracy: must be in (0, 1], got {self.target_mlm_accuracy}")
        self.eval_every_steps, self.eval_every_seconds  # validates --eval-every
        self.time_budget = parse_duration(self.time_budget, "time_budget")
        self.checkpoint_every = parse_duration(self.checkpoint_every, "checkpoint_every")
        if self.checkpoint_steps is not None and self.checkpoint_steps < 1:
            raise ValueError(f"checkpoint_steps: must be >= 1, got {self.checkpoint_steps}")
        if self.keep_last < 2:
            raise ValueError(f"keep_last: must be >= 2 (the newest checkpoint may be damaged), got {self.keep_last}")
        self.per_rank_batch = format_per_rank_batch(parse_per_rank_batch(self.per_rank_batch))
        self.batch_size = parse_batch_size(self.batch_size)
        self.compile = parse_compile(self.compile)
        if self.compile_mode in _CUDA_GRAPH_MODES:
            raise ValueError(f"compile_mode: {self.compile_mode!r} captures CUDA graphs, which hpcbert does not use "
                             f"(batches change shape from step to step, and a step's loss is read after the next "
                             f"step has started); choose one of {', '.join(TORCH_COMPILE_MODES)}")
        _choice("compile_mode", self.compile_mode, TORCH_COMPILE_MODES)
        if self.dist_timeout <= 0:
            raise ValueError(f"dist_timeout: must be > 0 seconds, got {self.dist_timeout}")
        for name in ("max_seq_length", "grad_accum", "eval_batch_size", "log_every",
                     "synthetic_train_size", "synthetic_dev_size", "doc_stride", "max_query_length",
                     "n_best_size", "max_answer_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_seq_length > 512:
            raise ValueError(f"max_seq_length: {self.max_seq_length} exceeds BERT's 512 positions")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps: must be >= 1, got {self.max_steps}")
        if self.max_steps is None and self.epochs <= 0:
            raise ValueError(f"epochs: must be > 0 when --max-steps is not given, got {self.epochs}")
        if self.lr <= 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio: must be in [0, 1), got {self.warmup_ratio}")
        if self.dropout is not None and not 0 <= self.dropout < 1:
            raise ValueError(f"dropout: must be in [0, 1), got {self.dropout}")
        if self.lr_horizon == "time-budget" and not self.time_budget:
            raise ValueError("lr_horizon: 'time-budget' fits the LR decay to --time-budget; give one "
                             "(e.g. --time-budget 20m) or use --lr-horizon steps")
        # Which options a task needs (files, columns) is checked by its objective (objectives/).

    @property
    def checkpointing(self) -> bool:
        return bool(self.checkpoint_every or self.checkpoint_steps)

    @property
    def eval_every_steps(self) -> int | None:
        """--eval-every as a step count ('500'), or None."""
        if self.eval_every is None or not str(self.eval_every).strip().isdigit():
            return None
        n = int(str(self.eval_every).strip())
        if n < 1:
            raise ValueError(f"eval_every: must be >= 1 step, got {self.eval_every!r}")
        return n

    @property
    def eval_every_seconds(self) -> float | None:
        """--eval-every as a period of wall time ('10m', '1h', '90s'), or None."""
        if self.eval_every is None or str(self.eval_every).strip().isdigit():
            return None
        try:
            return parse_duration(self.eval_every, "eval_every")
        except ValueError as e:
            raise ValueError(f"{e}; or a step count ('500')") from None

    def resume_mode(self) -> str:
        """'never', 'auto' or a path; None resolves by whether a scheduler started us."""
        if self.resume:
            return self.resume
        return "auto" if (os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID")) else "never"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"config: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**d)

    def replace(self, **changes: Any) -> "RunConfig":
        return dataclasses.replace(self, **changes)


# Fields that may differ between a run and its resumption; every other field must match.
RESUMABLE_CHANGES = frozenset({"out", "time_budget", "checkpoint_every", "checkpoint_steps", "keep_last", "resume",
                               "threads", "dist_timeout", "log_every", "do_eval", "eval_batch_size", "cache_dir",
                               "data_dir", "tokenizer", "train_file", "dev_file", "test_file", "eval_data",
                               "eval_every", "target_mlm_accuracy", "n_best_size", "max_answer_length",
                               "null_score_diff_threshold", "save_model", "init_from", "compile_cache"})


def field_help() -> dict[str, str]:
    """Field name -> docstring, read from this file's source (the docstring under each field)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(RunConfig))
    body = tree.body[0].body  # type: ignore[attr-defined]
    out: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            out[node.target.id] = str(nxt.value.value)  # type: ignore[attr-defined]
    return out


# --- command-line plumbing: RunConfig <-> argparse options <-> argv, in one place ---------------

_DURATIONS = ("time_budget", "checkpoint_every")  # given as text ('20m'), parsed by the config


def _base_type(tp: Any) -> Any:
    """'int | None' -> int (annotations are strings under `from __future__ import annotations`)."""
    if isinstance(tp, str):
        tp = eval(tp, vars(typing), {})  # noqa: S307 - our own annotations, not user input
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return tp


def add_arguments(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
    """One --option per RunConfig field; help from the field's docstring ('%' escaped for argparse)."""
    helps = field_help()
    defaults = defaults or {}
    for f in fields(RunConfig):
        flag = "--" + f.name.replace("_", "-")
        default = defaults.get(f.name, f.default)
        tp = _base_type(f.type)
        text = helps.get(f.name, "").replace("%", "%%")
        if f.name == "compile":  # --compile alone (and presets' compile: true) is on; --no-compile is off
            parser.add_argument(flag, nargs="?", const="on", type=str, default=default,
                                help=f"{text} (default: {default})")
            parser.add_argument("--no-compile", dest="compile", action="store_const", const="off",
                                help=argparse.SUPPRESS)
        elif f.name == "batch_size":
            parser.add_argument(flag, type=str, default=default, help=f"{text} (default: {default})")
        elif tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        elif f.name in _DURATIONS:
            parser.add_argument(flag, type=str, default=default, help=f"{text} (default: {default})")
        else:
            parser.add_argument(flag, type=tp, default=default, help=f"{text} (default: {default})")


def from_namespace(ns: argparse.Namespace) -> RunConfig:
    """The RunConfig an argparse namespace (from `add_arguments`) describes."""
    return RunConfig(**{f.name: getattr(ns, f.name) for f in fields(RunConfig)})


def to_argv(values: RunConfig | dict[str, Any]) -> list[str]:
    """The `hpcbert train` options that give these values: a whole RunConfig (reproduces it
    exactly), or a partial {field: value} dict such as a preset. None values are left out."""
    items = values.to_dict().items() if isinstance(values, RunConfig) else values.items()
    known = {f.name for f in fields(RunConfig)}
    argv: list[str] = []
    for name, value in items:
        if name not in known:
            raise ValueError(f"config: unknown field {name!r}; known: {', '.join(sorted(known))}")
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + name.replace("_", "-"))
        elif value is not None:
            argv += [flag, format(value) if not isinstance(value, float) else repr(value)]
    return argv


def parse_argv(argv: list[str], defaults: dict[str, Any] | None = None) -> RunConfig:
    """`hpcbert train` options -> RunConfig (argparse errors exit 2 with the usage line)."""
    p = argparse.ArgumentParser(prog="hpcbert train", add_help=False)
    add_arguments(p, defaults)
    return from_namespace(p.parse_args(argv))
