"""Packed projections (model/layers.py: pack, packed, pack_model): an inference model's q/k/v and
gate/up weights moved into one tensor each run as one matmul, with the same float64 results as the
separate projections (one rank here; over ranks in test_tensor_parallel.py), with q/k/v biases too;
and the packed view is used only where it is sound: never with gradients, never over tensors that
are merely adjacent in memory (a GPU allocator can place separate tensors back to back: a
decode check on 2 x H200 failed so), and no longer once the parameters are moved apart."""
import numpy as np
import pytest
import torch

import tp_cases as tc
from burstengine.inference import generate, load_model
from burstengine.model.layers import adjacent, pack_model, packed


def _run(source, overrides):
    seen = []
    out = generate(tc.model(None, source, **overrides), tc.prompts(), 5,
                   on_logits=lambda i, x: seen.append(x.clone()))
    return out.tokens, torch.stack(seen)


@pytest.mark.parametrize("overrides", [{}, dict(qkv_bias=True, qk_norm=True, window=9)])
def test_packed_model_decodes_as_the_unpacked_one(overrides):
    tokens, logits = _run("whole", overrides)
    m = tc.model(None, "whole-packed", **overrides).model
    with torch.no_grad():
        assert packed(m.layers[0].attention.wq, m.layers[0].attention.wk, m.layers[0].attention.wv) is not None
        assert packed(m.layers[0].feed_forward.w1, m.layers[0].feed_forward.w3) is not None
    ptokens, plogits = _run("whole-packed", overrides)
    assert ptokens == tokens
    assert float((plogits - logits).abs().max() / logits.abs().max()) < 1e-12


def test_load_model_packs_and_the_parameters_keep_their_names_and_values():
    m = load_model("tiny", dtype=torch.float64).model
    ref = load_model("tiny", dtype=torch.float64).model.to(torch.float32)  # .to(): copies, no longer packed
    att = m.layers[0].attention
    with torch.no_grad():
        assert packed(att.wq, att.wk, att.wv) is not None
        r = ref.layers[0].attention
        assert packed(r.wq, r.wk, r.wv) is None
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        assert p.shape == q.shape and torch.equal(p.float(), q), n


def test_packed_is_refused_with_gradients_and_over_separate_storages():
    m = tc.model(None, "whole-packed").model
    att = m.layers[0].attention
    assert packed(att.wq, att.wk, att.wv) is None  # gradients recorded: the separate projections
    X = np.zeros((8, 4))
    a, b = torch.from_numpy(X[:3]), torch.from_numpy(X[3:])  # back to back in memory, two storages
    assert a.data_ptr() + a.numel() * a.element_size() == b.data_ptr()
    assert adjacent([a, b]) is None
    whole = torch.zeros(8, 4)
    assert adjacent([whole[:3], whole[3:]]).shape == (8, 4)
    assert adjacent([whole[3:], whole[:3]]) is None  # out of order


def test_pack_model_skips_wrapped_projections():
    m = tc.model(None, "whole").model
    m.layers[0].attention.wk = torch.nn.Sequential(m.layers[0].attention.wk)  # a stand-in for an adapter
    pack_model(m)
    with torch.no_grad():
        a0, a1 = m.layers[0].attention, m.layers[1].attention
        assert packed(a1.wq, a1.wk, a1.wv) is not None
        assert packed(a0.wq, a0.wk[0], a0.wv) is None


def test_load_model_leaves_every_parameter_trainable():
    # packing is a layout: a model trained after load_model trains its q/k/v and gate/up weights
    # too (they were frozen, requires_grad=False, and an optimizer skipped them silently)
    m = load_model("tiny", dtype=torch.float64).model
    assert [n for n, p in m.named_parameters() if not p.requires_grad] == []
    wq = m.layers[0].attention.wq.weight
    before = wq.detach().clone()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m.train()
    x = torch.randn(1, 8, m.args.dim, dtype=torch.float64)
    m.layers[0].attention.qkv(x, *m.ropes(torch.arange(8), torch.float64, 8)[0])[0].sum().backward()
    opt.step()
    assert not torch.equal(wq.detach(), before)
    with torch.no_grad():  # still one storage: the step updated the views in place
        att = m.layers[0].attention
        assert packed(att.wq, att.wk, att.wv) is not None



def test_adjacent_gives_the_rows_in_order_for_one_row_views():
    # a (1, K) view is contiguous whatever its row stride: the packed view must not take that
    # stride for its rows
    X = torch.arange(32.0).view(4, 8)
    a, b = X[0:1, :4], X[0:1, 4:]
    w = adjacent([a, b])
    assert w is None or torch.equal(w, torch.cat([a, b]))


@pytest.mark.parametrize("lean", [False, True])
def test_raw_qkv_holds_on_every_checkpoint_path(lean):
    # Hooks.raw_qkv: the tensor-parallel step norms and ropes q/k after its gather, so a layer
    # that ropes them too (the pointwise / offload policies' lean path did) ropes them twice
    from burstengine.model import Hooks

    m = tc.model(None, "whole", qk_norm=True).model
    b = m.layers[0]
    x = torch.randn(1, 1, m.args.dim, dtype=torch.float64)
    cos, sin = m.ropes(torch.tensor([5]), torch.float64, 6)[0]
    b.hooks = Hooks(raw_qkv=True)
    with torch.no_grad():
        q, k, v = b.pre_attention(x, cos, sin, lean=lean)
        h = b.attention_norm(x)
        att = b.attention
        for got, lin in zip((q, k, v), (att.wq, att.wk, att.wv)):
            assert torch.allclose(got.flatten(2), lin(h), rtol=1e-12, atol=1e-12)
