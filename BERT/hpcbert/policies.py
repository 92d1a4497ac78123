"""Policies applied to a model from outside: gradient checkpointing, precision, compile.

The model has one forward path. Checkpointing wraps chosen encoder layers in place with PyTorch's
own `checkpoint_wrapper` (the one torchtitan and FSDP use), which keeps state_dict keys unchanged,
so checkpoints and HF weights load the same with or without it. What a wrapped layer keeps for
backward is the policy:

    all, every:K             its input only; the layer is recomputed in backward (`all`
                             wraps the embeddings too: they keep their ids, not the fp32 sum,
                             LayerNorm input and dropout mask of every token). On CPU a wrapped
                             layer but the last also keeps, for its last LayerNorm's backward, that
                             LayerNorm's output and 1/std per token, so that its recomputation
                             stops before the feed-forward's second matmul; so does a plain layer
                             before a wrapped one, instead of the LayerNorm's input and dropout
                             mask (the mask as bits). Under `all` the output is the next layer's
                             input, kept anyway; under every:K the plain layers' savings pay for
                             it. On CPU a wrapped layer keeps its dropout masks as bits (1/16 of
                             the probabilities' or the activation's bytes at bf16), which the
                             recomputation takes instead of drawing them again
    alternate                layers 0, 2, 4, ... (the 2020 kit's choice, every:2's) are recomputed
                             from their input, but only their attention (the Q projection,
                             attention, output projection, LayerNorm): they keep their
                             feed-forward's tensors (a GELU's output excepted), their attention's
                             K and V (model._KvKeepingLinear: 2H a token, so that the
                             recomputation computes Q alone) and, on CPU, the attention's and
                             output projection's dropout masks as bits, which the recomputation
                             takes instead of drawing them again. The other layers keep what
                             `selective` keeps. About every:2's bytes; it reruns 4h^2 + 4sh of a
                             layer's 8h^2 + 4hI + 4sh matmul FLOPs per token (bert-base, length
                             128: 19%, every:2 68%; hpcbert.plan)
    selective                (every layer) what none keeps, less what is cheap to redo from what
                             it keeps anyway: a GELU's output (from its input, the feed-forward's
                             matmul output, which the GELU's backward keeps) and a LayerNorm's
                             output or its bf16/fp16 copy for the next matmul (from the LayerNorm's
                             input, weight and bias, which its backward keeps); on CPU the
                             attention's dropout mask is kept as bits. Backward recomputes those
                             tensors when it reaches them, by autograd's saved-tensor hooks: no
                             matmul, attention or random draw runs again
    offload                  (every layer, CUDA) everything, in pinned host memory: copied out during
                             forward, back for backward (torch.autograd.graph.save_on_cpu)
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from pathlib import Path

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint

from .config import NORM_PRECISIONS, parse_grad_ckpt

POLICIES = ("none", "alternate", "all", "selective", "offload")  # the named ones; every:K besides


def ckpt_layer_indices(policy: str, num_layers: int) -> list[int]:
    """Encoder layers to wrap with the policy's recomputation. alternate = every second layer (0, 2,
    4, ...), what the HPC-AI 2020 kit's modeling_v2 did (every:2 does what it did: recomputes them
    whole); every:K = layers 0, K, 2K, ...; all, selective, offload = every layer."""
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


# Selective: what a layer does not keep. PyTorch's selective activation checkpointing (SAC: a
# dispatch mode around every operator of the layer, each one's output kept or recomputed by a
# policy; this project's selective until it was measured) kept the matmuls' outputs, the attention
# and the dropout masks, 0.70-0.72x none's bytes, but cost 1.09-1.16x none's step on a bf16 CPU:
# 7-10% of that was the mechanism (a policy keeping every operator's output cost 1.07-1.10x), ~2%
# the recomputation. Choosing among the tensors autograd saves costs one Python call per saved
# tensor instead of one per operator: 0.98-1.04x at 0.69-0.71x the bytes (results/pareto/).
# Only deterministic work is redone, from tensors the graph keeps in any case, so the recomputed
# values are the forward's bit for bit and nothing random is drawn again (no RNG replay).
class _Recompute:
    """A saved tensor's recipe: fn(*args) under no_grad and without autocast gives it again."""

    __slots__ = ("fn", "args")

    def __init__(self, fn, args):
        self.fn, self.args = fn, args


def _gelu(x, approximate):
    return torch.nn.functional.gelu(x, approximate=approximate)


def _layer_norm(x, shape, weight, bias, eps, dtype):
    return torch.nn.functional.layer_norm(x, shape, weight, bias, eps).to(dtype)


