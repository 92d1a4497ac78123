"""Constructed run directories with known values, for the report tests.

make_run writes what a finished run leaves behind (runfiles.py): config.json from a real RunConfig,
summary.json with every SUMMARY_KEYS key, and metrics.jsonl. The numbers are chosen so tests can
check the report against hand-computed values.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hpcbert.config import RunConfig
from hpcbert.runfiles import SCHEMA_VERSION, SUMMARY_KEYS, MetricsWriter, write_json_atomic

# As train.py words it; the step range depends on the run's length.
THROUGHPUT_METHOD = ("summed step times of steps 11..{steps} (first 10 excluded as warm-up); a step runs "
                     "from its first batch to the end of the optimizer step, so evaluation, checkpoint "
                     "and logging time is excluded")
# As meters.hardware() writes it.
V100 = {"hostname": "dgx01", "cpu": "Intel Xeon Gold 6148", "cores": 40, "threads": 5,
        "device_type": "cuda", "device": "Tesla V100-SXM2-32GB", "device_count": 4}
CPU = {"hostname": "vm", "cpu": "AMD EPYC 7B13", "cores": 2, "threads": 2, "device_type": "cpu",
       "device": "CPU (AMD EPYC 7B13)", "device_count": 1}
MiB = 2**20


def make_run(parent: str | Path, name: str, *, config: dict[str, Any] | None = None,
             world_size: int = 1, nodes: int = 1, seq_per_s: float = 100.0,
             steps_in_budget: int | None = 1000, act_mib: float = 50.0, step_time_s: float | None = None,
             accuracy: float | None = 0.80, f1: float | None = 0.85, final_loss: float = 0.5,
             metrics_steps: int = 50, hardware: dict | None = None, **summary: Any) -> Path:
    """A finished run under parent/name. Derived figures follow the definitions in SUMMARY_KEYS:
    global batch = batch x accum x world size, steps/s = seq/s / global batch, sequences in budget
    = steps in budget x global batch. Extra keyword arguments override summary keys."""
    run_dir = Path(parent) / name
    cfg = RunConfig(task="mrpc", data_dir="glue", model="minilm-l6", max_seq_length=128,
                    batch_size=32, optimizer="lamb", lr=5e-5, time_budget="20m", seed=1,
                    out=str(run_dir))
    cfg = cfg.replace(**(config or {}))
    gpus_per_node = world_size // nodes
    global_batch = cfg.batch_size * cfg.grad_accum * world_size
    steps_per_s = seq_per_s / global_batch
    steps = steps_in_budget if steps_in_budget is not None else 500
    ev = {"dev": {k: v for k, v in (("accuracy", accuracy), ("f1", f1)) if v is not None}}
    hw = dict(hardware or V100)
    if hw["device_type"] == "cuda":
        hw["device_count"] = gpus_per_node
    values: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "hpcbert_version": "0.1.0", "run": name,
        "task": cfg.task, "model": cfg.model, "model_is_random": False, "num_layers": 6,
        "hidden_size": 384, "max_seq_length": cfg.max_seq_length,
        "precision": "bf16" if cfg.precision == "auto" else cfg.precision, "compile": cfg.compile == "on",
        "compile_steps": [{"step": 1, "graphs": 1, "step_s": 30.0}] if cfg.compile == "on" else None,
        "compile_cache": {"dir": "/tmp/torchinductor", "graphs_from_cache": 0, "graphs_compiled": 2,
                          "autograd_from_cache": 0, "autograd_compiled": 1} if cfg.compile == "on" else None,
        "grad_ckpt": cfg.grad_ckpt, "ckpt_layers": _ckpt_layers(cfg.grad_ckpt, 6),
        "optimizer": cfg.optimizer, "lr": cfg.lr, "lr_scaling": cfg.lr_scaling, "seed": cfg.seed,
        "world_size": world_size, "nodes": nodes, "gpus_per_node": gpus_per_node,
        "dist_backend": "nccl" if world_size > 1 else None, "per_device_batch_size": cfg.batch_size,
        "grad_accum": cfg.grad_accum, "global_batch_size": global_batch, "steps": steps,
        "epochs_done": steps * global_batch / 3668, "sequences": steps * global_batch,
        "resumed_from_step": None, "startup_s": 30.0, "train_s": steps / steps_per_s, "warmup_steps_excluded": 10,
        "steady_steps_per_sec": steps_per_s, "steady_sequences_per_sec": seq_per_s,
        "steady_step_time_s": step_time_s if step_time_s is not None else 1.0 / steps_per_s,
        "e2e_sequences_per_sec": steps * global_batch / (30.0 + steps / steps_per_s),
        "tokens_per_sec": seq_per_s * 40.0, "padded_tokens_per_sec": seq_per_s * 48.0,
        "throughput_method": THROUGHPUT_METHOD.format(steps=steps), "time_budget_s": cfg.time_budget,
        "steps_in_budget": steps_in_budget,
        "sequences_in_budget": None if steps_in_budget is None else steps_in_budget * global_batch,
        "stopped_by": "time_budget" if cfg.time_budget else "max_steps",
        "activation_bytes_per_sequence": int(act_mib * MiB), "peak_memory_bytes": 3 * 2**30,
        "peak_memory_kind": "cuda_max_allocated", "model_flops_per_sec": seq_per_s * 2.0e10,
        "peak_flops": 1.25e14 * world_size, "peak_flops_source": "table: V100 fp16 tensor core",
        "mfu": seq_per_s * 2.0e10 / (1.25e14 * world_size), "final_loss": final_loss,
        "eval": ev if (accuracy is not None or f1 is not None) else {}, "main_metric": "accuracy",
        "per_rank_step_time_s": {"min": 0.1, "median": 0.1, "max": 0.1, "slowest_rank": 0},
        "versions": {"python": "3.11", "torch": "2.13.0", "tokenizers": "0.21", "hpcbert": "0.1.0"},
        "hardware": hw, "git_commit": None,
        # Keys newer than some runfiles versions: written only where SUMMARY_KEYS has them.
        "tf32": False, "lr_horizon_steps": steps, "lr_horizon_source": "planned steps",
        "nonfinite_grad_steps": 0,
        "time_to_target_s": None, "steps_to_target": None, "tokens_to_target": None, "host_allocator": "system",
        "norm_precision": "fp32" if cfg.precision == "fp32" else cfg.norm_precision,
        "token_multiple": cfg.token_multiple or 1,
    }
    unknown = set(summary) - set(SUMMARY_KEYS)
    assert not unknown, f"not summary keys: {unknown}"
    values.update(summary)
    missing = set(SUMMARY_KEYS) - set(values)
    assert not missing, f"fixture out of step with runfiles.SUMMARY_KEYS: no value for {sorted(missing)}"
    values = {k: values[k] for k in SUMMARY_KEYS}
    write_json_atomic(run_dir / "config.json", cfg.to_dict())
    write_json_atomic(run_dir / "summary.json", values)
    writer = MetricsWriter(run_dir / "metrics.jsonl")
    for step in range(10, metrics_steps * 10 + 1, 10):
        loss = final_loss + 0.2 * math.exp(-step / 100.0) + 0.01 * (cfg.seed % 3)
        writer.write({"step": step, "epoch": step * global_batch / 3668, "loss": loss, "lr": cfg.lr,
                      "grad_norm": 1.0, "step_time_s": 1.0 / steps_per_s,
                      "sequences_per_sec": seq_per_s, "tokens_per_sec": seq_per_s * 40.0,
                      "elapsed_s": 30.0 + step / steps_per_s})
    writer.close()
    return run_dir


def _ckpt_layers(policy: str, layers: int) -> list[int]:
    if policy == "none":
        return []
    if policy == "all":
        return list(range(layers))
    k = 2 if policy == "alternate" else int(policy.split(":")[1])
    return list(range(0, layers, k))


def make_study(parent: str | Path) -> Path:
    """A small results folder like a real study: a 1-GPU baseline over 3 seeds, an 8-GPU (2x4) run
    with checkpointing over 3 seeds, a 4-GPU run, and a grad_ckpt policy sweep on 1 GPU."""
    root = Path(parent)
    for seed, sps, acc in ((1, 115.0, 0.80), (2, 116.0, 0.81), (3, 114.5, 0.79)):
        make_run(root / "scaling", f"1gpu-s{seed}", config={"seed": seed}, seq_per_s=sps,
                 accuracy=acc, steps_in_budget=2938)
    for seed, sps, acc in ((1, 970.0, 0.86), (2, 973.0, 0.87), (3, 968.0, 0.85)):
        make_run(root / "scaling", f"8gpu-s{seed}", config={"seed": seed, "grad_ckpt": "alternate"},
                 world_size=8, nodes=2, seq_per_s=sps, accuracy=acc, steps_in_budget=1225)
    make_run(root / "scaling", "4gpu", config={"grad_ckpt": "alternate"}, world_size=4, seq_per_s=430.0,
             accuracy=0.84, steps_in_budget=1600)
    make_run(root / "scaling", "1gpu-ckpt", config={"grad_ckpt": "alternate"}, seq_per_s=110.0,
             accuracy=0.80, steps_in_budget=2800)
    for policy, act, t in (("none", 48.0, 0.20), ("alternate", 26.0, 0.23), ("all", 6.0, 0.27)):
        make_run(root / "policies", f"ckpt-{policy}", config={"grad_ckpt": policy, "task": "synthetic",
                 "data_dir": None, "model": "bert-base", "time_budget": None}, act_mib=act,
                 step_time_s=t, seq_per_s=32 / t, steps_in_budget=None, model_is_random=True,
                 accuracy=0.5, f1=None)
    return root


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))
