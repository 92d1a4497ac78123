"""The run directory contract: what a run leaves behind and how it is read back.

    RUN_DIR/config.json     the resolved RunConfig (RunConfig.from_dict reads it back)
    RUN_DIR/metrics.jsonl   one JSON object per logged optimizer step (METRIC_KEYS)
    RUN_DIR/summary.json    one JSON object written at the end (SUMMARY_KEYS), schema_version first

Only rank 0 writes these files. Writes are atomic (temporary file + fsync + rename) so a reader
never sees half a file. `train.py` writes them, `report/` reads them; both use this module.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 8
# Keys each schema version added; a summary of an older version reads with them as null (not measured).
ADDED_IN = {2: ("tf32", "lr_horizon_steps", "lr_horizon_source", "nonfinite_grad_steps"),
            3: ("time_to_target_s", "steps_to_target", "tokens_to_target"),
            4: ("host_allocator",),
            5: ("norm_precision",),
            6: ("token_multiple",),
            7: ("compile_steps",),
            8: ("compile_cache",)}

# summary.json keys and their meaning (units in the name where there is one). A figure that cannot
# be measured on a device is null, never zero.
SUMMARY_KEYS: dict[str, str] = {
    "schema_version": "version of this schema (int)",
    "hpcbert_version": "package version that wrote the run",
    "run": "run directory name",
    "task": "task name (GLUE task or 'synthetic')",
    "model": "model name or path",
    "model_is_random": "true when the weights are random (bert-tiny/base/large shapes), not pretrained",
    "num_layers": "encoder layers",
    "hidden_size": "hidden width",
    "max_seq_length": "truncation length",
    "precision": "resolved precision actually used (fp32, bf16, fp16)",
    "tf32": "fp32 matmuls on TF32 tensor cores (CUDA, compute capability >= 8.0)",
    "norm_precision": "LayerNorms and the residual stream: low (in the bf16/fp16 of autocast) or fp32 (autocast's rule; every fp32 run); null: a run from before --norm-precision, fp32",
    "compile": "torch.compile used",
    "compile_steps": "with --compile: the steps in which torch.compile made graphs, each {step, graphs, step_s, host_s: the host's part of that step, the compile in it (absent in runs before it was recorded)}; a step after the warm-up here is left out of the steady figures, as throughput_method says (runs whose throughput_method does not say so have its compile time in them); null without --compile",
    "compile_cache": "with --compile: torch.compile's cache folder (--compile-cache, else torch's own) and this run's use of it: graphs_from_cache and graphs_compiled (inductor's graphs), autograd_from_cache and autograd_compiled (AOT autograd's); null without --compile",
    "token_multiple": "a padded micro-batch's real-token rows rounded up to a multiple of this with filler rows no head reads (1: none; --token-multiple)",
    "host_allocator": "glibc-retain (freed host memory kept mapped for the next step: dist.tune_host_allocator) or system",
    "grad_ckpt": "gradient checkpointing policy",
    "ckpt_layers": "indices of checkpointed encoder layers",
    "optimizer": "adamw or lamb",
    "lr": "peak learning rate after scaling",
    "lr_scaling": "learning-rate scaling with world size: none, linear or sqrt",
    "lr_horizon_steps": "optimizer step at which the linear LR decay reaches zero",
    "lr_horizon_source": "how that step was chosen: the planned steps, or fitted to the time budget (with the step time it used)",
    "seed": "seed",
    "world_size": "number of processes",
    "nodes": "number of nodes",
    "gpus_per_node": "devices per node (processes per node)",
    "dist_backend": "collective backend: gloo (CPU) or nccl (CUDA); null for a single process",
    "per_device_batch_size": "micro-batch per device (list when per-rank batches differ)",
    "grad_accum": "micro-batches per optimizer step",
    "global_batch_size": "sequences per optimizer step over all ranks",
    "steps": "optimizer steps run",
    "epochs_done": "epochs covered (fractional)",
    "sequences": "training sequences processed",
    "nonfinite_grad_steps": "optimizer steps whose gradient norm was inf or nan (fp16: skipped by the loss scaler)",
    "resumed_from_step": "step of the checkpoint this segment resumed from (null: not resumed)",
    "startup_s": "seconds from process start to the first training step",
    "train_s": "seconds from the first step's start to the last step's end (logging, checkpoints included)",
    "warmup_steps_excluded": "first steps left out of the steady-state figures",
    "steady_steps_per_sec": "optimizer steps / summed step time over steady steps (warm-up, eval, checkpoint and logging time excluded)",
    "steady_sequences_per_sec": "sequences / summed step time over steady steps",
    "steady_step_time_s": "median step time over steady steps",
    "e2e_sequences_per_sec": "sequences / wall time from process start to the last step, over all segments of a resumed run",
    "tokens_per_sec": "real (non-pad) tokens / summed step time over steady steps",
    "padded_tokens_per_sec": "tokens incl. padding / summed step time over steady steps",
    "throughput_method": "how the steady figures were measured, in words",
    "time_budget_s": "wall-clock budget from process start (null: none)",
    "steps_in_budget": "optimizer steps that finished inside the budget (null: no budget)",
    "sequences_in_budget": "sequences of those steps (null: no budget)",
    "stopped_by": "max_steps, epochs, time_budget, job_deadline, stop_file, signal or target (--target-mlm-accuracy reached)",
    "activation_bytes_per_sequence": "bytes saved for backward per sequence at max_seq_length, measured with saved-tensor hooks (difference of batch 2 and batch 1)",
    "peak_memory_bytes": "CUDA allocator peak (GPU) or process peak RSS (CPU)",
    "peak_memory_kind": "cuda_max_allocated or process_max_rss",
    "model_flops_per_sec": "model FLOPs/s over steady steps, from 3*L*(24*s*h^2 + 4*s^2*h) per sequence at its real length, less the last layer's work at positions the head does not read (model.batch_flops), plus the head's matrix products on the rows it reads (the objective's head_flops)",
    "peak_flops": "device peak FLOP/s at the precision used (table for GPUs, measured matmul on CPU)",
    "peak_flops_source": "where peak_flops came from",
    "mfu": "model_flops_per_sec / peak_flops",
    "final_loss": "mean training loss over the last logged window",
    "time_to_target_s": "--target-mlm-accuracy: seconds from the start of the run (all segments, start-up and evaluations included, as MLPerf's time to train) to the end of the first evaluation that reached it; null: not reached or no target",
    "steps_to_target": "optimizer steps done at that evaluation (null: not reached)",
    "tokens_to_target": "real (non-pad) training tokens done at that evaluation (null: not reached)",
    "eval": "{split: {metric: value}} on the dev split(s); {} when not evaluated",
    "main_metric": "the task's headline metric name (f1, accuracy, mcc, pearson)",
    "per_rank_step_time_s": "{min, median, max, slowest_rank, per_rank} of every rank's median steady step time (s), gathered by a collective; null without steady steps",
    "versions": "python, torch, tokenizers, hpcbert",
    "hardware": "device name, device count, cpu, cores, threads",
    "git_commit": "commit of the hpcbert checkout (null outside git)",
}

METRIC_KEYS = ("step", "epoch", "loss", "lr", "grad_norm", "step_time_s", "sequences_per_sec",
               "tokens_per_sec", "elapsed_s")
# An evaluation during training (--eval-every) is a line of its own: step, epoch, "loss" null, "eval"
# {split: {metric: value}}, tokens_seen and sequences_seen (training tokens / sequences done), elapsed_s
# (this segment) and run_time_s (seconds from the start of the run, all segments).


def sha256_file(path: str | os.PathLike) -> str:
    """The hex sha256 of a file's bytes, read 4 MiB at a time (hashlib.file_digest does this from Python
    3.11; the package supports 3.10)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write text via a temporary file in the same directory, fsync, then rename: a reader (or a
    killed writer) never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON via a temporary file in the same directory, fsync, then rename."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


