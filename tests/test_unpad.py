"""The encoder computes on real tokens only (unpadded), with fused Q/K/V and its own attention and
dropout kernels: the same loss and gradients as Hugging Face's padded BertModel, with every
checkpointing policy and under DDP; less work on padded batches; HF names on the way in and out."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from hpcbert import policies
from hpcbert.meters import activation_bytes_per_sequence
from hpcbert.model import (BertConfig, BertForSequenceClassification, Tokens, _CpuAttention, keep_mask,
                           hf_state_dict, load_pretrained, padded_attention, split_qkv)

TINY = dict(vocab_size=500, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64)
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def transformers():
    return pytest.importorskip("transformers")


def padded_batch(B: int = 6, T: int = 21):
    """Lengths with ties side by side (one attention group), a full row and a very short one."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, TINY["vocab_size"], (B, T), generator=g)
    lengths = torch.tensor([T, 13, 13, 4, T, 9])[:B]
    mask = torch.arange(T)[None, :] < lengths[:, None]
    ids[~mask] = 0
    types = torch.zeros_like(ids)
    types[:, 7:] = 1
    return ids, mask, types, torch.tensor([0, 1, 1, 0, 1, 0])[:B]


def ours_and_hf(policy: str = "none", **cfg):
    """Our model (with `policy`) and HF's BertForSequenceClassification holding the same weights."""
    tf = transformers()
    torch.manual_seed(0)
    c = {**TINY, **NO_DROPOUT, **cfg}
    ours = BertForSequenceClassification(BertConfig(**c))
    hf = tf.BertForSequenceClassification(tf.BertConfig(**c, attn_implementation="eager"))
    hf.load_state_dict(hf_state_dict(ours), strict=True)
    policies.wrap_layers(ours, policy)
    return ours.train(), hf.train()


def hf_loss_and_grads(hf, ids, mask, types, labels):
    out = hf(input_ids=ids, attention_mask=mask.long(), token_type_ids=types)
    loss = torch.nn.functional.cross_entropy(out.logits, labels, reduction="sum")
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in hf.named_parameters()}


def our_grads(m) -> dict[str, torch.Tensor]:
    """Gradients under HF names (fused Q/K/V split; checkpoint wrappers' prefix removed)."""
    return split_qkv({n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in m.named_parameters()})


def assert_same_grads(grads, ref, tol=1e-5, exact=None):
    """Every gradient within `tol` relative of the fp32 reference's. Given `exact` (the reference model's
    gradients in fp64), each gradient is instead measured against those: within `tol` relative, or no
    farther from them than twice the fp32 reference's own distance. A sum that nearly cancels (the
    next-sentence bias: its two entries are sums of p - y over the batch, ~0.003 from terms of ~0.5) is
    known in fp32 only to ~1e-5 relative, by either implementation, however right both are."""
    assert grads.keys() == ref.keys()
    # The key bias's gradient is zero in exact arithmetic (softmax ignores a constant added to a
    # row): both sides hold rounding noise there, so it is compared at the scale of the whole gradient.
    floor = 1e-6 * torch.cat([g.flatten() for g in ref.values()]).norm()
    for name, g in grads.items():
        if exact is None:
            rel = (g - ref[name]).norm() / torch.maximum(ref[name].norm(), floor)
            assert rel <= tol, f"gradient of {name} differs by {rel:.2e} relative"
            continue
        truth = exact[name]
        err = (g.double() - truth).norm()
        ref_err = (ref[name].double() - truth).norm()
        scale = torch.maximum(truth.norm(), floor.double())
        assert err <= max(tol * scale, 2 * ref_err), (
            f"gradient of {name} is {err / scale:.2e} relative from fp64 (the fp32 reference: {ref_err / scale:.2e})")


def filler_tokens(mask: torch.Tensor, multiple: int) -> Tokens:
    """The layout of `padded_batch` (81 real tokens, T = 21) with its rows rounded up to `multiple`:
    8 adds 7 filler rows (one filler sequence), 64 adds 47 (sequences of 21, 21 and 5)."""
    return Tokens.from_lengths(mask.sum(1).cpu().numpy(), mask, mask.device, multiple)


@pytest.mark.parametrize("multiple", [1, 8, 64])
@pytest.mark.parametrize("policy", ["none", "alternate", "all", "selective", "offload"])
def test_loss_and_gradients_equal_hf_padded_model(policy, multiple):
    """With and without filler rows (--token-multiple), which no head reads."""
    ours, hf = ours_and_hf(policy)
    ids, mask, types, labels = padded_batch()
    ref_loss, ref_grads = hf_loss_and_grads(hf, ids, mask, types, labels)
    loss = ours.loss_sum(ours(ids, filler_tokens(mask, multiple), types), labels)
    loss.backward()
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    assert_same_grads(our_grads(ours), ref_grads)


