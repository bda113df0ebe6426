"""checkpoint="offload": a pointwise layer whose saved tensors wait in host memory (model/offload.py).
On CPU the host copy is a plain copy, so these tests prove the bookkeeping: float64 loss and
gradients equal checkpoint="none"'s (alone, in a mixed plan, with two graphs alive, backward
twice); each storage goes out once, parameters and RoPE tables never; each layer is copied back
from the backward of the layer above (the top one at its first use); host buffers are reused
step after step, and a second live graph gets its own.  The overlap is measured on GPUs
(benchmarks/probe_offload.py)."""
import dataclasses
import weakref

import pytest
import torch

from burstengine.model import offload as O
from burstengine.model import PRESETS, Transformer
from burstengine.testing import rel_err
from test_pointwise import reference

EXACT = 1e-12


@pytest.fixture
def offload_all(monkeypatch):
    """Every saved tensor of an offloaded layer goes to the host, however small; a function
    returning the stashes made that are still alive (weak references: a strong one would keep
    their buffers from coming back)."""
    monkeypatch.setattr(O, "MIN_BYTES", 0)
    refs = []
    init = O._Stash.__init__

    def record(self, *a, **kw):
        init(self, *a, **kw)
        refs.append(weakref.ref(self))

    monkeypatch.setattr(O._Stash, "__init__", record)
    return lambda: [s for s in (r() for r in refs) if s is not None]


def _models(policies, **over):
    a = dataclasses.replace(PRESETS["tiny"], n_layers=len(policies), **over)
    ref = reference(a)
    model = Transformer(a, checkpoint="none").double()
    model.load_state_dict(ref.state_dict())
    for b, p in zip(model.layers, policies):
        b.policy = p
        b.checkpoint_split = 0.5
    return a, ref, model


def _batch(a, seed, n=37):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, a.vocab_size, (2, n), generator=g), torch.randint(0, a.vocab_size, (2, n), generator=g)


def _loss(model, batch):
    tokens, labels = batch
    return model(tokens, torch.arange(tokens.shape[1]), labels)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same(got, want):
    assert got.keys() == want.keys()
    worst = max((rel_err(got[n], want[n]), n) for n in want)
    assert worst[0] <= EXACT, worst


@pytest.mark.parametrize("policies", [("offload",) * 3, ("offload", "none", "sequence"),
                                      ("pointwise", "offload", "full")], ids="-".join)
@pytest.mark.parametrize("over", [{}, {"qkv_bias": True, "qk_norm": True}], ids=["plain", "bias-qknorm"])
def test_loss_and_grads_equal_none(offload_all, policies, over):
    a, ref, model = _models(policies, **over)
    batch = _batch(a, 2)
    want = _loss(ref, batch)
    want.backward()
    got = _loss(model, batch)
    assert [s.index for s in offload_all()] == [i for i, p in enumerate(policies) if p == "offload"]
    assert all(s.host for s in offload_all())  # something went to the host in every offloaded layer
    got.backward()
    assert abs(got.item() - want.item()) <= EXACT * abs(want.item())
    _same(_grads(model), _grads(ref))


def test_keeps_parameters_and_rope_tables_on_the_device(offload_all):
    a, _, model = _models(("offload", "offload"))
    loss = _loss(model, _batch(a, 2))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for s in offload_all():
        assert s.host and not set(s.host) & params
        # the block input, q, k, v, the attention output, the residual, gate and up (and lse, norm statistics)
        assert len(s.host) >= 8, len(s.host)
        # each storage once: as many host copies as distinct storages
        assert len(s.buffers) == len(s.host)
    loss.backward()


def test_layers_come_back_from_the_backward_of_the_layer_above(offload_all, monkeypatch):
    events = []
    fetch, unpack = O._Stash.fetch, O._Stash.unpack

    def logged_fetch(self):
        if not self.device_copy:
            events.append(("fetch", self.index))
        return fetch(self)

    def logged_unpack(self, saved):
        events.append(("use", self.index))
        return unpack(self, saved)

    monkeypatch.setattr(O._Stash, "fetch", logged_fetch)
    monkeypatch.setattr(O._Stash, "unpack", logged_unpack)
    a, _, model = _models(("offload", "offload", "none", "offload"))
    _loss(model, _batch(a, 2)).backward()
    first = {}
    for i, e in enumerate(events):
        first.setdefault(e, i)
    # the top layer has no layer above: fetched at its first use; layer 1 as layer 2's backward
    # starts (after layer 3's), layer 0 as layer 1's starts: each before its own first use
    assert first[("fetch", 3)] == first[("use", 3)] + 1
    assert first[("use", 3)] < first[("fetch", 1)] < first[("use", 1)]
    assert first[("fetch", 1)] < first[("fetch", 0)] < first[("use", 1)] < first[("use", 0)]
    assert [e for e in events if e[0] == "fetch"] == [("fetch", 3), ("fetch", 1), ("fetch", 0)]


