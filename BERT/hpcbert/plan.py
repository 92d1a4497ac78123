"""`hpcbert plan`: the largest batch each checkpointing policy fits into a device's memory, and the
fastest policy and batch, predicted before a run starts.

    memory(policy, b) = held + max(step(policy, b), after backward)
      held         parameters (fp32) + optimizer state (AdamW and LAMB: two fp32 moments), and the
                   gradients (fp32) where they stay allocated through the step: under DDP (its
                   buckets, of which hpcbert's gradients are views) and with --grad-accum > 1. One
                   process without accumulation sets them to None before each forward
      step         the most bytes a forward and backward hold beside them after any operation
                   (meters.trace_step), counted on the whole model built in PyTorch's FakeTensorMode:
                   shapes and dtypes without memory or compute, so bert-large at 512 is traced in
                   seconds on any machine. Each operation's bytes are a line in b (traced at two
                   batches): what grows with the batch (the activations saved for backward, what
                   backward holds beyond them: the gradients in flight, a recomputed layer's
                   activations, the CPU attention's (L, L) gradients, a masked-LM head's logits) and
                   what does not (autocast's low-precision weight copies, the gradients computed so
                   far). With a large batch the peak falls early in backward, beside few gradients;
                   with a small one late, beside most. On CPU glibc's bytes in use at the peak of a
                   real step match it within 0.3% for every policy, one process, accumulating or
                   under DDP (tests/test_plan.py, bert-tiny, batches 48 and 2); the plan up to
                   7bdcf59, which held every gradient and autocast's copies beside any batch, was
                   14-18% over one process's at batch 48.
      after backward  the gradients (where not held) and what clipping and the optimizer's step
                   allocate (plan.measure_optimizer_step: a parameter-sized buffer for LAMB)
      activations  (the table) bytes per sequence the forward keeps for backward at --max-seq-length,
                   as the run's summary counts them (meters.activation_bytes_per_sequence)
      workspace    (the table) what backward holds beyond them at its peak, per sequence
                   (StepMemory.workspace_per_sequence). On CUDA kernels' own buffers and the caching
                   allocator's rounding are not storages an operation returns, so they are not in
                   the count; should the count fail there, the plan takes one plain layer's bytes
                   (two where a layer recomputes its forward) beside the whole state
    evaluation(b) = held between steps + eval(b)
      held between steps  parameters, optimizer state, and under DDP its buckets' gradient bytes
      eval         the most bytes an evaluation batch (--eval-batch-size, unless --no-do-eval) holds
                   after any operation of its forward (without autograd, dropout off, every sequence
                   at --max-seq-length) and the objective's predictions on the device
                   (meters.trace_evaluation). A batch that does not fit is reported, and
                   --batch-size auto lowers --eval-batch-size to the largest that does.
    A fraction of the memory (5% on CUDA, for the allocator's fragmentation) is kept free.
    offload also keeps, per sequence, what it moves out (none's activations minus its own) in pinned
    host memory: its largest batch is also bounded by HOST_SHARE of the host's available memory.

    time(policy, b) = b x t_seq x cost(policy) + t_opt, throughput = b / time
      t_seq   training FLOPs of one sequence (model.flops_per_sequence) / (peak FLOP/s x 0.5)
      cost    1 + forward FLOPs recomputed / training FLOPs: a layer recomputed whole reruns its
              forward, 1/3 of its training FLOPs, less on CPU its feed-forward's second matmul
              (every wrapped layer but the last: model._NormKeepingOutput);
              selective recomputes no matmul (cost 1)
      offload per sequence max(compute, the saved bytes out to the host and back over its link)
      t_opt   the optimizer's memory traffic (read and write parameters, gradients and both
              moments: 32 bytes per parameter) / the device's memory bandwidth
    The recommendation is the smallest batch within 2% of the highest predicted throughput (any
    policy at its largest batch; a bigger batch only amortises t_opt further), with the cheapest
    policy that reaches it: none wherever the batch fits without recomputation.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import re
import sys
from dataclasses import dataclass

from . import config
from .config import RunConfig

PLAN_POLICIES = ("none", "selective", "alternate", "all", "offload")
MFU_ASSUMED = 0.5          # share of the peak a training step reaches (for the time model only)
FRAGMENTATION = 0.05       # CUDA: memory kept free for the caching allocator
WITHIN = 0.02              # the recommended batch: the smallest within this of the best throughput
OPT_BYTES_PER_PARAM = 32   # optimizer step traffic: read + write of parameter, gradient, two moments
HOST_SHARE = 0.5           # offload: share of the host's available memory its pinned activations may take

# Device memory bandwidth (data sheets) and host link (PCIe x16, usable one way) for the time model.
GPU_BANDWIDTH = [(r"H200", 4.8e12, 50e9), (r"H100.*NVL", 3.9e12, 50e9), (r"H100.*PCIe", 2.0e12, 50e9),
                 (r"H100", 3.35e12, 50e9), (r"A100", 2.0e12, 25e9), (r"L40S", 0.864e12, 25e9),
                 (r"A10G?(?![0-9])", 0.6e12, 25e9), (r"V100", 0.9e12, 12e9), (r"T4(?![0-9])", 0.32e12, 12e9)]


def parse_bytes(text: str) -> int:
    """'40GiB', '80GB', '512MiB', '1e9' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"memory: cannot read {text!r}; accepted: a number of bytes or one with a unit "
                         f"(40GiB, 80GB, 512MiB)")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * scale)