class MetricsWriter:
    """Appends one JSON line per call to metrics.jsonl (rank 0 only; one writer per file)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, default=_json_default) + "\n")

    def close(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


class RunDirError(ValueError):
    """A directory that is not a readable hpcbert run; the message names the run and what is wrong."""


def one_line(text: str, limit: int = 200) -> str:
    """`text` for a one-line message: line breaks and other control characters escaped, at most
    `limit` characters (an ellipsis marks a cut)."""
    text = "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def is_real(v: Any) -> bool:
    """A JSON number (not a boolean) that converts to a float: NaN and infinity included, an
    integer beyond the float range not."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        float(v)
    except OverflowError:
        return False
    return True


def short_repr(value: Any, limit: int = 80) -> str:
    """repr(value) for an error message: one line, at most `limit` characters."""
    return one_line(repr(value), limit)


def _decode_json(data: bytes, where: str) -> Any:
    """One JSON document from UTF-8 bytes; RunDirError naming `where` (file, or file:line) otherwise."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RunDirError(f"{where}: not UTF-8 text (byte {e.start}: {short_repr(data[e.start:e.start + 4])})") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RunDirError(f"{where}: not valid JSON ({one_line(str(e))})") from e
    except RecursionError as e:
        raise RunDirError(f"{where}: not readable JSON (nested too deeply)") from e
    except ValueError as e:  # e.g. an integer literal longer than int's digit limit
        raise RunDirError(f"{where}: not readable JSON ({one_line(str(e))})") from e


def read_json_object(path: Path) -> dict[str, Any]:
    """A UTF-8 JSON file holding one object; RunDirError (one line, naming the file) otherwise."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise RunDirError(f"{path}: cannot be read ({one_line(e.strerror or str(e))})") from e
    obj = _decode_json(data, str(path))
    if not isinstance(obj, dict):
        raise RunDirError(f"{path}: expected a JSON object, found {type(obj).__name__}")
    return obj


