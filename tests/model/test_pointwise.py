"""checkpoint="pointwise": every matmul's output and the attention kept, the two RMSNorms and
the MLP's gate recomputed in backward by two autograd Functions (model/pointwise.py).  The loss
and gradients equal checkpoint="none"'s in float64 (q/k/v biases, q/k norms, Gemma's options,
an odd length);
each Function keeps exactly its pointwise inputs and the weights, and one block what
checkpointing.activation_bytes says; frozen inputs, unused outputs and bf16 behave as
nn.Linear does; differentiating the gradients again raises."""
import dataclasses

import pytest
import torch
import torch.nn as nn

from burstengine.comm.dist import LOCAL
from burstengine.model import recompute as C
from burstengine.model import fused
from burstengine.model import pointwise as P
from burstengine.model import PRESETS, ContextParallel, Transformer
from burstengine.model.layers import RMSNorm
from burstengine.testing import rel_err

EXACT = 1e-12  # float64: the same arithmetic, only the order of the three projections' sums differs


def reference(args):
    """A float64 model under "none" with random biases and norm weights, so that they matter."""
    ref = Transformer(args, checkpoint="none").double()
    ref.init_weights(0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return ref


def _pair(args, n_layers=2):
    """Models under "none" and "pointwise" with the same float64 weights (:func:`reference`)."""
    args = dataclasses.replace(args, n_layers=n_layers)
    ref = reference(args)
    lean = Transformer(args, checkpoint="pointwise").double()
    lean.load_state_dict(ref.state_dict())
    return ref, lean


def _loss_and_grads(model, tokens, labels):
    loss = model(tokens, torch.arange(tokens.shape[1]), labels)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


# Gemma 3's options: its RMSNorm (1 + weight), sandwich norms, q/k norms, GeGLU, scales, per-layer windows and RoPEs
GEMMA = dict(qk_norm=True, norm_plus_one=True, sandwich_norm=True, activation="gelu_tanh", embed_scale=True,
             query_pre_attn_scalar=20.0, window=5, window_layers="sf", local_rope_theta=500.0)


@pytest.mark.parametrize("qkv_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["noqknorm", "qknorm"])
def test_loss_and_grads_equal_none(qkv_bias, qk_norm):
    _check_equal_none(dataclasses.replace(PRESETS["tiny"], qkv_bias=qkv_bias, qk_norm=qk_norm))


def test_gemma_loss_and_grads_equal_none():
    _check_equal_none(dataclasses.replace(PRESETS["tiny"], **GEMMA))


def _check_equal_none(a):
    ref, lean = _pair(a)
    assert all(b.policy == "pointwise" for b in lean.layers)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, a.vocab_size, (2, 37), generator=g)  # an odd length
    labels = torch.randint(0, a.vocab_size, (2, 37), generator=g)
    rloss, rgrads = _loss_and_grads(ref, tokens, labels)
    loss, grads = _loss_and_grads(lean, tokens, labels)
    assert abs(loss - rloss) <= EXACT * abs(rloss)
    assert grads.keys() == rgrads.keys()
    assert all(rgrads[n].abs().max() > 0 for n in rgrads)  # biases and norm weights included
    worst = max((rel_err(grads[n], rgrads[n]), n) for n in rgrads)
    assert worst[0] <= EXACT, worst


def _linears(d, widths, bias, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for w in widths:
        lin = nn.Linear(d, w, bias=bias).to(dtype)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(w, d, generator=g))
            if bias:
                lin.bias.copy_(torch.randn(w, generator=g))
        out.append(lin)
    return out


def _grads(outs, wrt, seed=3):
    """Gradients of sum(out * fixed random) over ``outs`` (None outputs are unused: the
    parameters only they depend on get zeros) for ``wrt``."""
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs if o is not None)
    return torch.autograd.grad(loss, wrt, materialize_grads=True)


