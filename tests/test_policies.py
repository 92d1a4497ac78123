"""Gradient checkpointing is a policy: same loss and gradients as none, fewer saved bytes."""

from __future__ import annotations

import pytest
import torch

from hpcbert import policies
from hpcbert.meters import activation_bytes_per_sequence
from hpcbert.model import BertConfig, BertForSequenceClassification

CFG = dict(vocab_size=400, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
           max_position_embeddings=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)


def make(policy: str, layers: int = 4) -> BertForSequenceClassification:
    torch.manual_seed(0)
    m = BertForSequenceClassification(BertConfig(**{**CFG, "num_hidden_layers": layers}))
    policies.apply_grad_ckpt(m, policy)
    return m.train()


def batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 400, (4, 24), generator=g)
    mask = torch.arange(24)[None] < torch.tensor([24, 20, 9, 15])[:, None]
    return ids, mask, torch.zeros_like(ids), torch.tensor([0, 1, 1, 0])


def loss_and_grads(m, precision: str = "fp32"):
    ids, mask, types, labels = batch()
    torch.manual_seed(123)  # same dropout stream for every policy
    with policies.autocast(precision, torch.device("cpu")):
        loss = m.loss_sum(m(ids, mask, types), labels)
    loss.backward()
    # Wrapped layers show their parameters under '_checkpoint_wrapped_module.' (state_dict keys do not).
    return loss.detach(), {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("policy", ["alternate", "all", "every:2", "every:3"])
def test_same_loss_and_gradients_as_none_with_dropout(policy):
    ref_loss, ref_grads = loss_and_grads(make("none"))
    loss, grads = loss_and_grads(make(policy))
    assert grads.keys() == ref_grads.keys()
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    for name, g in grads.items():
        rel = (g - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-30)
        assert rel <= 1e-6, f"{policy}: gradient of {name} differs by {rel:.2e} relative"
    # Dropout was really on: a different dropout stream changes the loss.
    m = make("none")
    ids, mask, types, labels = batch()
    torch.manual_seed(7)
    assert not torch.allclose(m.loss_sum(m(ids, mask, types), labels), ref_loss)


def test_saved_activation_bytes_fall_none_alternate_all():
    measured = {}
    for policy in ("none", "alternate", "all"):
        m = make(policy, layers=6)
        def loss_of(b: int, m=m) -> torch.Tensor:
            ids = torch.randint(1, 400, (b, 32))
            return m.loss_sum(m(ids, None, torch.zeros_like(ids)), torch.zeros(b, dtype=torch.long))

        measured[policy] = activation_bytes_per_sequence(m, loss_of, torch.device("cpu"))
    assert measured["none"] > measured["alternate"] > measured["all"] > 0
    # A checkpointed layer keeps only its input, so 'all' saves far less than half of 'none'.
    assert measured["all"] < 0.25 * measured["none"]


def test_layer_choice_per_policy_for_any_depth():
    assert policies.ckpt_layer_indices("none", 12) == []
    assert policies.ckpt_layer_indices("all", 3) == [0, 1, 2]
    assert policies.ckpt_layer_indices("alternate", 24) == list(range(0, 24, 2))
    assert policies.ckpt_layer_indices("every:4", 12) == [0, 4, 8]
    with pytest.raises(ValueError, match="grad_ckpt: unknown policy 'every:0'"):
        policies.ckpt_layer_indices("every:0", 12)


def test_state_dict_keys_unchanged_by_wrapping():
    assert make("all").state_dict().keys() == make("none").state_dict().keys()
    m = make("alternate")
    m.load_state_dict(make("none").state_dict())  # strict: loads across policies


def test_all_keeps_only_each_layers_input():
    """Under `all` the encoder keeps, per sequence, each layer's fp32 input (T x H x 4 bytes) and
    its dropout masks as bits (the recomputation and the LayerNorms' backward take them instead of
    drawing them again), and nothing else: the embeddings are recomputed too (before they were
    wrapped they also kept their LayerNorm input, its statistics and a dropout mask per token).
    Every layer but the last keeps its output for its final LayerNorm's backward, which is the next
    layer's input (no bytes), and 1/std of each token (fp32)."""
    L, T, H = 6, 32, CFG["hidden_size"]
    m = make("all", layers=L)
    m.bert.pooler = None  # the encoder alone (the pooler keeps its own input and output)

    def loss_of(b: int) -> torch.Tensor:
        ids = torch.randint(1, 400, (b, T))
        seq, _ = m.bert(ids, None, torch.zeros_like(ids))
        return seq.sum()  # a sum's backward keeps nothing

    # + what the recomputation reads again: the ids and token types (int64 per token, the embeddings'
    # inputs), the batch's cu_seqlens (int32, one entry per sequence), each layer's attention
    # dropout mask, one bit per score (N heads x T x T), and one bit per element of T x H for each
    # other dropout: the embeddings', each layer's output projection's and feed-forward's (kept by
    # its final LayerNorm, or, in the last layer, recomputed): 1 + 2 L.
    N = CFG["num_attention_heads"]
    expected = (L * T * H * 4 + 2 * T * 8 + 4 + (L - 1) * T * 4 + L * N * T * T // 8
                + (1 + 2 * L) * T * H // 8)
    assert activation_bytes_per_sequence(m, loss_of, torch.device("cpu")) == expected


def forward_matmuls_in_backward(m, precision: str = "fp32") -> int:
    """Linear layers with a bias run as addmm in forward; backward's own matmuls are mm. So the
    addmm calls during backward are the recomputation's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func is torch.ops.aten.addmm.default
            return func(*args, **(kwargs or {}))

    ids, mask, types, labels = batch()
    with policies.autocast(precision, torch.device("cpu")):
        loss = m.loss_sum(m(ids, mask, types), labels)
    with Count():
        loss.backward()
    return Count.n


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recomputation_stops_before_each_layers_last_matmul(precision):
    """A layer has four Linear layers (Q/K/V, attention output, feed-forward in and out). The
    recomputation of a wrapped layer that keeps its output stops before its feed-forward's second
    matmul: 3 per layer; the last layer (which the classifier reads) is recomputed whole, 4. Under
    alternate a wrapped layer keeps its feed-forward's tensors: 2 per layer, the last one too."""
    L = 4
    assert forward_matmuls_in_backward(make("none", layers=L), precision) == 0
    assert forward_matmuls_in_backward(make("all", layers=L), precision) == 3 * (L - 1) + 4
    assert forward_matmuls_in_backward(make("every:2", layers=L), precision) == 3 + 3   # layers 0 and 2
    assert forward_matmuls_in_backward(make("every:3", layers=L), precision) == 3 + 4   # layers 0 and 3
    assert forward_matmuls_in_backward(make("alternate", layers=L), precision) == 2 + 2  # layers 0 and 2
    assert forward_matmuls_in_backward(make("alternate", layers=L + 1), precision) == 2 + 2 + 2  # 0, 2, 4 (last)
    assert forward_matmuls_in_backward(make("selective", layers=L), precision) == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_alternate_recomputes_the_query_projection_alone(precision):
    """The FLOPs backward runs beyond none's (torch's FlopCounterMode) are alternate's recomputation:
    in each wrapped layer (0 and 2 of 4) the Q projection (K and V are kept: model._KvKeepingLinear),
    the attention and the output projection, by hand over the batch's real lengths (n tokens):
    2 n H^2 + 4 sum(L^2) H + 2 n H^2 a layer. Recomputing the whole Q/K/V projection would add
    4 n H^2 a layer. Its loss and gradients are none's (test above)."""
    from torch.utils.flop_counter import FlopCounterMode

    def backward_flops(m) -> int:
        ids, mask, types, labels = batch()
        torch.manual_seed(123)
        with policies.autocast(precision, torch.device("cpu")):
            loss = m.loss_sum(m(ids, mask, types), labels)
        with FlopCounterMode(display=False) as fc:
            loss.backward()
        return fc.get_total_flops()

    lengths, H = [24, 20, 9, 15], CFG["hidden_size"]  # batch()'s
    n = sum(lengths)
    per_layer = 2 * n * H * H + 4 * sum(L * L for L in lengths) * H + 2 * n * H * H
    assert backward_flops(make("alternate")) - backward_flops(make("none")) == 2 * per_layer


def test_alternate_frees_the_kept_keys_and_values_in_backward():
    """The K and V an alternate layer keeps for its recomputation are freed by its backward, not
    when the graph goes: the training step holds its last loss through the optimizer step."""
    from hpcbert import model as model_module

    m = make("alternate")
    ids, mask, types, labels = batch()
    loss = m.loss_sum(m(ids, mask, types), labels)
    kept = list(model_module._KEPT_KV.values())
    assert len(kept) == 2 and all(node.kv is not None for node in kept)  # layers 0 and 2
    loss.backward()
    assert all(node.kv is None for node in kept)
    del loss, kept
    assert len(model_module._KEPT_KV) == 0


def test_backward_draws_no_dropout_mask_again(monkeypatch):
    """Masks drawn during backward (model.keep_mask), 4 layers: none. A recomputed layer takes its
    dropout masks from the bits its forward kept (its attention's; its output projection's; its
    feed-forward's where it is recomputed: the last layer, at the [CLS] rows), and each LayerNorm
    that keeps its output (model._NormKeepingOutput) its mask's bits; under all the embeddings'
    too. The models are built from the same seed, so a forward may find its mask already drawn by
    the graph of the model before (the same generator state draws the same mask), freed by the time
    of its backward. Once every graph is freed, no mask is held any more. Before the bits, every:2
    and alternate drew 2 + 3 masks in backward, every:3 1 + 2 + 2, all 1 + 3 + 2 + 3."""
    from hpcbert import model as model_module

    drawn = []
    keep_mask = model_module.keep_mask
    monkeypatch.setattr(model_module, "keep_mask", lambda *a, **k: drawn.append(a[0]) or keep_mask(*a, **k))

    def draws(policy: str) -> tuple[int, int]:
        m = make(policy)
        ids, mask, types, labels = batch()
        drawn.clear()
        loss = m.loss_sum(m(ids, mask, types), labels)
        forward = len(drawn)
        drawn.clear()
        loss.backward()
        return forward, len(drawn)

    # the forward draws every mask once: the embeddings', and 3 a layer
    for policy in ("none", "every:2", "every:3", "alternate", "all", "selective"):
        assert draws(policy) == (1 + 3 * 4, 0), policy
    assert len(model_module._DRAWN_MASKS) == 0


def test_alternate_trades_the_feed_forward_of_wrapped_layers_for_selective_plain_layers():
    """alternate (layers 0 and 2 of 4 recomputed) against every:2 (the same layers, recomputed up
    to their last matmul), fp32, per sequence of T tokens, by hand:
    - layers 0 and 2 keep their feed-forward's input (T x H) and first matmul's output (T x I),
      not its GELU output (a recipe from that matmul output): + 2 x 4 (T H + T I) (under both
      they keep their attention's dropout mask as bits, which the recomputation takes);
    - layers 1 and 3 keep what selective keeps: no GELU output, no LayerNorm output for the
      feed-forward (layer 3, which the classifier reads, computes its feed-forward on the [CLS]
      row only: 1 row, not T), and the attention's dropout mask as bits, not bytes (N T^2 each):
      - 4 (T H + T I) - 4 (H + I) - 2 x 7/8 N T^2;
    - layers 0 and 2 keep their attention's K and V (T x 2H; model._KvKeepingLinear), so that
      their recomputation computes Q alone: + 2 x 4 x 2 T H."""
    T, H, I, N = 32, CFG["hidden_size"], CFG["intermediate_size"], CFG["num_attention_heads"]

    def kept(m) -> int:
        def loss_of(b: int) -> torch.Tensor:
            ids = torch.randint(1, 400, (b, T))
            return m.loss_sum(m(ids, None, torch.zeros_like(ids)), torch.zeros(b, dtype=torch.long))
        return activation_bytes_per_sequence(m, loss_of, torch.device("cpu"))

    assert kept(make("alternate")) - kept(make("every:2")) == \
        4 * (T * H + T * I) - 4 * (H + I) - 7 * N * T * T // 4 + 2 * 4 * 2 * T * H


def test_every_2_keeps_no_more_for_its_shorter_recomputation():
    """every:2 (layers 0 and 2 of 4 wrapped) in fp32: the wrapped layers keep their outputs,
    which the plain layers after them keep anyway (their Q/K/V matmul's input), and 1/std per
    token; plain layer 1, whose output wrapped layer 2's checkpoint keeps, keeps that output too
    instead of its last LayerNorm's fp32 input, mean and uint8 dropout mask (1/std it kept before
    too); each of the three LayerNorms that keep their output keeps its dropout mask as bits, where
    without them the wrapped layers' feed-forward dropouts keep theirs for the recomputation. By
    hand, per sequence: -(4 + 1) x T x H - 4 x T (layer 1) + 2 x 4 x T (layers 0 and 2)
    + (3 - 2) x T x H / 8."""
    T, H = 32, CFG["hidden_size"]

    def kept(m) -> int:
        def loss_of(b: int) -> torch.Tensor:
            ids = torch.randint(1, 400, (b, T))
            return m.loss_sum(m(ids, None, torch.zeros_like(ids)), torch.zeros(b, dtype=torch.long))
        return activation_bytes_per_sequence(m, loss_of, torch.device("cpu"))

    m = make("every:2")
    lean = kept(m)
    for layer in m.bert.encoder.layer:
        getattr(layer, "_checkpoint_wrapped_module", layer).output.keep_output_only = False
    whole = kept(m)
    assert lean - whole == -5 * T * H - 4 * T + 2 * 4 * T + T * H // 8


def trained_layer_norms(m) -> None:
    """LayerNorm weights and biases as far from 1 and 0 as a trained BERT's (some negative, some
    near 0, biases of either sign), the same for every policy."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.LayerNorm):
                w = torch.randn(mod.weight.shape, generator=g) * 0.6 + 0.8
                w[::7] = 0.02
                w[3::11] *= -1
                mod.weight.copy_(w)
                mod.bias.copy_(torch.randn(mod.bias.shape, generator=g) * 0.5)


@pytest.mark.parametrize("policy", ["all", "alternate", "every:2", "every:3"])
def test_same_gradients_as_none_with_trained_layer_norms(policy):
    """The LayerNorm backward that reads the output divides by the weight: exact where the weight
    is 1 (a fresh model), rounded elsewhere. Within 1e-5 of none's in fp32 with dropout on, in
    wrapped layers and in plain ones before a wrapped one (alternate, every:3 of 4 layers)."""
    models = {p: make(p, layers=4) for p in ("none", policy)}
    for m in models.values():
        trained_layer_norms(m)
    (ref_loss, ref), (loss, grads) = (loss_and_grads(models[p]) for p in ("none", policy))
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    for name, g in grads.items():
        rel = (g - ref[name]).norm() / ref[name].norm().clamp_min(1e-30)
        assert rel <= 1e-5, f"gradient of {name} differs by {rel:.2e} relative"


def relative_distances(grads, ref) -> dict[str, float]:
    return {n: ((g - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)).item() for n, g in grads.items()}


@pytest.mark.parametrize("norms", ["low", "fp32"])
@pytest.mark.parametrize("trained", [False, True])
@pytest.mark.parametrize("policy", ["selective", "alternate", "all", "every:3"])
def test_bf16_policies_within_bf16_rounding_of_fp32(policy, trained, norms):
    """bf16 autocast, dropout on, the LayerNorms and the residual stream in bf16 (--norm-precision
    low, the default) or in fp32. Forward is the same computation under every policy: the same loss.
    In backward a wrapped layer's last LayerNorm reads its normalised input back from its output
    (model._NormKeepingOutput), bf16 under low, so its gradients are not none's bits; each must be
    as close to the fp32 model's as none's bf16 gradient is, up to twice that distance or 2% (the
    GPU tests' bound): a wrong dropout mask or a missed recomputation moves a gradient by its own
    size."""
    def model(p: str):
        m = make(p)
        if trained:
            trained_layer_norms(m)
        policies.norm_precision(m, norms)
        return m

    _, fp32 = loss_and_grads(model("none"), "fp32")
    ref_loss, ref = loss_and_grads(model("none"), "bf16")
    loss, grads = loss_and_grads(model(policy), "bf16")
    assert loss == ref_loss
    bound = {n: max(2 * d, 0.02) for n, d in relative_distances(ref, fp32).items()}
    far = {n: (round(d, 4), round(bound[n], 4)) for n, d in relative_distances(grads, fp32).items() if d > bound[n]}
    assert not far, f"{policy}: gradients farther from fp32's than the bound: {far}"


@pytest.mark.parametrize("cast_weights", [False, True])
def test_selective_recomputes_low_precision_layer_norm_outputs(monkeypatch, cast_weights):
    """Under bf16 with low-precision LayerNorms, selective still keeps no LayerNorm output and no
    GELU output: per layer a recipe for its GELU's output and its attention LayerNorm's output (the
    feed-forward's input), and but in layer 0 (whose input is the embeddings' dropout output) for
    its input, the LayerNorm output of the layer before; and the same gradients as none. cast_weights: the LayerNorms take weights cast to bf16, as
    they do on a GPU (model.low_precision_norm_args; the CPU kernel takes them in fp32), which
    autograd keeps as the cast, not the module's parameter, where selective looks up eps."""
    from hpcbert import model as M

    if cast_weights:
        real = M.low_precision_norm_args
        monkeypatch.setattr(M, "low_precision_norm_args",
                            lambda x, shape, w, b, dt: real(x, shape, w.to(dt), b.to(dt), dt))
    kept, pack = [], policies._SelectiveHooks.pack

    def recording(self, t):
        r = pack(self, t)
        kept.append("recipe" if isinstance(r, policies._Recompute) else type(t.grad_fn).__name__)
        return r

    monkeypatch.setattr(policies._SelectiveHooks, "pack", recording)
    _, ref = loss_and_grads(make("none"), "bf16")
    assert kept == []
    _, grads = loss_and_grads(make("selective"), "bf16")
    assert kept.count("recipe") == 3 * CFG["num_hidden_layers"] - 1, kept
    assert not {"NativeLayerNormBackward0", "GeluBackward0"} & set(kept), kept
    assert max(relative_distances(grads, ref).values()) <= 1e-6


def test_inactive_in_evaluation_and_no_grad(monkeypatch):
    calls = []
    real = policies.checkpoint
    monkeypatch.setattr(policies, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    m = make("all")
    ids, mask, types, _ = batch()
    m.eval()
    m(ids, mask, types).sum().backward()  # eval mode, grad on
    with torch.no_grad():
        m.train()(ids, mask, types)       # training mode, no grad
    assert calls == []
    m(ids, mask, types)                   # training with grad: every layer and the embeddings recompute
    assert len(calls) == 5


@pytest.mark.parametrize("policy,kept", [("none", 4), ("selective", 4), ("alternate", 4), ("every:3", 2)])
def test_a_graph_dropped_without_backward_frees_its_activations(policy, kept):
    """A step that fails between forward and backward (out of memory, as a batch probe provokes)
    drops its graph: nothing it saved may outlive it. The feed-forward here also runs an operation
    that saves its own output (a sigmoid, as flash attention on CUDA saves its output): a saved-tensor
    hook that kept such a tensor as it is would tie it to its own node, a cycle gc cannot free, and
    the layers' outputs upstream of it would stay alive. kept: the layers whose feed-forward keeps what
    it saved (by hand: every:3 recomputes layers 0 and 3 of 4; alternate recomputes attention only)."""
    import gc
    import weakref

    alive = []  # weak references to the sigmoids' storages (a storage's Python object lives as long as it)

    def with_sigmoid(mod, inputs, out):
        s = torch.sigmoid(out)
        alive.append(weakref.ref(s.untyped_storage()))
        return out + 0 * s

    m = make(policy)
    for layer in m.bert.encoder.layer:
        getattr(layer, "_checkpoint_wrapped_module", layer).intermediate.register_forward_hook(with_sigmoid)
    ids, mask, types, labels = batch()
    loss = m.loss_sum(m(ids, mask, types), labels)
    assert len(alive) == 4 and sum(r() is not None for r in alive) == kept  # held by the graph
    del loss
    gc.collect()
    assert [r() is not None for r in alive] == [False] * 4


def test_wrapping_twice_is_refused():
    m = make("all")
    with pytest.raises(RuntimeError, match="already applied"):
        policies.apply_grad_ckpt(m, "all")


def test_auto_precision_is_fp32_without_native_bf16(monkeypatch):
    monkeypatch.setattr(policies, "device_has_native_bf16", lambda d: False)
    assert policies.resolve_precision("auto", torch.device("cpu")) == "fp32"
    monkeypatch.setattr(policies, "device_has_native_bf16", lambda d: True)
    assert policies.resolve_precision("auto", torch.device("cpu")) == "bf16"
    with pytest.raises(ValueError, match="fp16 autocast needs a CUDA device"):
        policies.resolve_precision("fp16", torch.device("cpu"))