@dataclass
class PolicyPlan:
    policy: str
    activation_bytes_per_sequence: int | None  # None: the policy cannot run on this device
    workspace_bytes_per_sequence: int | None
    largest_batch: int                         # 0: not even one sequence fits
    cost: float | None                         # step time vs none at equal batch (time model)
    seq_per_s: float | None                    # predicted at the largest batch
    note: str = ""
    workspace_counted: int | None = None       # the count alone; None: it failed (CUDA plans the rule)
    step: object = dataclasses.field(default=None, repr=False, compare=False)  # meters.StepMemory; None: the rule


@dataclass
class Plan:
    model: str
    max_seq_length: int
    precision: str
    optimizer: str
    device: str
    memory_bytes: int
    state_bytes: dict[str, int]
    policies: list[PolicyPlan]
    best_policy: str | None
    best_batch: int
    t_seq: float   # predicted seconds per sequence without recomputation
    t_opt: float   # predicted seconds of an optimizer step
    ddp: bool = True               # DDP's buckets hold the gradients' bytes, through the step and between steps
    grad_accum: int = 1            # micro-batches per step (more than 1: the gradients held through the step)
    optimizer_step_bytes: int = 0  # what the optimizer's step allocates beyond its state
    eval_batch_size: int = 0       # the evaluation planned (--eval-batch-size); 0: none (--no-do-eval)
    eval_largest_batch: int = 0    # the largest evaluation batch that fits
    evaluation: object = dataclasses.field(default=None, repr=False, compare=False)  # meters.StepMemory; None: not counted
    evaluation_note: str = ""

    @property
    def state_total(self) -> int:
        return sum(self.state_bytes.values())

    @property
    def gradients_held(self) -> bool:
        """The gradients' bytes held through the step: under DDP (its buckets) and with --grad-accum > 1."""
        return self.ddp or self.grad_accum > 1

    @property
    def held_bytes(self) -> int:
        """What stays allocated through every step: parameters and optimizer state, and the
        gradients where they are held (DDP's buckets, accumulation)."""
        return (self.state_bytes["parameters"] + self.state_bytes["optimizer"]
                + (self.state_bytes["gradients"] if self.gradients_held else 0))

    def memory(self, policy: str, b: int) -> int:
        """Predicted bytes at the peak of a training step at batch b: what is held, and the most of
        the step's own (the forward's and backward's, or after backward the gradients beside the
        optimizer's step), or, where the count failed, the whole state beside b times the saved and
        workspace bytes per sequence."""
        p = self.get(policy)
        if p.step is None:
            return self.state_total + b * (p.activation_bytes_per_sequence + p.workspace_bytes_per_sequence)
        after = (0 if self.gradients_held else p.step.gradients) + self.optimizer_step_bytes
        return self.held_bytes + max(p.step.peak(b), after)

    @property
    def held_between_steps(self) -> int:
        """What stays allocated between steps, where an evaluation runs: parameters and optimizer
        state, and the gradients' bytes under DDP (its buckets; the gradients themselves are None)."""
        return (self.state_bytes["parameters"] + self.state_bytes["optimizer"]
                + (self.state_bytes["gradients"] if self.ddp else 0))

    def evaluation_memory(self, b: int) -> int:
        """Predicted bytes at the peak of an evaluation batch of b sequences: what is held between
        steps, and the most that the forward (without autograd, dropout off, every sequence at
        --max-seq-length) and the objective's predictions hold after any operation."""
        return self.held_between_steps + self.evaluation.peak(b)

    def get(self, policy: str) -> PolicyPlan:
        return next(p for p in self.policies if p.policy == policy)

    def table(self) -> str:
        gib = 2**30
        lines = [f"hpcbert plan: {self.model} at length {self.max_seq_length}, {self.precision}, {self.optimizer}, "
                 f"{self.memory_bytes / gib:.1f} GiB on {self.device}",
                 "state " + ", ".join(f"{k} {v / gib:.2f}" for k, v in self.state_bytes.items())
                 + f" GiB (total {self.state_total / gib:.2f} GiB)",
                 f"held through every step {self.held_bytes / gib:.2f} GiB: " + (
                     "the gradients too (DDP's buckets, accumulation; --world-size 1 without --grad-accum "
                     "plans one process, whose gradients exist from backward to the optimizer's step)"
                     if self.gradients_held else
                     "one process without accumulation: autocast's weight copies and the gradients are "
                     "the step's own, counted where the step's peak falls"), "",
                 f"{'policy':10s} {'act MiB/seq':>11s} {'workspace':>9s} {'largest batch':>13s} {'peak GiB':>8s} "
                 f"{'cost':>5s} {'pred seq/s':>10s}"]
        for p in self.policies:
            if p.activation_bytes_per_sequence is None:
                lines.append(f"{p.policy:10s} {'—':>11s} {'—':>9s} {'—':>13s} {'—':>8s} {'—':>5s} {'—':>10s}  {p.note}")
                continue
            peak = f"{self.memory(p.policy, p.largest_batch) / gib:8.2f}" if p.largest_batch else f"{'—':>8s}"
            lines.append(f"{p.policy:10s} {p.activation_bytes_per_sequence / 2**20:11.2f} "
                         f"{p.workspace_bytes_per_sequence / 2**20:9.2f} {p.largest_batch:13d} {peak} {p.cost:5.2f} "
                         f"{(p.seq_per_s or 0):10.1f}  {p.note}")
        lines.append("")
        if self.eval_batch_size and self.evaluation is None:
            lines.append(f"evaluation: not counted ({self.evaluation_note})")
        elif self.eval_batch_size:
            fits = (f"the largest that fits: {self.eval_largest_batch}" if self.eval_largest_batch >= self.eval_batch_size
                    else f"does not fit: --eval-batch-size {self.eval_largest_batch} or less"
                    + (f" (--batch-size auto sets {self.eval_largest_batch})" if self.eval_largest_batch else ""))
            lines.append(f"evaluation at --eval-batch-size {self.eval_batch_size}: peak "
                         f"{self.evaluation_memory(self.eval_batch_size) / gib:.2f} GiB; {fits}")
        if self.best_policy is None:
            lines.append("nothing fits: not one sequence with any policy (shorter --max-seq-length, smaller model, "
                         "more memory)")
        else:
            lines.append(f"fastest: --grad-ckpt {self.best_policy} --batch-size {self.best_batch} (predicted)")
        return "\n".join(lines)