@pytest.mark.parametrize("frozen", ["none", "input", "norm+first"])
def test_functions_match_autograd(frozen):
    """norm_linears and gate_linear against the plain composition: every gradient, with parts
    frozen (ctx.needs_input_grad) and an unused output (no gradient reaches it)."""
    dt, d, f = torch.float64, 24, 40
    x = torch.randn(3, 7, d, dtype=dt, requires_grad=frozen != "input")
    norm = RMSNorm(d, 1e-5).to(dt)
    with torch.no_grad():
        norm.weight.add_(torch.randn(d, dtype=dt))
    lins = _linears(d, (16, 8, 8), True, dt)
    if frozen == "norm+first":
        norm.weight.requires_grad_(False)
        lins[0].weight.requires_grad_(False)
        lins[0].bias.requires_grad_(False)
    wrt = [t for t in (x, norm.weight, *(p for l in lins for p in l.parameters())) if t.requires_grad]
    for used in ({0, 1, 2}, {0, 2}):
        plain = [lin(norm(x)) for lin in lins]
        lean = P.norm_linears(x, norm, *lins)
        assert all(rel_err(o, r) <= EXACT for o, r in zip(lean, plain))
        got = _grads([o if i in used else None for i, o in enumerate(lean)], wrt)
        ref = _grads([o if i in used else None for i, o in enumerate(plain)], wrt)
        assert all(rel_err(a, b) <= EXACT for a, b in zip(got, ref))

    gate = torch.randn(3, 7, f, dtype=dt, requires_grad=True)
    up = torch.randn(3, 7, f, dtype=dt, requires_grad=frozen != "input")
    (w2,) = _linears(f, (d,), False, dt, seed=4)
    wrt = [t for t in (gate, up, w2.weight) if t.requires_grad]
    got = _grads([P.gate_linear(gate, up, w2)], wrt)
    ref = _grads([w2(fused.swiglu(gate, up))], wrt)
    assert all(rel_err(a, b) <= EXACT for a, b in zip(got, ref))


def test_bf16_gradients_come_in_the_weights_dtype():
    """bf16 activations and weights (FSDP2's mixed precision): every gradient in the dtype of its
    tensor, and equal to nn.Linear's up to bf16 rounding."""
    dt, d, f = torch.bfloat16, 32, 48
    x = torch.randn(2, 5, d, dtype=dt, requires_grad=True)
    norm = RMSNorm(d, 1e-5).to(dt)
    lins = _linears(d, (16, 8), True, dt)
    wrt = [x, norm.weight, *(p for l in lins for p in l.parameters())]
    got = _grads(P.norm_linears(x, norm, *lins), wrt)
    ref = _grads([lin(norm(x)) for lin in lins], wrt)
    for t, a, b in zip(wrt, got, ref):
        assert a.dtype == t.dtype == b.dtype
        assert rel_err(a, b) <= 2e-2
    g, u = (torch.randn(2, 5, f, dtype=dt, requires_grad=True) for _ in range(2))
    (w2,) = _linears(f, (d,), False, dt)
    got = _grads([P.gate_linear(g, u, w2)], [g, u, w2.weight])
    ref = _grads([w2(fused.swiglu(g, u))], [g, u, w2.weight])
    for a, b, t in zip(got, ref, (g, u, w2.weight)):
        assert a.dtype == t.dtype and rel_err(a, b) <= 2e-2


def _saved(fn, skip=()):
    """{storage pointer: bytes} of what autograd keeps for backward while running ``fn``,
    one entry per storage (views of one tensor count once), ``skip``'s storages left out."""
    skip = {t.untyped_storage().data_ptr() for t in skip}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return seen, out