def test_host_buffers_are_reused_and_a_second_graph_gets_its_own(offload_all):
    a, ref, model = _models(("offload", "offload", "none"))
    for seed in (2, 3):
        _loss(model, _batch(a, seed)).backward()
    off = model.offloader
    held = off.host_bytes()
    assert held > 0 and len(off._free) == 2 and all(len(sets) == 1 for sets in off._free.values())
    ptrs = {i: [b.data.data_ptr() for b in sets[0]] for i, sets in off._free.items()}
    model.zero_grad()
    _loss(model, _batch(a, 4)).backward()
    assert off.host_bytes() == held  # the same buffers, step after step
    assert {i: [b.data.data_ptr() for b in sets[0]] for i, sets in off._free.items()} == ptrs
    # two forwards before one backward: the second graph must not write into the first's buffers
    model.zero_grad()
    l1, l2 = _loss(model, _batch(a, 5)), _loss(model, _batch(a, 6))
    (l1 + 2 * l2).backward()
    assert all(len(sets) == 2 for sets in off._free.values())
    r1, r2 = _loss(ref, _batch(a, 5)), _loss(ref, _batch(a, 6))
    (r1 + 2 * r2).backward()
    _same(_grads(model), _grads(ref))


def test_backward_twice_with_retain_graph(offload_all):
    a, ref, model = _models(("offload", "offload"))
    loss, want = _loss(model, _batch(a, 2)), _loss(ref, _batch(a, 2))
    loss.backward(retain_graph=True)
    loss.backward()
    want.backward(retain_graph=True)
    want.backward()
    _same(_grads(model), _grads(ref))


def test_no_grad_forward_offloads_nothing(offload_all):
    a, _, model = _models(("offload", "offload"))
    with torch.no_grad():
        _loss(model, _batch(a, 2))
    assert not offload_all()  # nothing saved: each stash gone with its layer
    assert model.offloader.newest() is None


def test_double_backward_is_refused(offload_all):
    a, _, model = _models(("offload",))
    loss = _loss(model, _batch(a, 2))
    (g,) = torch.autograd.grad(loss, model.layers[0].feed_forward.w1.weight, create_graph=True)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        g.sum().backward()


# --- full-offload: full checkpointing with the block input on the host ---------------------------

@pytest.mark.parametrize("policies", [("full-offload",) * 3, ("full-offload", "offload", "none"),
                                      ("full-offload", "sequence", "full")], ids="-".join)
@pytest.mark.parametrize("tiled", [0, 8], ids=["untiled", "tiled-mlp"])
def test_full_offload_equals_none_keeping_only_the_input(offload_all, policies, tiled):
    """float64 loss and gradients of checkpoint="none"; a full-offload layer's host copy is its
    input alone (one dim-wide storage), and it comes back from the backward of the layer above."""
    a, ref, model = _models(policies)
    for b in model.layers:
        b.mlp_chunk = tiled
    batch = _batch(a, 2)
    want = _loss(ref, batch)
    want.backward()
    got = _loss(model, batch)
    stashes = {s.index: s for s in offload_all()}
    assert sorted(stashes) == [i for i, p in enumerate(policies) if p in ("offload", "full-offload")]
    for i, p in enumerate(policies):
        if p == "full-offload":
            (host,) = stashes[i].host.values()
            assert host.numel() == batch[0].numel() * a.dim * 8  # the (2, 37, dim) float64 block input
    got.backward()
    assert abs(got.item() - want.item()) <= EXACT * abs(want.item())
    _same(_grads(model), _grads(ref))


def test_full_offload_layer_whose_input_needs_no_gradient(offload_all):
    """The first layer's input (the embedding's output) needs no gradient when the embedding is
    frozen (LoRA): the layer's parameters still get theirs."""
    a, ref, model = _models(("full-offload", "none"))
    for m in (ref, model):
        m.tok_embeddings.weight.requires_grad_(False)
    batch = _batch(a, 3)
    _loss(ref, batch).backward()
    _loss(model, batch).backward()
    _same(_grads(model), _grads(ref))


def test_a_tensor_subclass_stays_on_the_device(offload_all):
    # torch-native CP's attention saves DTensors, whose storage is not theirs to read: such a
    # tensor stays where it is (it raised "invalid python storage"), the plain ones still go out
    from torch.testing._internal.two_tensor import TwoTensor
    off = O.Offloader("cpu")
    a = torch.randn(64, 64, dtype=torch.float64)
    x = TwoTensor(a.clone(), a.clone()).requires_grad_()
    w = torch.randn(64, 64, dtype=torch.float64, requires_grad=True)
    with off.layer(0):
        y = (x * x).sum() + (torch.sin(w) * 2).sum()
    (stash,) = offload_all()
    assert len(stash.host) == 1  # w, saved by sin; x never
    y.backward()
    assert rel_err(x.grad.a, 2 * a) < EXACT and rel_err(w.grad, 2 * torch.cos(w)) < EXACT