class _SelectiveHooks:
    """pack/unpack for `torch.autograd.graph.saved_tensors_hooks` around each layer of `model`.

    pack sees each tensor autograd saves. A GELU's output (its node keeps the GELU's input) and a
    LayerNorm's output, or a cast of it (its node keeps the LayerNorm's input, weight and bias), are
    replaced by a recipe; every other tensor is kept as it is. eps is not kept by autograd: it comes
    from the model's LayerNorm module of that weight (by storage, refreshed if the model moved)."""

    def __init__(self, model: nn.Module, layer_norms: bool = True):
        self.model = weakref.ref(model)  # the model holds these hooks (through its wrapped layers)
        self.eps: dict[int, float] = {}
        # False: GELU outputs only. Inside a checkpointed layer a LayerNorm's saved input may be the
        # checkpoint's (to be recomputed in backward), so no recipe may read it during forward.
        self.layer_norms = layer_norms

    def _eps_of(self, weight: torch.Tensor) -> float | None:
        node = weight.grad_fn
        if type(node).__name__ == "ToCopyBackward0":  # a low-precision LayerNorm's cast of its weight (CUDA)
            weight = getattr(node.next_functions[0][0], "variable", weight)
        key = weight.untyped_storage()._cdata
        if key not in self.eps:
            self.eps = {m.weight.untyped_storage()._cdata: m.eps for m in self.model().modules()
                        if isinstance(m, nn.LayerNorm) and m.weight is not None}
        return self.eps.get(key)

    def _layer_norm_recipe(self, node, dtype: torch.dtype):
        weight = node._saved_weight
        eps = None if weight is None else self._eps_of(weight)
        if eps is None:
            return None
        return _Recompute(_layer_norm, (node._saved_input, tuple(node._saved_normalized_shape), weight,
                                        node._saved_bias, eps, dtype))

    def pack(self, t: torch.Tensor):
        node = t.grad_fn
        kind = type(node).__name__ if node is not None else None
        recipe = None
        if kind == "GeluBackward0":
            recipe = _Recompute(_gelu, (node._saved_self, node._saved_approximate))
        elif not self.layer_norms:
            return t.detach()
        elif kind == "NativeLayerNormBackward0":
            recipe = self._layer_norm_recipe(node, t.dtype)
        elif kind == "ToCopyBackward0" and type(node.next_functions[0][0]).__name__ == "NativeLayerNormBackward0":
            recipe = self._layer_norm_recipe(node.next_functions[0][0], t.dtype)
        # Kept: detached. A tensor an operation saves may be its own output (flash attention's, on
        # CUDA), whose grad_fn is the node that holds what pack returns: returned as it is, node and
        # tensor would hold each other, a cycle through C++ that Python's gc cannot free. backward
        # breaks it, so training never saw it; a graph dropped without backward (a step that ran out
        # of memory) kept its activations for good, and every later probe of a batch failed. The
        # unpacked tensor gets its grad_fn back from autograd (PyTorch's documented pack hooks detach too).
        return t.detach() if recipe is None else recipe

    @staticmethod
    def unpack(packed):
        if isinstance(packed, _Recompute):
            with torch.no_grad(), torch.autocast(packed.args[0].device.type, enabled=False):
                return packed.fn(*packed.args)
        return packed