def read_summary(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Read and validate RUN_DIR/summary.json; RunDirError names the run and what is missing."""
    run_dir = Path(run_dir)
    path = run_dir / "summary.json"
    if not path.is_file():
        raise RunDirError(f"{run_dir}: not an hpcbert run (no summary.json)")
    summary = read_json_object(path)
    version = summary.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= SCHEMA_VERSION:
        raise RunDirError(f"{path}: schema_version {short_repr(version)} is not supported "
                          f"(this hpcbert reads versions 1 to {SCHEMA_VERSION})")
    newer = {k for v, keys in ADDED_IN.items() if v > version for k in keys}
    missing = [k for k in SUMMARY_KEYS if k not in summary and k not in newer]
    if missing:
        raise RunDirError(f"{path}: missing key(s) {', '.join(missing)}")
    return {**{k: None for k in newer}, **summary}


def read_metrics(run_dir: str | os.PathLike, required: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Read RUN_DIR/metrics.jsonl (none: no records). Each non-blank line must be a JSON object
    holding the `required` keys; `step`, where present, a non-negative integer, and the other
    METRIC_KEYS numbers or null. RunDirError names file and line otherwise."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    with open(path, "rb") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = _decode_json(line, f"{path}:{i}")
            if not isinstance(rec, dict):
                raise RunDirError(f"{path}:{i}: expected a JSON object, found {type(rec).__name__}")
            missing = [k for k in required if k not in rec]
            if missing:
                raise RunDirError(f"{path}:{i}: missing key(s) {', '.join(missing)}")
            for key in METRIC_KEYS:
                v = rec.get(key)
                if key == "step" and key in rec and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                    raise RunDirError(f"{path}:{i}: step is {short_repr(v)}; expected a non-negative integer")
                if v is not None and not is_real(v):
                    raise RunDirError(f"{path}:{i}: {key} is {short_repr(v)}; expected a number or null")
            out.append(rec)
    return out