def test_functions_keep_only_their_inputs_and_weights():
    d = 16
    x = torch.randn(2, 5, d, requires_grad=True)
    norm = RMSNorm(d, 1e-5)
    lins = _linears(d, (12, 4, 4), True, torch.float32)
    seen, _ = _saved(lambda: P.norm_linears(x, norm, *lins))
    want = [x, norm.weight, *(l.weight for l in lins)]  # not the normed x, not the biases
    assert seen == {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in want}
    g, u = (torch.randn(2, 5, 24, requires_grad=True) for _ in range(2))
    (w2,) = _linears(24, (d,), False, torch.float32)
    seen, _ = _saved(lambda: P.gate_linear(g, u, w2))
    assert seen == {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (g, u, w2.weight)}


@pytest.mark.parametrize("options", [{}, {"qk_norm": True}, GEMMA], ids=["llama", "qknorm", "gemma"])
def test_block_keeps_what_activation_bytes_says(options):
    """One block's saved activations (parameters and the shared cos/sin tables left out), float32
    on CPU through BurstAttention (lse float32, as on GPUs): ``pointwise`` keeps exactly
    activation_bytes' count; ``none`` keeps its count plus what the eager ops keep beyond the
    fused kernels (each RMSNorm's float32 normalised input: d for each block norm, a + kv for the
    q/k norms; the gate's act(gate): f), and so does ``pointwise`` for the norms it runs under
    autograd (q/k norms, Gemma's output norms).  Gemma's eager norms also keep 1 + weight, per
    layer, not per token."""
    a = dataclasses.replace(PRESETS["tiny"], **dict(options, n_layers=1, window_layers=options.get("window_layers", "")[:1]))
    model = Transformer(a)
    model.init_weights(0)
    model.set_context_parallel(ContextParallel(group=LOCAL))
    B, n = 2, 37
    x = torch.randn(B, n, a.dim, requires_grad=True)
    cos, sin = model.ropes(torch.arange(n), torch.float32)[model.layers[0].rope_index]
    block = model.layers[0]
    d, f = a.dim, a.ffn_dim
    qk = (a.n_heads + a.n_kv_heads) * a.head_dim * a.qk_norm
    out = 2 * d * a.sandwich_norm
    per_token = C.activation_bytes(a, 4)
    eager = {"pointwise": 4 * (qk + out), "none": 4 * (2 * d + f + qk + out)}
    plus_one = {"pointwise": 4 * (out + 2 * a.head_dim * a.qk_norm), "none": 4 * (2 * d + out + 2 * a.head_dim * a.qk_norm)}
    kept = {}
    for policy in ("none", "pointwise"):
        block.policy = policy
        seen, y = _saved(lambda: block(x, cos, sin), skip=(*model.parameters(), cos, sin))
        kept[policy] = sum(seen.values())
        want = B * n * (per_token[policy] + eager[policy]) + plus_one[policy] * a.norm_plus_one
        assert kept[policy] == want, policy
        y.sum().backward()
    assert kept["pointwise"] < kept["none"]


def test_double_backward_raises():
    """First-order gradients under create_graph=True are exact; differentiating them again,
    whether by backward() or by autograd.grad towards the parameters, raises."""
    ref, lean = _pair(PRESETS["tiny"], n_layers=1)
    tokens = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(0))
    params = list(lean.parameters())
    _, rgrads = _loss_and_grads(ref, tokens, tokens)
    for second in ("grad", "backward"):
        grads = torch.autograd.grad(lean(tokens, torch.arange(9), tokens), params, create_graph=True)
        for (name, _), g in zip(lean.named_parameters(), grads):
            assert rel_err(g.detach(), rgrads[name]) <= EXACT, name
        total = sum((g * g).sum() for g in grads)
        with pytest.raises(RuntimeError, match="(norm_linears|gate_linear).* does not support double backward"):
            if second == "grad":
                torch.autograd.grad(total, params, allow_unused=True)
            else:
                total.backward()


def test_policy_is_accepted_by_model_and_config():
    from burstengine.train import load

    C.check("pointwise")
    assert load("tiny", ["activation_checkpoint=pointwise"]).activation_checkpoint == "pointwise"