def _selective_in_training(module: nn.Module, *args, hooks: _SelectiveHooks, **kwargs):
    if module.training and torch.is_grad_enabled():
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            return module(*args, **kwargs)
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
    fn = {"selective": functools.partial(_selective_in_training, hooks=_SelectiveHooks(model)),
          "offload": _offload_in_training}.get(policy, _checkpoint_in_training)
    chosen = ckpt_layer_indices(policy, len(layers))
    if fn is _checkpoint_in_training:
        # Which layers' last LayerNorm keeps its output for backward (model._NormKeepingOutput): a
        # wrapped layer, to stop its recomputation before its last matmul, and a plain layer whose
        # output the next (wrapped) layer keeps, to keep less. Not the last layer: a span head's
        # output is every token's, kept in addition.
        for i in range(len(layers) - 1):
            layers[i].output.keep_output_only = i in chosen or i + 1 in chosen
    if policy == "alternate":
        # The recomputed layers keep their feed-forward's saved tensors (a GELU's output excepted,
        # redone from its input) and their attention's K and V, and recompute their attention
        # only: the Q projection, attention, output projection and LayerNorm. The other layers keep
        # what `selective` keeps. What the first keep and the second stop keeping are about equal
        # (results/pareto/: bytes about every:2's).
        ffn = _SelectiveHooks(model, layer_norms=False)
        plain = functools.partial(_selective_in_training, hooks=_SelectiveHooks(model))
        for i in range(len(layers)):
            if i in chosen:
                layers[i].ffn_hooks = (ffn.pack, ffn.unpack)
                layers[i].attention.self.keep_kv = True
            else:
                layers[i].attention.self.pack_dropout_mask = True
                layers[i] = checkpoint_wrapper(layers[i], checkpoint_fn=plain)
    recomputes = policy not in ("selective", "offload")
    for i in chosen:
        # A recomputed attention (alternate, all, every:K) takes its dropout mask from the forward's
        # bits (1/16 of P's bytes at bf16), held past the checkpoint, instead of drawing it again
        # (a quarter of the layer's attention time on CPU; a GPU's flash kernel redraws it for free);
        # so do the other dropouts a recomputation runs again (the output projection's; the
        # feed-forward's where it is recomputed: not under alternate; the embeddings' under all):
        # 1/16 of the activation's bytes at bf16 each, against 0.8 ms to draw one again
        # (minilm-l6, batch 32, length 128)
        layers[i].attention.self.pack_dropout_mask = policy != "offload"
        layers[i].attention.self.reuse_dropout_mask = recomputes
        layers[i].attention.output.reuse_dropout_mask = recomputes
        layers[i].output.reuse_dropout_mask = recomputes and policy != "alternate"
        layers[i] = checkpoint_wrapper(layers[i], checkpoint_fn=fn)
    if policy == "all":
        model.bert.embeddings.reuse_dropout_mask = True
        model.bert.embeddings = checkpoint_wrapper(model.bert.embeddings, checkpoint_fn=fn)
    return chosen


def unwrap_layers(model: nn.Module) -> None:
    """Undo `wrap_layers` in place: every encoder layer runs plainly again (the same modules and
    parameters; `hpcbert bench` switches policies on one model between steps)."""
    layers: nn.ModuleList = model.bert.encoder.layer  # type: ignore[assignment]
    for i, layer in enumerate(layers):
        if isinstance(layer, CheckpointWrapper):
            layers[i] = layer._checkpoint_wrapped_module
            layers[i].attention.self.pack_dropout_mask = layers[i].attention.self.reuse_dropout_mask = False
            layers[i].attention.self.keep_kv = False
        layers[i].attention.output.reuse_dropout_mask = layers[i].output.reuse_dropout_mask = False
        layers[i].output.keep_output_only = False
        layers[i].ffn_hooks = None
    if isinstance(model.bert.embeddings, CheckpointWrapper):
        model.bert.embeddings = model.bert.embeddings._checkpoint_wrapped_module
    model.bert.embeddings.reuse_dropout_mask = False


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


def norm_precision(model: nn.Module, which: str) -> None:
    """Under bf16/fp16 autocast, every LayerNorm of `model` in autocast's dtype (low: Composer's
    LowPrecisionLayerNorm, model.LayerNorm) or in fp32 as autocast's own rule has it (fp32: as
    Hugging Face's BERT runs)."""
    from .model import LayerNorm

    if which not in NORM_PRECISIONS:
        raise ValueError(f"norm_precision: {which!r} is not one of {', '.join(NORM_PRECISIONS)}")
    for m in model.modules():
        if isinstance(m, LayerNorm):
            m.low_precision = which == "low"


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
# compare_hf.py compile) and exact (same losses, tests/test_trainer.py). On CPU the encoder's
# attention is a graph break in every layer (a loop over host lengths), measured 1.01x: off. On an
# H200 (results/gpu/, bert-base, length 128, grad_ckpt none) the model compiles whole and ran 1.21x
# eager's sequences/s at batch 256 and 1.07x at 1024, its gradients within bf16 rounding of the
# CPU model's (tests/test_unpad.py); compiled with a checkpointing policy or fp16's loss scaler it
# has not run on a GPU yet, so auto stays off there too and --compile on is the GPU advice.
COMPILE_AUTO = {"cpu": False, "cuda": False}