def _model_config(cfg: RunConfig):
    from . import zoo

    mcfg = zoo.resolve(cfg.model, cfg.tokenizer).config
    if cfg.dropout is not None:
        mcfg = dataclasses.replace(mcfg, hidden_dropout_prob=cfg.dropout, attention_probs_dropout_prob=cfg.dropout)
    return mcfg


@contextlib.contextmanager
def _counting_model(cfg: RunConfig, policy: str, device, precision: str):
    """(model, loss_of(b), predictions_of(b)): `cfg`'s model with `policy`, built in FakeTensorMode
    (shapes and dtypes, no memory, no compute), its objective's forward and loss on b sequences at
    --max-seq-length, and its forward and predictions on them (an evaluation's batch)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from . import objectives, policies

    obj = objectives.get(cfg)
    mcfg = _model_config(cfg)
    with FakeTensorMode(), torch.random.fork_rng(devices=[]):
        with torch.device(device):
            model = obj.build_model(mcfg).train()
        policies.norm_precision(model, cfg.norm_precision)
        policies.wrap_layers(model, policy)

        def loss_of(b: int):
            batch, norm = obj.example_batch(b, cfg.max_seq_length, mcfg.vocab_size)
            batch = batch.to(device)
            with policies.autocast(precision, device):
                return obj.loss(model, obj.forward(model, batch), batch, norm)

        def predictions_of(b: int):  # as train.Trainer.evaluate runs a batch
            batch, _ = obj.example_batch(b, cfg.max_seq_length, mcfg.vocab_size)
            batch = batch.to(device)
            with policies.autocast(precision, device):
                outputs = obj.forward(model, batch)
            return obj.predict(outputs, batch)

        yield model, loss_of, predictions_of


def measure_activations(cfg: RunConfig, policy: str, device, precision: str) -> tuple[int, int, int]:
    """(activation bytes per sequence, parameters, parameters of Linear layers) of `cfg`'s model with `policy`, at
    --max-seq-length, counted in FakeTensorMode (no memory, no compute)."""
    import torch

    from . import meters

    with _counting_model(cfg, policy, device, precision) as (model, loss_of, _):
        act = meters.activation_bytes_per_sequence(model, loss_of, device)
        params = sum(p.numel() for p in model.parameters())
        lowp = sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0)
                   for m in model.modules() if isinstance(m, torch.nn.Linear))
    return act, params, lowp


def measure_step(cfg: RunConfig, policy: str, device, precision: str,
                 gradients_held: bool = False):
    """meters.StepMemory of `cfg`'s model with `policy` at --max-seq-length: the bytes a forward and
    backward hold after each operation, as a function of the batch, counted in FakeTensorMode."""
    from . import meters

    with _counting_model(cfg, policy, device, precision) as (model, loss_of, _):
        return meters.trace_step(model, loss_of, device, gradients_held=gradients_held)


def measure_evaluation(cfg: RunConfig, device, precision: str):
    """meters.StepMemory of an evaluation batch of `cfg`'s model at --max-seq-length: its forward
    without autograd in eval mode (no checkpointing applies: nothing is saved) and the objective's
    predictions on the device, counted in FakeTensorMode."""
    from . import meters

    with _counting_model(cfg, "none", device, precision) as (model, _, predictions_of):
        model.eval()
        return meters.trace_evaluation(model, predictions_of, device)


def evaluation_of(cfg: RunConfig, device, precision: str):
    """(meters.StepMemory, a note) of --do-eval's batches, or (None, why not): as step_of, the count
    failing on a GPU is reported, not raised."""
    try:
        return measure_evaluation(cfg, device, precision), ""
    except Exception as e:  # noqa: BLE001 - reported in the plan's table
        if device.type == "cpu":
            raise
        return None, f"its count failed: {type(e).__name__}: {str(e)[:120]}"


def measure_workspace(cfg: RunConfig, policy: str, device, precision: str) -> int:
    """Backward's peak beyond the saved tensors per sequence (meters.StepMemory.workspace_per_sequence) of
    `cfg`'s model with `policy` at --max-seq-length, counted in FakeTensorMode over forward and backward."""
    return measure_step(cfg, policy, device, precision).workspace_per_sequence()


