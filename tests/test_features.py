"""Tokenised feature cache, dynamic padding, samplers and sharding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import minilm_dir_or_skip
from hpcbert.data import synthetic
from hpcbert.data import features
from hpcbert.data.features import (Features, cached_features, collate, epoch_order, global_batches,
                                   load_tokenizer, shard, to_device, tokenize_examples)
from hpcbert.data.glue import Example


def feats(lengths, labels=None) -> Features:
    ids = [list(range(100, 100 + n)) for n in lengths]
    return Features.from_lists(ids, [[0] * n for n in lengths], labels if labels is not None else [0] * len(lengths))


def test_collate_pads_to_longest_and_masks():
    f = feats([3, 5, 2])
    b = collate(f, [0, 1, 2])
    assert b.input_ids.shape == (3, 5)
    assert b.input_ids[2].tolist() == [100, 101, 0, 0, 0]
    assert b.attention_mask.sum(1).tolist() == [3, 5, 2]
    assert b.real_tokens == 10
    assert collate(f, [0, 2], pad_to=8).input_ids.shape == (2, 8)
    assert collate(f, [1]).attention_mask is None  # nothing padded: SDPA's fast path


def test_packed_copy_gives_every_tensor_back_from_one_buffer():
    """The GPU's one-copy transfer (run here on CPU, unpinned): every tensor back bit for bit, with
    its dtype and shape, None as None, from one new buffer (no input aliased)."""
    g = torch.Generator().manual_seed(0)
    ts = [torch.randint(0, 30522, (3, 7), generator=g), torch.tensor([True, False, True]), None,
          torch.tensor([0, 3, 5], dtype=torch.int32), torch.randn(5, generator=g), torch.tensor(2.5),
          torch.empty(0, dtype=torch.int64), torch.randn(4, 6, generator=g).t(),  # not contiguous
          torch.tensor([1, 2, 3], dtype=torch.uint8)]
    out = to_device(ts, torch.device("cpu"), pack=True)
    assert out[2] is None
    for t, o in zip(ts, out):
        if t is not None:
            assert (o.dtype, o.shape) == (t.dtype, t.shape) and torch.equal(o, t)
            if t.numel():
                assert o.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    storages = {o.untyped_storage().data_ptr() for o in out if o is not None}
    assert len(storages) == 1
    assert all(o.data_ptr() % 16 == 0 for o in out if o is not None)


@pytest.mark.parametrize("labels", ["tensor", "dict"])
def test_batch_sent_in_one_packed_copy_equals_the_batch(monkeypatch, labels):
    """Batch.to with the GPU's packed copy (forced here on CPU) gives the batch it gives without:
    the same tensors and the same unpadded layout."""
    b = collate(feats([3, 5, 2, 5], labels=[1, 0, 1, 1]), [0, 1, 2, 3])
    if labels == "dict":
        b.labels = {"start": torch.tensor([0, 1, 2, 3]), "end": torch.tensor([0.5, 1.0, 1.5, 2.0])}
    plain = b.to(torch.device("cpu"))
    monkeypatch.setattr(features, "to_device", lambda ts, device: to_device(ts, device, pack=True))
    packed = b.to(torch.device("cpu"))
    for name in ("input_ids", "token_type_ids", "attention_mask"):
        assert torch.equal(getattr(packed, name), getattr(plain, name)), name
    if labels == "dict":
        assert packed.labels.keys() == plain.labels.keys()
        assert all(torch.equal(packed.labels[k], plain.labels[k]) for k in plain.labels)
    else:
        assert torch.equal(packed.labels, plain.labels)
    p, q = packed.tokens, plain.tokens
    assert (p.B, p.T, p.lengths, p.groups) == (q.B, q.T, q.lengths, q.groups) == (4, 5, [3, 5, 2, 5], p.groups)
    assert torch.equal(p.index, q.index) and torch.equal(p.cu_seqlens, q.cu_seqlens) and torch.equal(p.mask, q.mask)
    assert p.cu_seqlens.tolist() == [0, 3, 8, 10, 15] and p.index.tolist() == [0, 1, 2, 5, 6, 7, 8, 9, 10, 11,
                                                                               15, 16, 17, 18, 19]


def test_a_compiled_models_batch_has_tensors_of_their_own_after_the_packed_copy(monkeypatch):
    """own_storage (the training loop's for a compiled model): after the one packed copy, no tensor
    of the batch is a view of the shared buffer, each has a storage of its own, and the values are
    the packed batch's; without it they are views of one buffer (what torch.compile guarded on)."""
    b = collate(feats([3, 5, 2, 5], labels=[1, 0, 1, 1]), [0, 1, 2, 3])
    b.labels = {"mlm_positions": torch.tensor([1, 6, 11]), "mlm_labels": torch.tensor([7, 8, 9])}
    monkeypatch.setattr(features, "to_device", lambda ts, device: to_device(ts, device, pack=True))

    def tensors(x):
        return [x.input_ids, x.token_type_ids, x.attention_mask, x.tokens.index, x.tokens.cu_seqlens,
                *x.labels.values()]

    shared = tensors(b.to(torch.device("cpu"), always_index=True))
    own = tensors(b.to(torch.device("cpu"), always_index=True, own_storage=True))
    assert all(t._base is not None for t in shared)
    assert len({t.untyped_storage().data_ptr() for t in shared}) == 1
    assert all(t._base is None and t.storage_offset() == 0 for t in own)
    assert len({t.untyped_storage().data_ptr() for t in own}) == len(own)
    assert all(torch.equal(s, o) and s.dtype == o.dtype for s, o in zip(shared, own))


@pytest.mark.parametrize("sampler", ["random", "length-grouped", "sequential"])
def test_epoch_visits_every_example_once(sampler):
    lengths = np.random.default_rng(0).integers(3, 60, size=1001)
    order = epoch_order(lengths, sampler, seed=1, epoch=0, global_batch=32)
    assert sorted(order.tolist()) == list(range(1001))
    batches = global_batches(order, 32)
    # 1001 = 31 * 32 + 9: 31 full batches and a short last one of 9 (kept, not dropped).
    assert [len(b) for b in batches] == [32] * 31 + [9]
    assert np.array_equal(np.concatenate(batches), order)  # cut in order, nothing reordered


def test_length_grouping_cuts_padding_and_reshuffles_per_epoch():
    lengths = np.random.default_rng(0).integers(3, 128, size=4000)
    def padded(order):
        return sum(lengths[b].max() * len(b) for b in global_batches(order, 32))
    grouped = epoch_order(lengths, "length-grouped", 1, 0, 32)
    rand = epoch_order(lengths, "random", 1, 0, 32)
    assert padded(grouped) < 0.8 * padded(rand)
    assert not np.array_equal(grouped, epoch_order(lengths, "length-grouped", 1, 1, 32))
    assert np.array_equal(grouped, epoch_order(lengths, "length-grouped", 1, 0, 32))


@pytest.mark.parametrize("per_rank,accum", [([4, 4], 1), ([3, 5], 1), ([2, 2, 4], 2)])
@pytest.mark.parametrize("n", [None, 7])  # full global batch, and a short last batch
def test_shard_covers_the_global_batch_exactly_once(per_rank, accum, n):
    full = sum(per_rank) * accum
    gb = np.arange(100, 100 + (n or full))
    parts = [np.concatenate(shard(gb, per_rank, r, accum)) for r in range(len(per_rank))]
    assert sorted(np.concatenate(parts).tolist()) == gb.tolist()
    if n is None:
        assert [len(p) for p in parts] == [b * accum for b in per_rank]


def test_synthetic_task_is_deterministic_and_balanced():
    a = synthetic.make_split(256, 64, "train")
    b = synthetic.make_split(256, 64, "train")
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.labels, b.labels)
    assert a.lengths.max() <= 64 and a.lengths.min() >= 8
    assert 0.35 < a.labels.mean() < 0.65
    assert not np.array_equal(synthetic.make_split(256, 64, "dev").ids[:50], a.ids[:50])


def test_tokenize_truncates_pairs_and_cache_is_keyed_by_contents(tmp_path):
    tok = load_tokenizer(minilm_dir_or_skip(), 16)
    ex = [Example("the cat sat on the mat", "a dog", 1, 2), Example(" ".join(["word"] * 40), "b", 0, 3)]
    f = tokenize_examples(tok, ex)
    assert f.lengths.tolist()[1] == 16 and f.ids[0] == 101  # [CLS]
    assert set(f.type_ids[: f.offsets[1]].tolist()) == {0, 1}
    src = tmp_path / "train.tsv"
    src.write_text("x\n")
    calls = []
    build = lambda: calls.append(1) or f  # noqa: E731
    _, hit1 = cached_features(src, tok, 16, build, str(tmp_path / "c"))
    g, hit2 = cached_features(src, tok, 16, build, str(tmp_path / "c"))
    assert (hit1, hit2, len(calls)) == (False, True, 1)
    assert np.array_equal(g.ids, f.ids)
    src.write_text("y\n")  # contents changed: rebuilt
    assert cached_features(src, tok, 16, build, str(tmp_path / "c"))[1] is False
    assert cached_features(src, tok, 32, build, str(tmp_path / "c"))[1] is False  # other length