@pytest.mark.parametrize("multiple", [1, 64])
def test_sequence_output_is_hf_at_real_tokens_and_zero_at_padding(multiple):
    ours, hf = ours_and_hf()
    ours.eval(), hf.eval()
    ids, mask, types, _ = padded_batch()
    with torch.no_grad():
        seq, pooled = ours.bert(ids, filler_tokens(mask, multiple), types)
        ref = hf.bert(input_ids=ids, attention_mask=mask.long(), token_type_ids=types)
    assert (seq - ref.last_hidden_state)[mask].abs().max() <= 1e-5
    assert (pooled - ref.pooler_output).abs().max() <= 1e-5
    assert seq[~mask].abs().max() == 0


def _ddp_rank(rank: int, world: int, port: int, tmp: str) -> None:
    """One rank (a process of its own, started by the test below): its half of the batch under DDP."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    m = BertForSequenceClassification(BertConfig(**TINY, **NO_DROPOUT))
    m.load_state_dict(torch.load(f"{tmp}/state.pt"))
    policies.wrap_layers(m, "alternate")
    ddp = torch.nn.parallel.DistributedDataParallel(m.train())
    ids, mask, types, labels = padded_batch()
    rows = slice(rank * 3, rank * 3 + 3)  # each rank its half; DDP averages, so x world for the sum
    loss = m.loss_sum(ddp(ids[rows], mask[rows], types[rows]), labels[rows]) * world
    loss.backward()
    torch.save(our_grads(m), f"{tmp}/grads{rank}.pt")
    # Release DDP (its reducer holds the process group) and meet before tearing down: a gloo group
    # freed after its peer had exited hung one rank (3 runs in 16 of this helper; none in 30 since).
    del ddp, loss
    dist.barrier()
    dist.destroy_process_group()


def test_ddp_two_ranks_give_the_padded_models_gradient(tmp_path):
    import socket
    import subprocess
    import sys

    ours, hf = ours_and_hf()
    _, ref_grads = hf_loss_and_grads(hf, *padded_batch())
    torch.save(ours.state_dict(), tmp_path / "state.pt")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = os.path.dirname(os.path.abspath(__file__))
    procs = [subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); import test_unpad; "
                               f"test_unpad._ddp_rank({r}, 2, {port}, {str(tmp_path)!r})"])
             for r in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    for r in range(2):  # DDP left the same, all-reduced gradient on both ranks
        assert_same_grads(torch.load(tmp_path / f"grads{r}.pt"), ref_grads)


@pytest.mark.parametrize("packed", [False, True])
def test_cpu_attention_backward_with_dropout_is_the_derivative(packed):
    """Finite differences (fp64) through the kernel with attention dropout (its mask kept for
    backward, as bytes or as bits)."""
    g = torch.Generator().manual_seed(1)
    lengths = [5, 5, 3, 7]
    n, H, N = sum(lengths), 8, 2
    tokens = Tokens.of(torch.arange(7)[None] < torch.tensor(lengths)[:, None], 4, 7, torch.device("cpu"))
    qkv = torch.randn(n, 3 * H, dtype=torch.float64, generator=g, requires_grad=True)

    def f(x):
        torch.manual_seed(5)  # the same masks on every call
        return _CpuAttention.apply(x, tokens.groups, N, 0.3, packed)

    assert torch.autograd.gradcheck(f, (qkv,), eps=1e-6, atol=1e-7, fast_mode=True)
    # and dropout really dropped something: without it the output differs
    assert not torch.allclose(f(qkv), _CpuAttention.apply(qkv, tokens.groups, N, 0.0, packed))


def test_cpu_attention_equals_padded_sdpa_without_dropout():
    ids, mask, _, _ = padded_batch()
    tokens = Tokens.of(mask, *ids.shape, torch.device("cpu"))
    qkv = torch.randn(int(mask.sum()), 3 * 64, dtype=torch.float64)
    ours = _CpuAttention.apply(qkv, tokens.groups, 4, 0.0, False)
    assert (ours - padded_attention(qkv, tokens, 4, 0.0).reshape_as(ours)).abs().max() <= 1e-12


def test_keep_mask_rate_and_scale_keep_the_expectation():
    torch.manual_seed(0)
    keep, scale = keep_mask((1000, 1000), 0.1, torch.device("cpu"))
    p = round(0.1 * 65536) / 65536  # p rounded to 1/65536
    assert scale == pytest.approx(1 / (1 - p), rel=1e-12)
    assert keep.dtype == torch.uint8 and set(keep.unique().tolist()) == {0, 1}
    drop = 1 - keep.float()
    sigma = (p * (1 - p) / 1e6) ** 0.5
    assert abs(drop.mean().item() - p) < 5 * sigma
    for lane in range(4):  # each 16-bit lane of a 64-bit draw is uniform on its own
        assert abs(drop.view(-1, 4)[:, lane].mean().item() - p) < 5 * 2 * sigma


def test_keep_mask_is_fixed_by_torchs_seed_and_takes_one_draw_from_it():
    # checkpointing replays torch's generator to redraw the same masks in a recomputation: a mask
    # must depend on that generator alone, and take the same draws from it whatever its size
    cpu = torch.device("cpu")
    torch.manual_seed(5)
    a, _ = keep_mask((64, 1000), 0.1, cpu)
    after_a = torch.get_rng_state()
    b, _ = keep_mask((64, 1000), 0.1, cpu)
    torch.manual_seed(5)
    keep_mask((3,), 0.5, cpu)  # what it takes of torch's generator does not depend on the size
    assert torch.equal(torch.get_rng_state(), after_a)
    torch.manual_seed(5)
    assert torch.equal(keep_mask((64, 1000), 0.1, cpu)[0], a)
    assert not torch.equal(a, b)  # the next mask is another
    torch.manual_seed(6)
    assert not torch.equal(keep_mask((64, 1000), 0.1, cpu)[0], a)
    with pytest.raises(ValueError, match="CPU only"):
        keep_mask((4,), 0.1, torch.device("meta"))


def test_cpu_dropout_backward_is_the_derivative_and_keeps_the_expectation():
    from hpcbert.model import dropout

    x = torch.randn(64, 32, dtype=torch.float64, requires_grad=True)

    def f(t):
        torch.manual_seed(3)  # the same mask on every call
        return dropout(t, 0.25, True)

    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-7)
    y = f(x)
    dropped = y == 0
    assert 0 < dropped.float().mean() < 0.5
    # kept entries scaled by 1 / P(keep) of the rounded p; dropped ones zero
    scale = 65536 / (65536 - round(0.25 * 65536))
    torch.testing.assert_close(y[~dropped], x[~dropped] * scale, rtol=1e-15, atol=0)
    ones = torch.ones(1000, 1000)
    torch.manual_seed(0)
    assert dropout(ones, 0.1, True).mean().item() == pytest.approx(1.0, abs=5 * (0.1 / 0.9 / 1e6) ** 0.5)


def test_padding_costs_no_token_wise_work():
    """FLOPs counted by PyTorch: a batch with half of its positions padded costs half of a full one."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    m = BertForSequenceClassification(BertConfig(**TINY)).train()
    ids = torch.randint(5, 500, (4, 32))

    def flops(mask):
        with FlopCounterMode(display=False) as fc:
            m.loss_sum(m(ids, mask, torch.zeros_like(ids)), torch.zeros(4, dtype=torch.long)).backward()
        return fc.get_total_flops()

    full = flops(None)
    half = flops((torch.arange(32)[None] < 16).expand(4, 32))
    assert 0.45 < half / full < 0.5  # attention (quadratic in length) falls faster than half


