"""Policies applied to a model from outside: gradient checkpointing, precision, compile.

The model has one forward path. Checkpointing wraps chosen encoder layers in place with PyTorch's
own `checkpoint_wrapper` (the one torchtitan and FSDP use), which keeps state_dict keys unchanged,
so checkpoints and HF weights load the same with or without it. What a wrapped layer keeps for
backward is the policy:

    alternate, all, every:K  its input only; the whole layer is recomputed in backward (`all`
                             wraps the embeddings too: they keep their ids, not the fp32 sum,
                             LayerNorm input and dropout mask of every token)
    selective                (every layer) the outputs of its matmuls (Q/K/V, output projection,
                             feed-forward) and on CPU the attention's output, probabilities and
                             dropout mask (as bits) and the other dropout masks; the rest (GELU,
                             LayerNorm, residual sums, applying the masks; on CUDA the attention and
                             the masks' draws too) is recomputed: PyTorch's selective activation
                             checkpointing
    offload                  (every layer, CUDA) everything, in pinned host memory: copied out during
                             forward, back for backward (torch.autograd.graph.save_on_cpu)
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .config import parse_grad_ckpt
from .model import CPU_OPERATORS

POLICIES = ("none", "alternate", "all", "selective", "offload")  # the named ones; every:K besides


def ckpt_layer_indices(policy: str, num_layers: int) -> list[int]:
    """Encoder layers to wrap. alternate = every second layer (0, 2, 4, ...), what the HPC-AI 2020
    kit's modeling_v2 did; every:K = layers 0, K, 2K, ...; all, selective, offload = every layer."""
    policy = parse_grad_ckpt(policy)
    if policy == "auto":
        raise ValueError("grad_ckpt: 'auto' is resolved by the planner (hpcbert plan) before the model is wrapped")
    if policy == "none":
        return []
    k = {"all": 1, "selective": 1, "offload": 1, "alternate": 2}.get(policy) or int(policy.split(":")[1])
    return [i for i in range(num_layers) if i % k == 0]


def _checkpoint_in_training(module: nn.Module, *args, **kwargs):
    # Recompute only when it can pay off: in training with autograd on. Evaluation and no_grad
    # run the layer directly. Non-reentrant (the supported implementation) and RNG state
    # preserved, so dropout masks replay identically in the recomputation.
    if module.training and torch.is_grad_enabled():
        return checkpoint(module, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
    return module(*args, **kwargs)


# Selective: what a layer keeps. Matmuls are worth keeping (their recomputation is most of a
# forward); the element-wise work between them is cheap to redo. On CPU two operators are kept
# whole as well: the attention (`hpcbert::cpu_attention`: its output, the probabilities and the
# dropout mask) and the dropout masks (`hpcbert::keep_mask`). Redoing them is what made
# selective cost 1.15-1.27x none's step there: for one minilm-l6 layer at batch 32, length 128
# (bf16, 2-core EPYC) the attention mask's draw took 3.0 ms, softmax 2.2, applying the mask 0.8
# and the two hidden masks' draws 1.5, against 0.7 for GELU and 0.5 for both LayerNorms. The
# attention mask is kept as bits (wrap_layers sets pack_dropout_mask): as bytes selective would
# keep ~0.78x none's bytes at length 128 and ~0.88x at 512. Random draws are kept all or none:
# the recomputation replays the generator from the layer's start, so keeping one draw and
# redrawing a later one would shift it. On CPU every draw is in those two operators (kept); on
# CUDA dropout and flash attention draw and are both recomputed.
_KEEP = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default, *CPU_OPERATORS}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_in_training(module: nn.Module, *args, **kwargs):
    if module.training and torch.is_grad_enabled():
        return checkpoint(module, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, _selective_policy),
                          **kwargs)
    return module(*args, **kwargs)


def _offload_in_training(module: nn.Module, *args, **kwargs):
    if module.training and torch.is_grad_enabled():
        # Pinned host memory so the copies overlap with compute (non-blocking); CPU-only tests
        # run it unpinned (torch cannot pin without CUDA).
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return module(*args, **kwargs)
    return module(*args, **kwargs)


