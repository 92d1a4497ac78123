"""Measurements a run reports: step timing, saved activations, peak memory, peak FLOP/s, environment.

Definitions (also in runfiles.SUMMARY_KEYS): steady-state figures sum step times over steps after
the warm-up; a step's time runs from fetching its first micro-batch to the end of the optimizer
step (a CPU-GPU sync point on CUDA), so evaluation, checkpointing and logging between steps are
excluded.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import resource
import socket
import subprocess
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from . import __version__, cuda_allocator_settings


@dataclass
class StepMeter:
    """Per-step records; summary figures computed once at the end."""

    times: list[float] = field(default_factory=list)
    sequences: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)          # real (non-pad) tokens
    padded_tokens: list[int] = field(default_factory=list)   # B*T summed over micro-batches
    flops: list[float] = field(default_factory=list)         # model FLOPs of the step
    ends: list[float] = field(default_factory=list)          # wall-clock end of each step
    in_budget: list[bool] = field(default_factory=list)      # ended inside its segment's time box
    compiled: list[bool] = field(default_factory=list)       # torch.compile made graphs in it

    def add(self, seconds: float, sequences: int, tokens: int, padded: int, flops: float, end: float,
            in_budget: bool = True, compiled: bool = False) -> None:
        self.in_budget.append(in_budget)
        self.compiled.append(compiled)
        self.times.append(seconds)
        self.sequences.append(sequences)
        self.tokens.append(tokens)
        self.padded_tokens.append(padded)
        self.flops.append(flops)
        self.ends.append(end)

    def __len__(self) -> int:
        return len(self.times)

    @staticmethod
    def default_warmup(steps: int) -> int:
        """Steps left out of steady-state figures: min(10, 20% of the run), at least 1 when the
        run has at least 2 steps (the first step pays for lazy initialisation everywhere)."""
        return 0 if steps < 2 else max(1, min(10, steps // 5))

    def timed(self, warmup: int) -> list[int]:
        """The steps (positions) the steady figures come from: those after the first `warmup`, less
        the steps in which torch.compile compiled (a recompile of tens of seconds is not the steady
        state; the run reports it apart, in its summary's compile_steps), unless that leaves none."""
        after = range(warmup, len(self.times))
        return [i for i in after if not self.compiled[i]] or list(after)

    def steady(self, warmup: int) -> dict[str, float | None]:
        keep = self.timed(warmup)
        t = np.asarray([self.times[i] for i in keep])
        if len(t) == 0 or t.sum() <= 0:
            return {k: None for k in ("steady_steps_per_sec", "steady_sequences_per_sec", "steady_step_time_s",
                                      "tokens_per_sec", "padded_tokens_per_sec", "model_flops_per_sec")}
        total = float(t.sum())
        return {
            "steady_steps_per_sec": len(t) / total,
            "steady_sequences_per_sec": sum(self.sequences[i] for i in keep) / total,
            "steady_step_time_s": float(np.median(t)),
            "tokens_per_sec": sum(self.tokens[i] for i in keep) / total,
            "padded_tokens_per_sec": sum(self.padded_tokens[i] for i in keep) / total,
            "model_flops_per_sec": sum(self.flops[i] for i in keep) / total,
        }


def activation_bytes_per_sequence(model: nn.Module, loss_of: Callable[[int], torch.Tensor],
                                  device: torch.device) -> int:
    """Bytes the forward pass leaves allocated on `device` for backward, per sequence.

    `loss_of(b)` runs the objective's forward and loss (under the run's autocast) on b sequences
    of the run's longest length. Counts every tensor storage that an operation creates on the
    device during that call and that is still alive when it returns (each storage once), for a
    batch of 2 and a batch of 1, and returns the difference, which cancels batch-independent
    tensors (autocast's weight copies, RNG states). That is what autograd's saved-tensor hooks see
    (tensors saved for backward, the inputs a checkpoint keeps, what a saved-tensor hook's recipe
    holds); tensors `offload` moved to host memory do not count on a GPU.
    Gradient checkpointing shows up here directly: a checkpointed layer keeps only its input.
    The model must be in training mode (dropout masks count). RNG state is restored.
    """
    assert model.training, "measure activations in training mode"

    def saved_bytes(batch: int) -> int:
        with _StoragesCreated(device) as created:
            loss = loss_of(batch)
        total = created.alive_bytes()
        del loss
        return total

    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        return saved_bytes(2) - saved_bytes(1)


class _StoragesCreated(TorchDispatchMode):
    """Counts the bytes of every storage that operations create on `device` while active, as long as
    each lives: a storage's Python object lives exactly as long as the storage (PyTorch keeps it
    while the storage is referenced from C++, as MemTracker in torch.distributed._tools relies on),
    so a weak reference's callback takes its bytes off when it is freed. An output whose storage is
    one of the operation's inputs' (a view, an in-place operation) is not a new storage, except
    lift_fresh's (a tensor torch.tensor(...) made). `peak`: the most alive after any operation while
    active."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device_type = device.type
        self.created: dict[int, weakref.ref] = {}
        self.alive = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = None
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                st = t.untyped_storage()
                if st._cdata not in self.created:
                    if inputs is None:  # a view's or an in-place operation's output is its input's storage,
                        # which may have existed before (a parameter, an accumulated gradient): not created
                        # here; but lift_fresh returns as is a tensor torch.tensor(...) has just made
                        inputs = set() if func is torch.ops.aten.lift_fresh.default else {
                            a.untyped_storage()._cdata for a in torch.utils._pytree.tree_leaves((args, kwargs))
                            if isinstance(a, torch.Tensor) and a.device.type == self.device_type}
                    if st._cdata in inputs:
                        continue
                    n = st.nbytes()
                    self.created[st._cdata] = weakref.ref(st, functools.partial(self._freed, st._cdata, n))
                    self.alive += n
        self.peak = max(self.peak, self.alive)
        return out

    def _freed(self, key: int, nbytes: int, _ref) -> None:
        del self.created[key]
        self.alive -= nbytes

    def alive_bytes(self) -> int:
        return self.alive


class _Timeline(_StoragesCreated):
    """_StoragesCreated that also records the bytes alive after every operation (`after`)."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.after: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.after.append(self.alive)
        return out


@dataclass
class StepMemory:
    """The bytes a forward and backward create on a device and hold, as a function of the batch b:
    after operation i, (grow[i] x b + base[i]) / per. A storage the step creates either grows with
    the batch (activations, their gradients, a recomputed layer's tensors) or does not (autocast's
    weight copies, the parameters' gradients as backward computes them), so two traced batches b1
    and b2 = b1 + per give both parts after every operation, exactly, in integers. The peak at a
    batch is the most of these lines there: at a large batch it falls early in backward, where the
    saved activations are at their most and few gradients exist yet; at a small one later, beside
    more of the gradients."""

    batches: tuple[int, int]
    grow: np.ndarray              # int64: bytes `per` more sequences add, after each operation
    base: np.ndarray              # int64: per x the bytes that do not grow, after each operation
    forward_end: tuple[int, int]  # (grow, base) of the bytes alive when the forward returned
    gradients: int                # bytes of the parameters' gradients after backward

    @classmethod
    def fit(cls, batches: tuple[int, int], after: tuple[list[int], list[int]], saved: tuple[int, int],
            gradients: int) -> "StepMemory":
        """From the bytes alive after each operation at the two batches (`after`) and when their
        forwards returned (`saved`)."""
        (b1, b2), (t1, t2) = batches, after
        if len(t1) != len(t2):
            raise RuntimeError(f"the step ran {len(t1)} operations at batch {b1} and {len(t2)} at {b2}: "
                               "no one sequence of operations to fit the bytes of each to the batch")
        a1, a2 = np.asarray(t1, dtype=np.int64), np.asarray(t2, dtype=np.int64)
        grow, per, (s1, s2) = a2 - a1, b2 - b1, saved
        return cls(batches, grow, a1 * per - grow * b1, (s2 - s1, s1 * per - (s2 - s1) * b1), gradients)

    @property
    def per(self) -> int:
        return self.batches[1] - self.batches[0]

    def peak(self, b: int) -> int:
        """The most bytes alive after any operation of the step at batch b."""
        return int(np.max(self.grow * b + self.base)) // self.per

    def largest(self, budget: int) -> int:
        """The largest batch whose peak is at most `budget` bytes (0 where not one sequence fits)."""
        if budget < 0 or np.any((self.grow <= 0) & (self.base > budget * self.per)):
            return 0
        g = self.grow > 0
        if not g.any():
            raise ValueError("the traced step holds nothing that grows with the batch")
        return max(0, int(np.min((budget * self.per - self.base[g]) // self.grow[g])))

    def workspace_per_sequence(self) -> int:
        """What backward holds beyond the tensors saved for it at its peak, per sequence: the peak's
        growth between the traced batches less that of the bytes alive when the forward returned."""
        b1, b2 = self.batches
        return (self.peak(b2) - self.peak(b1) - self.forward_end[0]) // (b2 - b1)


def trace_step(model: nn.Module, loss_of: Callable[[int], torch.Tensor], device: torch.device,
               batches: tuple[int, int] = (64, 128), gradients_held: bool = False) -> StepMemory:
    """StepMemory of a forward and backward of `loss_of(b)` at two batches, counted as
    activation_bytes_per_sequence counts (storages that operations create on `device`, while each
    lives). Meant for FakeTensorMode (hpcbert plan), where a batch costs no memory or compute, so the
    batches can be large enough that the peak falls where the batch's share is largest.

    gradients_held=False: every gradient is None before a traced step (zero_grad(set_to_none), as a
    single process without accumulation runs), so the gradients backward allocates are in the trace.
    True: every gradient exists before it (a first backward, not traced), as under DDP (its buckets)
    or with accumulation, so backward adds into them. RNG state is restored; gradients end None."""
    def trace(b: int) -> tuple[list[int], int]:
        if gradients_held and any(p.grad is None for p in model.parameters() if p.requires_grad):
            loss_of(b).backward()
        elif not gradients_held:
            model.zero_grad(set_to_none=True)
        with _Timeline(device) as tl:
            loss = loss_of(b)
            saved = tl.alive_bytes()
            loss.backward()
            del loss
        return tl.after, saved

    b1, b2 = batches
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        t1, s1 = trace(b1)
        t2, s2 = trace(b2)
        gradients = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
        model.zero_grad(set_to_none=True)
    return StepMemory.fit(batches, (t1, t2), (s1, s2), gradients)


def trace_evaluation(model: nn.Module, outputs_of: Callable[[int], object], device: torch.device,
                     batches: tuple[int, int] = (64, 128)) -> StepMemory:
    """StepMemory of an evaluation's forward: `outputs_of(b)` at two batches without autograd (the
    caller puts the model in eval mode), counted as trace_step counts. Nothing is kept for a
    backward, so its line after each operation is what that forward holds there (autocast's weight
    copies, the layer in flight, the outputs); forward_end is the outputs' bytes, gradients 0.
    RNG state is restored."""
    def trace(b: int) -> tuple[list[int], int]:
        with torch.no_grad(), _Timeline(device) as tl:
            out = outputs_of(b)
            kept = tl.alive_bytes()
            del out
        return tl.after, kept

    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        (t1, s1), (t2, s2) = trace(batches[0]), trace(batches[1])
    return StepMemory.fit(batches, (t1, t2), (s1, s2), 0)


def peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if platform.system() == "Darwin" else rss * 1024), "process_max_rss"


# Dense (no sparsity) peak FLOP/s from the vendors' data sheets, matched on the device name in
# this order (the first pattern that matches wins, so "H100 PCIe" is not read as an SXM part and
# "A10G" / "A100" are not read as an A10).
GPU_PEAK_FLOPS: list[tuple[str, str, dict[str, float]]] = [
    (r"H200", "H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    (r"H100.*NVL", "H100 NVL", {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12}),
    (r"H100.*PCIe", "H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}),
    (r"H100", "H100 SXM", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    (r"A100", "A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    (r"L40S", "L40S", {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12}),
    # No NVIDIA data sheet for the A10G (AWS g5); the figures commonly cited for it.
    (r"A10G", "A10G", {"bf16": 70e12, "fp16": 70e12, "fp32": 31.2e12}),
    (r"A10(?![0-9G])", "A10", {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12}),
    (r"V100", "V100", {"fp16": 125e12, "fp32": 15.7e12}),
    (r"T4(?![0-9])", "T4", {"fp16": 65e12, "fp32": 8.1e12}),
]


def gpu_peak_flops(name: str, precision: str) -> tuple[float | None, str]:
    """(peak FLOP/s, source) for a CUDA device name such as 'NVIDIA H100 PCIe'."""
    for pattern, label, table in GPU_PEAK_FLOPS:
        if re.search(pattern, name):
            value = table.get(precision)
            source = "figure commonly cited (no data sheet)" if label == "A10G" else "data sheet"
            return value, (f"{source}, {label} {precision}" if value else f"no {precision} peak known for {name}")
    return None, f"no peak known for {name}"


def _peak_cache_path() -> Path:
    return Path(os.environ.get("HPCBERT_CACHE") or Path.home() / ".cache" / "hpcbert") / "peak_flops.json"


def measure_cpu_peak(dtype: torch.dtype, n: int = 1024, trials: int = 5) -> float:
    """FLOP/s of an n x n matmul at the current thread count: the fastest of `trials` (a peak is the
    best the machine can do, so a trial slowed by other work on a shared machine does not lower it)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    rates = []
    for _ in range(trials):
        reps, t0 = 0, time.perf_counter()
        while reps < 2 or time.perf_counter() - t0 < 0.1:
            a @ b
            reps += 1
        rates.append(2 * n ** 3 * reps / (time.perf_counter() - t0))
    return max(rates)


def cpu_bandwidth(nbytes: int = 1 << 27, trials: int = 5) -> float:
    """Host memory bandwidth in bytes/s (read + write) of a tensor copy at the current thread count:
    the fastest of `trials` (other work on a shared machine only lowers a trial)."""
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    best = 0.0
    for _ in range(trials):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * nbytes / (time.perf_counter() - t0))
    return best


def peak_flops(device: torch.device, precision: str, refresh: bool = False) -> tuple[float | None, str]:
    """Peak FLOP/s at `precision`: a data-sheet table for GPUs; on CPU a 1024^2 matmul measured once
    per machine and cached with the hardware description (CPU model, cores this process may use,
    threads, dtype, torch version) in $HPCBERT_CACHE/peak_flops.json, so every run on the machine -
    the three runs of a bench, a rank of a DDP run - divides by the same peak. `refresh` measures
    again and keeps the larger (`hpcbert bench` does, once, before its runs): contention can only
    lower a measurement, so the cached peak only moves up towards the machine's real one."""
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), precision)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    threads = torch.get_num_threads()
    key = f"{cpu_name()}|cores={len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()}" \
          f"|threads={threads}|{precision}|torch={torch.__version__}"
    path = _peak_cache_path()
    try:
        cache = json.loads(path.read_text())
        if not isinstance(cache, dict):
            cache = {}
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(key)
    valid = isinstance(entry, dict) and isinstance(entry.get("flops"), (int, float)) and entry["flops"] > 0
    if not valid or refresh:
        fresh = measure_cpu_peak(dtype)
        if valid and entry["flops"] >= fresh:
            return float(entry["flops"]), _cpu_source(precision, threads, entry["measured"], path)
        entry = {"flops": fresh, "measured": time.strftime("%Y-%m-%dT%H:%M:%S"),
                 "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
        cache[key] = entry
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
            os.replace(tmp, path)  # atomic: concurrent runs see the old file or the new one
        except OSError:
            pass  # a read-only home: the peak is still measured, just not shared
    return float(entry["flops"]), _cpu_source(precision, threads, entry["measured"], path)


def _cpu_source(precision: str, threads: int, when: str, path: Path) -> str:
    return (f"measured 1024x1024 {precision} matmul, best of 5, {threads} threads, on {when} "
            f"(shared by every run on this machine: {path})")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware(device: torch.device) -> dict:
    info = {"hostname": socket.gethostname(), "cpu": cpu_name(), "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "device_type": device.type,
            # On a shared machine, the load while the run ended says how noisy its timings may be.
            "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    if device.type == "cuda":
        info.update(device=torch.cuda.get_device_name(device), device_count=torch.cuda.device_count(),
                    allocator=cuda_allocator_settings() or "PyTorch's default")
    else:
        info.update(device=f"CPU ({info['cpu']})", device_count=1)
    return info


def versions() -> dict:
    import tokenizers

    v = {"python": platform.python_version(), "torch": torch.__version__, "tokenizers": tokenizers.__version__,
         "numpy": np.__version__, "hpcbert": __version__}
    if torch.cuda.is_available():
        v.update(cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())))
    return v


def git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return None