def test_hf_names_round_trip_and_old_checkpoints_load(tmp_path):
    tf = transformers()
    torch.manual_seed(1)
    hf = tf.BertModel(tf.BertConfig(**TINY))
    hf.save_pretrained(tmp_path)
    m = BertForSequenceClassification(BertConfig(**TINY))
    rep = load_pretrained(m, tmp_path)
    assert rep.unexpected == [] and rep.mismatched == []
    assert rep.missing == ["classifier.bias", "classifier.weight"]
    ref = {"bert." + k: v for k, v in hf.state_dict().items() if "position_ids" not in k}
    out = hf_state_dict(m)
    assert {k for k in out if not k.startswith("classifier")} == set(ref)
    assert all(torch.equal(out[k], ref[k]) for k in ref)
    # A state dict with the three HF projections (this project's checkpoints before the fusion) loads strictly.
    m2 = BertForSequenceClassification(BertConfig(**TINY))
    m2.load_state_dict(hf_state_dict(m), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))


def test_a_missing_projection_is_named_and_the_others_load(tmp_path):
    from safetensors.torch import load_file, save_file

    tf = transformers()
    tf.BertModel(tf.BertConfig(**TINY)).save_pretrained(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    key_w = sd.pop("encoder.layer.2.attention.self.key.weight")
    save_file(sd, str(tmp_path / "model.safetensors"))
    m = BertForSequenceClassification(BertConfig(**TINY))
    before = m.bert.encoder.layer[2].attention.self.qkv.weight.detach().clone()
    rep = load_pretrained(m, tmp_path)
    assert "bert.encoder.layer.2.attention.self.key.weight" in rep.missing
    w = m.bert.encoder.layer[2].attention.self.qkv.weight.detach()
    H = TINY["hidden_size"]
    assert torch.equal(w[:H], sd["encoder.layer.2.attention.self.query.weight"])
    assert torch.equal(w[H:2 * H], before[H:2 * H]) and not torch.equal(w[H:2 * H], key_w)
    assert torch.equal(w[2 * H:], sd["encoder.layer.2.attention.self.value.weight"])


@pytest.mark.parametrize("policy", ["selective", "offload"])
def test_new_policies_same_loss_and_gradients_as_none_with_dropout(policy):
    def run(p):
        torch.manual_seed(0)
        m = BertForSequenceClassification(BertConfig(**TINY))
        policies.wrap_layers(m, p)
        ids, mask, types, labels = padded_batch()
        torch.manual_seed(123)
        loss = m.train().loss_sum(m(ids, mask, types), labels)
        loss.backward()
        return loss.detach(), our_grads(m)

    ref_loss, ref = run("none")
    loss, grads = run(policy)
    assert torch.equal(loss, ref_loss)
    assert_same_grads(grads, ref, tol=1e-6)


def test_selective_draws_no_mask_and_reruns_no_attention_in_backward():
    """On CPU selective keeps the attention's results and every dropout mask: its backward runs
    neither operator again (`all`, which keeps nothing of a layer, runs the attention again, and
    the forward draws the masks: the count is live), nor any matmul beyond none's backward; it runs
    each GELU and the LayerNorms before a matmul."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] = self.ops.get(str(func), 0) + 1
            return func(*args, **(kwargs or {}))

    ran, matmuls, norms = {}, {}, {}
    for policy in ("none", "selective", "all"):
        torch.manual_seed(0)
        m = BertForSequenceClassification(BertConfig(**TINY)).train()
        policies.wrap_layers(m, policy)
        ids, mask, types, labels = padded_batch()
        with Count() as f:
            loss = m.loss_sum(m(ids, mask, types), labels)
        # the embeddings' and 2 a layer (the attention's is drawn inside hpcbert::cpu_attention)
        assert f.ops.get("hpcbert.keep_mask.default", 0) == 1 + 2 * TINY["num_hidden_layers"]
        with Count() as c:
            loss.backward()
        ran[policy] = (c.ops.get("hpcbert.cpu_attention.default", 0), c.ops.get("hpcbert.keep_mask.default", 0))
        matmuls[policy] = sum(c.ops.get(f"aten.{op}.default", 0) for op in ("mm", "addmm", "bmm"))
        norms[policy] = c.ops.get("aten.native_layer_norm.default", 0)
        gelus = c.ops.get("aten.gelu.default", 0)
        assert gelus == (0 if policy == "none" else TINY["num_hidden_layers"])  # element-wise work is redone
    layers = TINY["num_hidden_layers"]
    assert ran["none"] == ran["selective"] == (0, 0)
    # selective redoes no matmul; it redoes the LayerNorms whose outputs a matmul inside a layer
    # keeps: each layer's first one (the feed-forward's input) and the second one of every layer
    # but the last (the next layer's Q/K/V input); the embeddings' output passes a dropout first
    assert matmuls["selective"] == matmuls["none"] < matmuls["all"]
    assert (norms["none"], norms["selective"]) == (0, layers + (layers - 1))
    # all: each layer's attention again; no dropout mask drawn again (the recomputation and the
    # LayerNorms' backward take the bits the forward kept; they drew 2 a layer + the embeddings')
    assert ran["all"] == (layers, 0)


def test_selective_keeps_fewer_bytes_than_none_and_more_than_all():
    # On a span head, which reads every position, so every layer runs whole (a classifier's last
    # layer runs on [CLS] alone and keeps almost nothing under any policy).
    from hpcbert.model import BertForQuestionAnswering

    measured = {}
    for policy in ("none", "selective", "all"):
        torch.manual_seed(0)
        m = BertForQuestionAnswering(BertConfig(**TINY)).train()
        policies.wrap_layers(m, policy)

        def loss_of(b: int, m=m) -> torch.Tensor:
            ids = torch.randint(1, 500, (b, 32))
            start, end = m(ids, None, torch.zeros_like(ids))
            return start.logsumexp(-1).sum() + end.logsumexp(-1).sum()

        measured[policy] = activation_bytes_per_sequence(m, loss_of, torch.device("cpu"))
    assert measured["all"] < measured["selective"] < 0.8 * measured["none"]


def test_offload_is_refused_without_cuda():
    m = BertForSequenceClassification(BertConfig(**TINY))
    with pytest.raises(ValueError, match="grad_ckpt: offload keeps saved activations in host memory"):
        policies.apply_grad_ckpt(m, "offload")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernels_match_the_cpu_model(dtype, monkeypatch):
    """On a GPU: flash varlen (bf16) or the padded SDPA path (fp32), dropout off, against the CPU
    kernel's fp32 gradients on the same weights; offload and selective run there and give the same
    gradients, and so do filler rows (--token-multiple), eager and compiled. bf16 rounding alone moves a gradient by a few percent (2.7% for the position
    embeddings on an H100), so in bf16 each gradient may differ from fp32's by up to twice what
    PyTorch's own padded SDPA path in bf16 does, or 2%."""
    from hpcbert import model as M

    ours, _ = ours_and_hf()
    ids, mask, types, labels = padded_batch()
    loss = ours.loss_sum(ours(ids, mask, types), labels)
    loss.backward()
    ref = our_grads(ours)

    def gpu_grads(policy: str, compiled: bool = False, multiple: int = 1) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        gpu = BertForSequenceClassification(BertConfig(**TINY, **NO_DROPOUT)).cuda()
        gpu.load_state_dict(ours.state_dict())
        policies.apply_grad_ckpt(gpu, policy)
        # compiled: one graph, the attention kernels traced into it (fullgraph fails on a break);
        # the layout built outside it, as the training loop's Batch.to does
        run = torch.compile(gpu, dynamic=True, fullgraph=True) if compiled else gpu
        tokens = filler_tokens(mask.cuda(), multiple)  # multiple > 1: filler rows, sequences of their own
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            out = run.train()(ids.cuda(), tokens, types.cuda())
        gpu.loss_sum(out, labels.cuda()).backward()
        return {k: v.float().cpu() for k, v in our_grads(gpu).items()}

    # the key bias's gradient is zero in exact arithmetic (rounding noise on both sides): measured
    # at a thousandth of the whole gradient's scale, about bf16's resolution
    floor = 1e-3 * torch.cat([g.flatten() for g in ref.values()]).norm()

    def rel(g: torch.Tensor, r: torch.Tensor) -> float:
        return float((g - r).norm() / torch.maximum(r.norm(), floor))

    if dtype == torch.float32:
        for policy in ("none", "offload", "selective"):
            assert_same_grads(gpu_grads(policy), ref, tol=1e-4)
        assert_same_grads(gpu_grads("none", multiple=64), ref, tol=1e-4)
        assert_same_grads(gpu_grads("none", compiled=True), ref, tol=1e-4)
        assert_same_grads(gpu_grads("none", compiled=True, multiple=64), ref, tol=1e-4)
        return
    with monkeypatch.context() as m:  # PyTorch's SDPA on the padded layout, in bf16: the rounding scale
        m.setattr(M, "_flash_varlen_ok", lambda *a: False)
        padded = gpu_grads("none")
    bound = {k: max(0.02, 2 * rel(g, ref[k])) for k, g in padded.items()}
    for policy, compiled, multiple in (("none", False, 1), ("offload", False, 1), ("selective", False, 1),
                                       ("alternate", False, 64), ("none", False, 64), ("none", True, 1),
                                       ("none", True, 64)):
        grads = gpu_grads(policy, compiled, multiple)
        assert grads.keys() == ref.keys()
        worst = {k: rel(g, ref[k]) for k, g in grads.items() if rel(g, ref[k]) > bound[k]}
        assert not worst, (f"{policy}, compiled {compiled}, token multiple {multiple}: gradients beyond twice "
                           f"bf16 SDPA's distance from fp32: {worst}")


def test_attention_is_a_graph_break_on_cpu_only():
    """torch.compile traces the whole model where attention runs PyTorch kernels (a GPU; here the
    meta device, which takes the same path as CUDA's padded SDPA and lacks only the flash kernel,
    checked compiled on a GPU in test_cuda_kernels_match_the_cpu_model): one graph. On CPU, the
    attention kernel loops over host lengths and is a graph break in every layer."""
    import numpy as np

    lengths, T = np.array([5, 7, 3]), 7
    index, cu = Tokens.host_layout(lengths, T)
    mask = torch.from_numpy(np.arange(T)[None] < lengths[:, None])
    ids = torch.randint(5, TINY["vocab_size"], (3, T), generator=torch.Generator().manual_seed(0))
    counts = {}
    for dev in ("meta", "cpu"):
        torch.manual_seed(0)
        m = BertForSequenceClassification(BertConfig(**TINY)).to(dev).train()
        tokens = Tokens.build(lengths.tolist(), 3, T, mask.to(dev), index.to(dev), cu.to(dev))
        ex = torch._dynamo.explain(lambda i, t: m(i, t, torch.zeros_like(i)).sum())(ids.to(dev), tokens)
        counts[dev] = [r.reason.splitlines()[0] for r in ex.break_reasons]
    assert counts["meta"] == [] and len(counts["cpu"]) == TINY["num_hidden_layers"]
    assert all("disable()" in r for r in counts["cpu"]), counts["cpu"]



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_policies_same_gradients_as_none_with_dropout(dtype):
    """On a GPU with dropout on (flash varlen's in-kernel dropout in bf16, SDPA's in fp32, F.dropout):
    each policy's recomputation replays the masks of none's forward, so its loss and gradients are
    none's, up to the kernels' summation order. With another seed (other masks) they are far from
    none's: the tolerance tells masks apart."""
    ids, mask, types, labels = (t.cuda() for t in padded_batch())

    def run(policy: str, seed: int = 123):
        torch.manual_seed(0)
        m = BertForSequenceClassification(BertConfig(**TINY)).cuda()
        policies.apply_grad_ckpt(m, policy)
        torch.manual_seed(seed)
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            loss = m.train().loss_sum(m(ids, mask, types), labels)
        loss.backward()
        return float(loss), {k: v.float().cpu() for k, v in our_grads(m).items()}

    ref_loss, ref = run("none")
    floor = 1e-3 * torch.cat([g.flatten() for g in ref.values()]).norm()  # the key bias: rounding noise

    def worst(grads) -> float:
        return max(float((g - ref[k]).norm() / torch.maximum(ref[k].norm(), floor)) for k, g in grads.items())

    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    assert worst(run("none", seed=124)[1]) > 10 * tol  # other masks
    for policy in ("alternate", "every:2", "all", "selective", "offload"):
        loss, grads = run(policy)
        assert loss == pytest.approx(ref_loss, rel=tol), policy
        assert worst(grads) <= tol, f"{policy}: a gradient {worst(grads):.2e} from none's"

def test_tokens_from_host_lengths_are_the_tokens_of_the_mask():
    """Batch.to builds the layout from collate's host lengths (no device read in the step): the
    same index, lengths, sequence offsets and attention groups as reading the mask."""
    import numpy as np

    from hpcbert.data.features import Batch

    ids, mask, types, labels = padded_batch()
    lengths = mask.sum(1).numpy()
    a = Tokens.of(mask, *ids.shape, torch.device("cpu"))
    b = Batch(ids, types, mask, labels, int(lengths.sum()), lengths).to(torch.device("cpu")).tokens
    assert (b.B, b.T, b.lengths, b.groups) == (a.B, a.T, a.lengths, a.groups)
    assert torch.equal(b.index, a.index) and torch.equal(b.cu_seqlens, a.cu_seqlens) and torch.equal(b.mask, a.mask)
    # the model gives the same outputs from either
    torch.manual_seed(0)
    m = BertForSequenceClassification(BertConfig(**TINY, **NO_DROPOUT)).eval()
    assert torch.equal(m(ids, b, types), m(ids, mask, types))
    full = Batch(ids, types, None, labels, ids.numel(), np.full(len(ids), ids.shape[1])).to(torch.device("cpu"))
    assert full.tokens.index is None and full.tokens.mask is None and full.tokens.groups == [(0, len(ids), ids.shape[1])]
    with pytest.raises(ValueError, match="built for"):
        m(ids[:, :5], b, types[:, :5])


def test_filler_rows_round_the_rows_up_and_copy_a_padding_position():
    """Batch.to(device, 64): 81 real tokens (21 + 13 + 13 + 4 + 21 + 9) take 47 filler rows to 128,
    each a copy of a padding position (row 3, length 4: position 3 * 21 + 4), attending as sequences
    of at most T = 21 (21, 21, 5) after the real ones; [CLS] rows, padding back and the real rows'
    positions are those without filler. A batch without padding gets none (its rows repeat already)."""
    import numpy as np

    from hpcbert.data.features import Batch

    ids, mask, types, labels = padded_batch()
    lengths = mask.sum(1).numpy()
    plain = Tokens.of(mask, *ids.shape, torch.device("cpu"))
    t = Batch(ids, types, mask, labels, 81, lengths).to(torch.device("cpu"), 64).tokens
    assert t.index.shape[0] == 128 and t.fill == 47
    assert torch.equal(t.index[:81], plain.index) and set(t.index[81:].tolist()) == {3 * 21 + 4}
    assert torch.equal(t.real_index, plain.index)
    assert t.cu_seqlens.tolist() == [0, 21, 34, 47, 51, 72, 81, 102, 123, 128]
    assert t.groups[-2:] == [(81, 2, 21), (123, 1, 5)] and t.max_len == 21
    assert torch.equal(t.first_rows(), plain.first_rows()) and torch.equal(t.positions()[:81], plain.positions())
    x = torch.randn(128, 3)
    assert torch.equal(t.pad(x), plain.pad(x[:81]))
    assert Batch(ids, types, mask, labels, 81, lengths).to(torch.device("cpu"), 27).tokens.index.shape[0] == 81
    full = Batch(ids, types, None, labels, ids.numel(), np.full(6, 21)).to(torch.device("cpu"), 64).tokens
    assert full.index is None and full.fill == 0


def test_always_index_gives_a_batch_without_padding_an_index_and_at_least_one_filler_row():
    """Batch.to(..., always_index=True), the layout of a compiled run, by hand: a batch without
    padding gets every position as its index and an all-true mask; with filler rows asked for, a
    batch whose rows are a multiple already gets `multiple` of them (never none), copies of the
    first token where there is no padding position, of the first padding position where there is."""
    import numpy as np

    from hpcbert.data.features import Batch

    cpu = torch.device("cpu")
    ids, types = torch.ones(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long)
    full = Batch(ids, types, None, torch.zeros(2), 8, np.array([4, 4])).to(cpu, 4, always_index=True).tokens
    assert full.index.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 0, 0] and full.real_index.tolist() == list(range(8))
    assert full.cu_seqlens.tolist() == [0, 4, 8, 12] and full.fill == 4 and full.mask.all()
    assert Batch(ids, types, None, torch.zeros(2), 8, np.array([4, 4])).to(cpu, 1, always_index=True).tokens.fill == 0
    # lengths 3 and 1 (T = 3): 4 real rows, a multiple of 4 already: 4 filler rows, sequences of 3 and 1,
    # copies of position 1 * 3 + 1 (the shorter row's first padding position)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]]).bool()
    t = Batch(ids[:, :3], types[:, :3], mask, torch.zeros(2), 4, np.array([3, 1])).to(cpu, 4, always_index=True).tokens
    assert t.index.tolist() == [0, 1, 2, 3, 4, 4, 4, 4] and t.cu_seqlens.tolist() == [0, 3, 4, 7, 8]
    # 5 real rows: 3 filler rows, as without always_index
    t = Batch(ids[:, :3], types[:, :3], torch.tensor([[1, 1, 1], [1, 1, 0]]).bool(), torch.zeros(2), 5,
              np.array([3, 2])).to(cpu, 4, always_index=True).tokens
    assert t.index.tolist() == [0, 1, 2, 3, 4, 5, 5, 5]