def wrap_layers(model: nn.Module, policy: str) -> list[int]:
    """Wrap the chosen layers of `model.bert.encoder.layer` in place; returns their indices. Under
    `all` the embeddings are wrapped as well: once every layer keeps only its input, the embeddings'
    own saved tensors (an fp32 sum for LayerNorm and a dropout mask per token, ~17% of what `all`
    keeps at bf16) are what is left, and recomputing them is a gather and one LayerNorm."""
    layers: nn.ModuleList = model.bert.encoder.layer  # type: ignore[assignment]
    if any(isinstance(l, CheckpointWrapper) for l in layers) or isinstance(model.bert.embeddings, CheckpointWrapper):
        raise RuntimeError("gradient checkpointing is already applied to this model")
    policy = parse_grad_ckpt(policy)
    fn = {"selective": _selective_in_training, "offload": _offload_in_training}.get(policy, _checkpoint_in_training)
    chosen = ckpt_layer_indices(policy, len(layers))
    for i in chosen:
        layers[i].attention.self.pack_dropout_mask = policy == "selective"
        layers[i] = checkpoint_wrapper(layers[i], checkpoint_fn=fn)
    if policy == "all":
        model.bert.embeddings = checkpoint_wrapper(model.bert.embeddings, checkpoint_fn=fn)
    return chosen


def unwrap_layers(model: nn.Module) -> None:
    """Undo `wrap_layers` in place: every encoder layer runs plainly again (the same modules and
    parameters; `hpcbert bench` switches policies on one model between steps)."""
    layers: nn.ModuleList = model.bert.encoder.layer  # type: ignore[assignment]
    for i, layer in enumerate(layers):
        if isinstance(layer, CheckpointWrapper):
            layers[i] = layer._checkpoint_wrapped_module
            layers[i].attention.self.pack_dropout_mask = False
    if isinstance(model.bert.embeddings, CheckpointWrapper):
        model.bert.embeddings = model.bert.embeddings._checkpoint_wrapped_module


def apply_grad_ckpt(model: nn.Module, policy: str) -> list[int]:
    """`wrap_layers`, after checking that the policy can run on the model's device."""
    device = next(model.parameters()).device
    if parse_grad_ckpt(policy) == "offload" and device.type != "cuda":
        raise ValueError(f"grad_ckpt: offload keeps saved activations in host memory while a GPU computes; on "
                         f"{device.type} they are in host memory already (use none, selective, alternate or all)")
    return wrap_layers(model, policy)


def device_has_native_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        # Native bf16 tensor cores from Ampere (compute capability 8.0). Volta (7.0) and Turing
        # (7.5) emulate it, and torch.cuda.is_bf16_supported() counts emulation as support.
        return torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type == "cpu":
        # oneDNN reports bf16 support only where the CPU has AVX512-BF16 or AMX; elsewhere bf16
        # matmuls are emulated and far slower than fp32 (measured: 1.3 vs 160 GFLOP/s on AVX2).
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return False
    return False


def resolve_precision(precision: str, device: torch.device) -> str:
    """'auto' -> bf16 where the device has native bf16, else fp32. fp16 needs CUDA."""
    if precision == "auto":
        return "bf16" if device_has_native_bf16(device) else "fp32"
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("precision: fp16 autocast needs a CUDA device; on CPU use bf16 or fp32")
    return precision


def enable_tf32(precision: str, device: torch.device) -> bool:
    """fp32 on Ampere and later: let matmuls and convolutions use TF32 tensor cores (10-bit
    mantissa inputs, fp32 accumulation), as PyTorch Lightning, timm and the HF Trainer's --tf32 do.
    Returns whether TF32 is on (recorded in the summary)."""
    on = precision == "fp32" and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)
    if on:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return on


def autocast(precision: str, device: torch.device):
    """Mixed-precision context for the forward pass (weights stay fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """Dynamic loss scaler for fp16; a disabled (pass-through) scaler otherwise."""
    return torch.amp.GradScaler(device.type, enabled=(precision == "fp16"))


# --compile auto, per device type: on only where it was measured faster than eager (benchmarks/
# compare_hf.py compile) and exact (same losses, tests/test_trainer.py). Neither is yet: the encoder's
# attention is a graph break (a loop over host lengths), and no GPU was measured; off until one is.
COMPILE_AUTO = {"cpu": False, "cuda": False}


def resolve_compile(mode: str, device: torch.device) -> bool:
    """--compile on | off | auto -> whether to compile."""
    return mode == "on" or (mode == "auto" and COMPILE_AUTO.get(device.type, False))


def maybe_compile(model: nn.Module, enabled: bool) -> nn.Module:
    # dynamic=True: batches are padded to their longest sequence, so T varies from step to step
    # (and the number of real tokens with it). Attention is a graph break (model.attention).
    return torch.compile(model, dynamic=True) if enabled else model