# --token-multiple's default, by device type and whether the run's matmuls are in reduced precision
# (bf16/fp16 autocast); 1 (no filler) where absent (config.RunConfig.token_multiple).
# - CPU, bf16: oneDNN builds a matmul for each new shape; with filler rows to a multiple of 32 the
#   same batches trained 1.027x as fast at lengths 8-128 and 1.055x at 8-40 (64: 1.039x, 1.036x;
#   minilm-l6, batch 32; benchmarks/bench_token_multiple.py, results/token_multiple/; two earlier
#   runs gave 1.016-1.027x and 1.027-1.045x for 32). 32 wastes fewer rows on short batches. In fp32
#   (MKL) the filler rows are work with nothing to win back: 0.986x with 64 (one run of 40 batches
#   at 8-128, `--precision fp32 --multiples 1,64`, not committed).
# - CUDA: a matmul at a row count met before costs 21-29 us of host time a call, one at a new row
#   count 100-200 us, up to 10 ms where the call waits for cuBLAS to load a kernel (benchmarks/gpu.py
#   hostcost, H200); filler to 64 measured +5% (batch 256) and +2% (batch 1024) sequences/s there,
#   one run each, bf16. Their gradients, eager and compiled, in bf16 and fp32, match the CPU model's
#   on an H200 (tests/test_unpad.py::test_cuda_kernels_match_the_cpu_model, results/gpu/pytest-10-*).
#   In fp32 on a GPU filler is not measured: 1 there, as on CPU.
TOKEN_MULTIPLE_AUTO: dict[tuple[str, bool], int] = {("cpu", True): 32, ("cuda", True): 64}


def resolve_token_multiple(value: int | None, device: torch.device, precision: str) -> int:
    """--token-multiple N, or the default for the device and the resolved precision where not given."""
    return value if value is not None else TOKEN_MULTIPLE_AUTO.get((device.type, precision != "fp32"), 1)


def resolve_compile(mode: str, device: torch.device) -> bool:
    """--compile on | off | auto -> whether to compile."""
    return mode == "on" or (mode == "auto" and COMPILE_AUTO.get(device.type, False))


# Inductor settings under --compile, where the torch in use has them. A size threshold inductor
# tests on a dynamic size becomes a guard, and a batch on its other side compiles the model again
# (tens of seconds on a GPU). Seen on an H200 (torch 2.11, results/gpu/run-mfu-mlm-compile-a32faf0.log):
# mix-order reduction (a LayerNorm backward's two reductions fused) is only tried above 5 Mi
# elements, `768 * rows >= 5242880`, so a batch of short sequences recompiled. Non-strict mode drops
# those size tests (the fusion is then also tried on small batches, where the whole tensor fits in L2).
INDUCTOR_OPTIONS = {"triton.mix_order_reduction_non_strict_mode": True}


def inductor_options() -> dict:
    """INDUCTOR_OPTIONS that this torch's inductor knows (the names are inductor's own, and move)."""
    import torch._inductor

    known = set(torch._inductor.list_options())
    return {k: v for k, v in INDUCTOR_OPTIONS.items() if k in known}


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (dynamo's count; a recompile is one more)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def use_compile_cache(folder: str | None) -> None:
    """--compile-cache: torch.compile's graphs and kernels kept in `folder` (inductor reads
    TORCHINDUCTOR_CACHE_DIR when it first looks for its cache, at the first compile)."""
    if folder:
        path = Path(folder).expanduser().resolve()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"compile_cache: {folder} cannot be a folder here ({e.strerror}: {e.filename}); "
                             f"give a folder this job can write") from None
        if not os.access(path, os.W_OK):
            raise ValueError(f"compile_cache: {folder} is not writable; give a folder this job can write")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)


def compile_cache_use() -> dict:
    """What this process's compiles took from torch.compile's cache and what they compiled anew
    (inductor's and AOT autograd's counters), and the cache's folder."""
    from torch._dynamo.utils import counters

    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        folder = cache_dir()
    except (ImportError, OSError):  # a torch that keeps it elsewhere
        folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return {"dir": folder,
            "graphs_from_cache": int(counters["inductor"]["fxgraph_cache_hit"]),
            "graphs_compiled": int(counters["inductor"]["fxgraph_cache_miss"]),
            "autograd_from_cache": int(counters["aot_autograd"]["autograd_cache_hit"]),
            "autograd_compiled": int(counters["aot_autograd"]["autograd_cache_miss"])}


def compile_options(mode: str = "default") -> dict:
    """Inductor's options for torch.compile `mode` (config.TORCH_COMPILE_MODES), with INDUCTOR_OPTIONS:
    torch.compile takes a mode or options, not both, so the mode comes as the options it stands for."""
    import torch._inductor

    return {**(torch._inductor.list_mode_options(mode, dynamic=True) if mode != "default" else {}),
            **inductor_options()}


def maybe_compile(model: nn.Module, enabled: bool, mode: str = "default") -> nn.Module:
    # dynamic=True: batches are padded to their longest sequence, so T varies from step to step
    # (and the number of real tokens with it). On CPU attention is a graph break (model.attention).
    # The training loop gives every batch an index (Batch.to's always_index), one layout.
    return torch.compile(model, dynamic=True, options=compile_options(mode) or None) if enabled else model