def test_always_index_keeps_the_loss_and_gradients_of_a_batch_without_padding():
    """The filler rows of a batch without padding read its first token; no head reads them, so
    that token's gradient gains exact zeros: the loss and every gradient are those of the batch
    without an index (CPU, fp32, dropout off)."""
    import numpy as np

    from hpcbert.data.features import Batch

    ids = torch.randint(5, TINY["vocab_size"], (3, 16), generator=torch.Generator().manual_seed(0))
    types, labels = torch.zeros_like(ids), torch.tensor([0, 1, 1])
    torch.manual_seed(0)
    m = BertForSequenceClassification(BertConfig(**TINY, **NO_DROPOUT)).train()
    out = {}
    for always in (False, True):
        b = Batch(ids, types, None, labels, ids.numel(), np.full(3, 16)).to(torch.device("cpu"), 32, always_index=always)
        assert (b.tokens.index is None) != always
        m.zero_grad()
        loss = m.loss_sum(m(b.input_ids, b.padding, b.token_type_ids), labels)
        loss.backward()
        out[always] = float(loss.detach()), our_grads(m)
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-6)
    assert_same_grads(out[True][1], out[False][1], tol=1e-6)


def test_a_compiled_model_meets_one_graph_over_batches_with_and_without_padding(monkeypatch):
    """The training loop's batches under --compile (always_index): a batch without padding, then
    padded ones of other lengths and filler counts, make one graph where attention is PyTorch's
    (the meta device takes CUDA's padded SDPA path; T a multiple of 16 throughout, past that path's
    own alignment test). Without always_index the batch without padding is a graph of its own."""
    import numpy as np

    from hpcbert.data.features import Batch

    torch.manual_seed(0)
    m = BertForSequenceClassification(BertConfig(**TINY)).to("meta").train()
    shapes = [(32, [32, 32]), (32, [32, 10]), (48, [48, 17]), (32, [30, 32])]

    def graphs(always: bool) -> int:
        made = []

        def count(gm, example_inputs):
            made.append(gm)
            return gm.forward

        torch._dynamo.reset()
        run = torch.compile(m, dynamic=True, backend=count)
        for T, lengths in shapes:
            lengths = np.array(lengths)
            mask = torch.from_numpy(np.arange(T)[None] < lengths[:, None])
            b = Batch(torch.ones(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.long),
                      None if (lengths == T).all() else mask, torch.zeros(2, dtype=torch.long), int(lengths.sum()),
                      lengths).to(torch.device("meta"), 8, always_index=always)
            run(b.input_ids, b.padding, b.token_type_ids)
        torch._dynamo.reset()
        return len(made)

    assert graphs(True) == 1
    assert graphs(False) == 2