def measure_optimizer_step(cfg: RunConfig, device, precision: str) -> int:
    """Bytes gradient clipping and the optimizer's step allocate beyond its state (a step after its
    first, which creates the moments), counted in FakeTensorMode: a few bytes a tensor for the
    clipping's norms (PyTorch's clip_grad_norm_, which always multiplies: hpcbert's optim.clip_grad_norm
    reads the factor on a CPU, which a fake tensor has no value for, and allocates no more), none
    for PyTorch's fused AdamW, a parameter-sized buffer for hpcbert's multi-tensor LAMB."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from . import meters, objectives
    from .optim import make_optimizer

    with FakeTensorMode(), torch.random.fork_rng(devices=[]):
        with torch.device(device):
            model = objectives.get(cfg).build_model(_model_config(cfg)).train()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt = make_optimizer(cfg, model, 1e-4, device)
        opt.step()
        with meters._StoragesCreated(device) as created:
            if cfg.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            opt.step()
    return created.peak


def workspace_rule(policy: str, per_layer: float) -> int:
    """On CUDA, the workspace per sequence planned where the count fails: one plain layer's bytes,
    twice where a layer recomputes its forward (alternate, all, every:K)."""
    return int(per_layer * (1 if policy in ("none", "offload", "selective") else 2))


def step_of(cfg: RunConfig, policy: str, device, precision: str, gradients_held: bool):
    """(meters.StepMemory, a note): the count (measure_step), on CPU and CUDA. On CPU glibc's bytes
    in use match it (tests/test_plan.py). On CUDA kernels' own buffers (cuBLAS's) and the caching
    allocator's rounding are not storages an operation returns, so the count misses them: they come
    out of the memory plan.FRAGMENTATION keeps free. On an H100 (0071d95; bert-base at length 512
    under 8 GiB, bert-large at 512 under 16 GiB) the count's batch, with the gradients counted as
    held through the step, was at or under the probed one for every policy and within 25% of it
    (1.10-1.25x; results/gpu/README.md). Should the count fail on a GPU: None, and the plan takes
    `workspace_rule` beside the whole state, and the note says so."""
    try:
        return measure_step(cfg, policy, device, precision, gradients_held), ""
    except Exception as e:  # noqa: BLE001 - reported in the plan's table, the rule stands
        if device.type == "cpu":
            raise
        return None, f"workspace by rule only (its count failed: {type(e).__name__}: {str(e)[:120]})"


def device_constants(device) -> tuple[float, float, float | None, str]:
    """(peak FLOP/s, memory bandwidth B/s, host link B/s or None, where they come from) of `device`."""
    import torch

    from . import meters

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak, src = meters.gpu_peak_flops(name, "bf16")
        for pattern, bw, link in GPU_BANDWIDTH:
            if re.search(pattern, name):
                return peak or 100e12, bw, link, f"{src}; bandwidth: data sheet"
        return peak or 100e12, 1e12, 12e9, f"{src}; bandwidth of {name} unknown: 1 TB/s assumed"
    peak, src = meters.peak_flops(device, "fp32")
    return peak, meters.cpu_bandwidth(), None, f"{src}; bandwidth: measured tensor copy"


def make_plan(cfg: RunConfig, memory_bytes: int | None = None, device=None,
              policies_: tuple[str, ...] = PLAN_POLICIES, host_bytes: int | None = None,
              world_size: int | None = 1) -> Plan:
    """The plan for `cfg`'s model, length, precision and optimizer on `device` (default: this
    process's) with `memory_bytes` (default: the device's free memory) and, for offload,
    `host_bytes` of host memory (default: the host's available memory), for `world_size` processes
    (None: not known, planned as under DDP). The gradients are held through the step under DDP
    (its buckets; hpcbert's gradients are views of them) and with --grad-accum > 1; one process
    without accumulation sets them to None before each forward, so they are allocated by backward,
    where its saved activations are being freed."""
    import torch

    from . import policies
    from .model import flops_per_sequence

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    precision = policies.resolve_precision(cfg.precision, device)
    if memory_bytes is None:
        memory_bytes = device_free_memory(device)
    usable = memory_bytes * (1 - FRAGMENTATION) if device.type == "cuda" else memory_bytes
    runnable = [p for p in policies_ if p != "offload" or device.type == "cuda"]
    measured = {p: measure_activations(cfg, p, device, precision) for p in dict.fromkeys(("none", "all", *runnable))}
    none_act, params, lowp = measured["none"]
    state = {"parameters": 4 * params, "gradients": 4 * params, "optimizer": 8 * params}
    if precision in ("bf16", "fp16"):
        state["autocast weights"] = 2 * lowp
    mcfg = _model_config(cfg)
    L = mcfg.num_hidden_layers
    per_layer = max(0, none_act - measured["all"][0]) / L  # a plain layer's bytes beyond a checkpointed one's input
    peak, bw, link, _ = device_constants(device)
    t_seq = flops_per_sequence(mcfg, cfg.max_seq_length) / (peak * MFU_ASSUMED)
    t_opt = OPT_BYTES_PER_PARAM * params / bw
    ddp = world_size is None or world_size > 1
    gradients_held = ddp or cfg.grad_accum > 1
    held = state["parameters"] + state["optimizer"] + (state["gradients"] if gradients_held else 0)
    opt_step = measure_optimizer_step(cfg, device, precision)
    plans = []
    for p in policies_:
        if p not in runnable:
            plans.append(PolicyPlan(p, None, None, 0, None, None, "CUDA only"))
            continue
        act = measured[p][0]
        step, note = step_of(cfg, p, device, precision, gradients_held)
        if step is not None:
            workspace = counted = step.workspace_per_sequence()
            after = (0 if gradients_held else step.gradients) + opt_step  # after backward, the optimizer's step
            largest = step.largest(int(usable - held)) if held + after <= usable else 0
        else:  # CUDA, the count failed: the whole state beside the saved bytes and the rule's workspace
            workspace, counted = workspace_rule(p, per_layer), None
            largest = max(0, int((usable - sum(state.values())) // (act + workspace)))
        if p == "offload":
            largest, host_note = offload_largest(largest, none_act - act, host_bytes if host_bytes is not None
                                                 else device_free_memory(torch.device("cpu")))
            note = "; ".join(n for n in (note, host_note) if n)
        seq_time = t_seq * (1.0 + recomputed_layers(p, mcfg, cfg.max_seq_length, device) / (3 * L))
        if p == "offload" and link:
            seq_time = max(seq_time, 2 * (none_act - act) / link)
        plans.append(PolicyPlan(p, act, workspace, largest, seq_time / t_seq,
                                largest / (largest * seq_time + t_opt) if largest else None, note, counted,
                                step=step))
    best, batch = choose(plans, t_seq, t_opt)
    made = Plan(cfg.model, cfg.max_seq_length, precision, cfg.optimizer, _device_name(device), int(memory_bytes),
                state, plans, best, batch, t_seq, t_opt, ddp, cfg.grad_accum, opt_step)
    if cfg.do_eval:
        made.eval_batch_size = cfg.eval_batch_size
        made.evaluation, made.evaluation_note = evaluation_of(cfg, device, precision)
        if made.evaluation is not None:
            made.eval_largest_batch = made.evaluation.largest(int(usable - made.held_between_steps))
    return made


def recomputed_layers(policy: str, mcfg, length: int, device) -> float:
    """Layers' forwards a policy reruns in backward, in matmul FLOPs: 1 per wrapped layer, less the
    share of its feed-forward's second matmul (2hI of the layer's 8h^2 + 4hI + 4sh per token)
    where its recomputation stops before it (CPU, every wrapped layer but the last:
    policies.wrap_layers); under alternate, whose wrapped layers keep their feed-forward's tensors
    and their attention's K and V, the Q and output projections and the attention, 4h^2 + 4sh."""
    from . import policies

    if policy in ("none", "selective", "offload"):
        return 0.0
    chosen = policies.ckpt_layer_indices(policy, mcfg.num_hidden_layers)
    h, i = mcfg.hidden_size, mcfg.intermediate_size
    if policy == "alternate":
        return len(chosen) * (4 * h * h + 4 * length * h) / (8 * h * h + 4 * h * i + 4 * length * h)
    second = 2 * h * i / (8 * h * h + 4 * h * i + 4 * length * h)
    stops = sum(1 for k in chosen if k < mcfg.num_hidden_layers - 1) if device.type == "cpu" else 0
    return len(chosen) - stops * second


def offload_largest(device_largest: int, host_bytes_per_sequence: int, host_bytes: int) -> tuple[int, str]:
    """offload's largest batch: what the device fits, and at most what HOST_SHARE of `host_bytes`
    holds of the activations it moves to pinned host memory; (batch, note naming the bound that won)."""
    if host_bytes_per_sequence <= 0:
        return device_largest, ""
    host_largest = int(HOST_SHARE * host_bytes // host_bytes_per_sequence)
    if host_largest < device_largest:
        return host_largest, (f"host-bound: {host_bytes_per_sequence / 2**20:.0f} MiB/seq pinned in "
                              f"{HOST_SHARE:.0%} of {host_bytes / 2**30:.0f} GiB host memory")
    return device_largest, ""


def choose(plans: list[PolicyPlan], t_seq: float, t_opt: float) -> tuple[str | None, int]:
    """(policy, batch) to recommend: the smallest batch within WITHIN of the highest predicted
    throughput (any policy at its largest batch), under the policy of lowest cost that reaches it
    (at equal cost the one listed first, so none before selective): a policy that recomputes is
    chosen only where what it fits is needed to get there."""
    ok = [p for p in plans if p.seq_per_s]
    if not ok:
        return None, 0
    target = (1 - WITHIN) * max(p.seq_per_s for p in ok)
    reach = [(p.cost, i, b, p.policy) for i, p in enumerate(ok)
             if (b := recommended_batch(p.cost * t_seq, t_opt, p.largest_batch, target))]
    _, _, batch, policy = min(reach)
    return policy, batch


def recommended_batch(seq_time: float, t_opt: float, largest: int, target: float | None = None) -> int:
    """The smallest batch b <= `largest` whose throughput b / (b seq_time + t_opt) is at least
    `target` (default: within WITHIN of the throughput at `largest`); 0 where none is."""
    if largest < 1:
        return 0
    def rate(b: int) -> float:
        return b / (b * seq_time + t_opt)

    if target is None:
        target = (1 - WITHIN) * rate(largest)
    if rate(largest) < target:
        return 0
    # b / (b s + o) >= target  <=>  b (1 - target s) >= target o; then one step either way for rounding
    b = min(largest, max(1, math.ceil(target * t_opt / (1 - target * seq_time))))
    while b > 1 and rate(b - 1) >= target:
        b -= 1
    while b < largest and rate(b) < target:
        b += 1
    return b


def _device_name(device) -> str:
    import torch

    from .meters import cpu_name

    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({cpu_name()})"


def device_free_memory(device) -> int:
    """Free memory of a CUDA device now, or the host's available memory (MemAvailable)."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ValueError("memory: cannot read the host's available memory; pass --memory")


def resolve_auto(cfg: RunConfig, device, log=print, world_size: int = 1) -> RunConfig:
    """--grad-ckpt auto and --batch-size auto, from the plan for this device's free memory and the
    run's `world_size` processes: the fastest policy (auto) or the given one, and its recommended
    batch (auto) or the given one."""
    if cfg.batch_size != "auto" and cfg.grad_ckpt != "auto":
        return cfg
    plan = make_plan(cfg, None, device, PLAN_POLICIES if cfg.grad_ckpt == "auto" else (cfg.grad_ckpt,),
                     world_size=world_size)
    if cfg.grad_ckpt == "auto":
        policy, batch = plan.best_policy, plan.best_batch
    else:
        p = plan.policies[0]
        policy, batch = p.policy, recommended_batch(p.cost * plan.t_seq, plan.t_opt, p.largest_batch)
    if not batch:
        raise ValueError(f"batch_size auto: not one sequence of {cfg.max_seq_length} tokens fits "
                         f"{plan.memory_bytes / 2**30:.1f} GiB with --grad-ckpt {cfg.grad_ckpt} (see hpcbert plan)")
    batch = batch if cfg.batch_size == "auto" else cfg.batch_size
    evaluation = ""
    if plan.evaluation is not None and plan.eval_largest_batch < plan.eval_batch_size:
        if not plan.eval_largest_batch:
            raise ValueError(f"batch_size auto: --grad-ckpt {policy} --batch-size {batch} fits, but not one evaluation "
                             f"sequence of {cfg.max_seq_length} tokens beside the optimizer's state (see hpcbert plan)")
        evaluation = f" --eval-batch-size {plan.eval_largest_batch} (the {plan.eval_batch_size} asked does not fit)"
        cfg = cfg.replace(eval_batch_size=plan.eval_largest_batch)
    log(f"plan for {plan.memory_bytes / 2**30:.1f} GiB free on {plan.device}: --grad-ckpt {policy} "
        f"--batch-size {batch}{evaluation} (hpcbert plan prints the table)")
    return cfg.replace(grad_ckpt=policy, batch_size=batch)


def add_options(p: argparse.ArgumentParser) -> None:
    config.add_arguments(p)
    p.add_argument("--memory", default=None,
                   help="device memory to plan for (40GiB, 80GB; default: this device's free memory)")
    p.add_argument("--world-size", type=int, default=None,
                   help="processes the run will have (torchrun's WORLD_SIZE): 1 plans one process, whose "
                        "gradients exist only from backward to the optimizer's step; more, or not given, "
                        "plans them held through the step, as DDP's buckets hold them")


def cli(argv: list[str]) -> int:
    from . import objectives

    p = argparse.ArgumentParser(prog="hpcbert plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(p)
    ns = p.parse_args(argv)
    try:
        memory = parse_bytes(ns.memory) if ns.memory else None
        cfg = config.from_namespace(ns)
        objectives.refuse_unread(cfg)  # the train command line it plans for, refused as train would
        if ns.world_size is not None and ns.world_size < 1:
            raise ValueError(f"--world-size: {ns.world_size}; accepted: a number of processes, 1 or more")
        print(make_plan(cfg, memory, world_size=ns.world_size).table())
    except (ValueError, FileNotFoundError) as e:
        print(f"hpcbert plan: error: {e}", file=sys.stderr)
        return 2
    return 0