@pytest.mark.parametrize("policy, multiple", [("none", 1), ("alternate", 1), ("selective", 1), ("none", 64),
                                              ("alternate", 64)])
@pytest.mark.parametrize("head", ["BertForMaskedLM", "BertForPreTraining"])
def test_masked_lm_heads_reading_the_masked_rows_equal_hf_full_model(head, policy, multiple):
    """The last layer runs at the masked positions only (and [CLS] for next-sentence): loss and every
    gradient equal transformers' model, which computes every position, gathered at the same places."""
    from hpcbert import model as M

    tf = transformers()
    torch.manual_seed(0)
    c = {**TINY, **NO_DROPOUT}
    ours = getattr(M, head)(BertConfig(**c))
    hf = getattr(tf, head)(tf.BertConfig(**c, attn_implementation="eager"))
    hf.load_state_dict(hf_state_dict(ours), strict=False)
    hf.tie_weights()
    policies.wrap_layers(ours, policy)
    ours.train(), hf.train()
    ids, mask, types, labels = padded_batch()
    T = ids.shape[1]
    pos = torch.tensor([0 * T + 1, 0 * T + 20, 1 * T + 3, 3 * T + 2, 4 * T + 0, 5 * T + 8])  # real tokens
    targets = ids.reshape(-1)[pos]

    def hf_loss(model):
        out = model(input_ids=ids, attention_mask=mask.long(), token_type_ids=types)
        logits = (out.logits if head == "BertForMaskedLM" else out.prediction_logits).reshape(-1, TINY["vocab_size"])
        ref = torch.nn.functional.cross_entropy(logits[pos], targets, reduction="sum")
        if head == "BertForPreTraining":
            ref = ref + torch.nn.functional.cross_entropy(out.seq_relationship_logits, labels, reduction="sum")
        ref.backward()
        return ref

    hf64 = copy.deepcopy(hf).double()
    hf_loss(hf64)
    ref = hf_loss(hf)
    got = ours(ids, filler_tokens(mask, multiple), types, pos)
    loss = torch.nn.functional.cross_entropy(got if head == "BertForMaskedLM" else got[0], targets, reduction="sum")
    if head == "BertForPreTraining":
        loss = loss + torch.nn.functional.cross_entropy(got[1], labels, reduction="sum")
    loss.backward()
    assert torch.allclose(loss, ref, rtol=1e-6, atol=0)
    ref_grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    grads = {n: g for n, g in our_grads(ours).items() if n in ref_grads}
    assert grads.keys() == ref_grads.keys()
    assert_same_grads(grads, ref_grads, exact={n: p.grad for n, p in hf64.named_parameters() if p.grad is not None})


def test_the_last_layer_computes_only_the_rows_its_head_reads():
    """Forward FLOPs counted by PyTorch against a hand count: a classifier runs its last layer's
    output projection and feed-forward on [CLS] alone; every other layer on every real token."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    c = BertConfig(**TINY, **NO_DROPOUT, num_labels=3)
    m = BertForSequenceClassification(c).eval()
    ids, mask, types, _ = padded_batch()
    lengths = mask.sum(1)
    n, B, H, I, nl = int(lengths.sum()), len(ids), c.hidden_size, c.intermediate_size, c.num_hidden_layers
    qkv = 2 * n * H * 3 * H
    attn = 2 * 2 * int((lengths ** 2).sum()) * H      # Q K^T and P V over each sequence's own tokens
    rest = lambda rows: 2 * rows * (H * H + 2 * H * I)  # noqa: E731  output projection + feed-forward
    expected = nl * (qkv + attn) + (nl - 1) * rest(n) + rest(B) + 2 * B * H * H + 2 * B * H * 3  # + pooler, classifier
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        m(ids, mask, types)
    assert fc.get_total_flops() == expected


@pytest.mark.parametrize("p, packed", [(0.0, False), (0.2, False), (0.2, True)])
def test_custom_operators_pass_torch_opcheck(p, packed):
    """PyTorch's own checks of the two CPU operators: schema (no undeclared mutation or aliasing)
    and the fake kernel (shapes and dtypes the planner's FakeTensorMode sees) against the real one."""
    ids, mask, _, _ = padded_batch()
    tokens = Tokens.of(mask, *ids.shape, torch.device("cpu"))
    qkv = torch.randn(int(mask.sum()), 3 * 16)
    flat = [x for g in tokens.groups for x in g]
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.hpcbert.cpu_attention, (qkv, flat, 4, p, packed), test_utils=checks)
    torch.library.opcheck(torch.ops.hpcbert.keep_mask, ([7, 5], 6554, torch.device("cpu")), test_utils=checks)
