"""torch.compile(fullgraph=True) through burst_attn_func (the burstengine::burst_attn custom op)
and through a decoder block, inductor on CPU, on 1 and 2 gloo ranks: no graph break, and the
same outputs and gradients as the eager call."""
import pytest

import compile_cases

TOL = 1e-5  # float32; the op runs the eager loops, only the ops around it are compiled


# each compiled variant costs seconds of inductor's C++ build: every case on two ranks, two on one
@pytest.mark.parametrize("world,cases", [(1, (0, 2)), (2, None)], ids=["world1", "world2"])
def test_attention_compiles_fullgraph(pool, world, cases):
    per_rank = pool.run(compile_cases.attention, 3, cases, world=world)
    assert len(per_rank[0]) == len(cases or compile_cases.ATTENTION_CASES)
    for rank, rows in enumerate(per_rank):
        for r in rows:
            where = f"rank {rank} case {compile_cases.ATTENTION_CASES[r['case']]}"
            assert (r["breaks"], r["ops"]) == (0, 1), where  # one graph, the call in it as the custom op
            for key in ("out", "lse", "dq", "dk", "dv"):
                assert r[key] <= TOL, f"{where}: {key} rel err {r[key]:.2e}"


# full: the block under torch.utils.checkpoint (a higher-order op around the custom op)
@pytest.mark.parametrize("world,policy,options", [(1, "full", None), (2, "none", None),
                                                  (2, "none", compile_cases.GEMMA)], ids=["full", "none", "gemma"])
def test_block_compiles_fullgraph(pool, world, policy, options):
    for rank, r in enumerate(pool.run(compile_cases.block, 5, policy, options, world=world)):
        assert (r["breaks"], r["ops"]) == (0, 1), f"rank {rank}"
        assert max(r["errs"]) <= TOL, f"rank {rank}: errors {r['errs']}"


def test_bad_calls_raise_on_every_rank(pool):
    per_rank = pool.run(compile_cases.bad_calls, world=2)
    for rank, seen in enumerate(per_rank):
        kind, msg = seen["disagree"]
        assert kind == "ValueError" and "disagree on causal" in msg, (rank, seen["disagree"])
        kind, msg = seen["window"]
        assert kind == "ValueError" and "window must be a positive int" in msg and "rank 1" in msg, (rank, msg)
        kind, msg = seen["mesh"]
        assert "DeviceMesh" in msg and "NxM" in msg, (rank, msg)


def test_call_encoding_round_trips():
    """The custom op takes the AttnCall as one string plus the two mask tensors: decode(encode(c))
    gives back every field (a float scale exactly, inf included; a Topology as "NxM"; LOCAL; a
    cu_seqlens list as an int64 tensor), and a field no schema carries raises naming it."""
    import math

    import torch
    from burstengine.attention.call import AttnCall, MaskArgs
    from burstengine.attention.compiled import decode, encode
    from burstengine.comm.dist import LOCAL
    from burstengine.schedule import Topology

    bm = torch.ones(2, 2, dtype=torch.bool)
    for call in (AttnCall(),
                 AttnCall(group=LOCAL, layout="zigzag", softmax_scale=0.1, backward="ring", kernel="reference",
                          topology=Topology(2, 4), mask=MaskArgs(causal=True, window=3, cu_seqlens=[0, 5, 8])),
                 AttnCall(softmax_scale=float("inf"), topology=None, mask=MaskArgs(block_mask=bm, block_size=4)),
                 AttnCall(softmax_scale=2, topology="single", kernel="it's\n=odd")):
        text, cu, mask = encode(call)
        got = decode(text, cu, mask)
        for name in ("group", "layout", "backward", "kernel"):
            assert getattr(got, name) is getattr(call, name) or getattr(got, name) == getattr(call, name), name
        want_scale = None if call.softmax_scale is None else float(call.softmax_scale)
        assert got.softmax_scale == want_scale or math.isinf(got.softmax_scale) and math.isinf(want_scale)
        topology = call.topology
        assert got.topology == (f"{topology.nodes}x{topology.gpus_per_node}" if isinstance(topology, Topology)
                                else topology)
        for name in ("causal", "window", "block_size"):
            assert getattr(got.mask, name) == getattr(call.mask, name), name
        assert got.mask.block_mask is call.mask.block_mask
        if call.mask.cu_seqlens is None:
            assert got.mask.cu_seqlens is None
        else:
            assert got.mask.cu_seqlens.dtype == torch.int64 and got.mask.cu_seqlens.tolist() == call.mask.cu_seqlens
    with pytest.raises(ValueError, match="window must be an int or None"):
        encode(AttnCall(mask=MaskArgs(window=2.0)))


def test_fused_ops_past_the_recompile_limit():
    """model/fused.py compiles with fullgraph=True, where dynamo's recompile limit (8) is a hard
    error (hit on an H200 by rms_norm in one 8B decode bench): past it the op compiles on under a
    limit of its own, and past that one warns once and runs eager, with the same result."""
    import torch
    import torch._dynamo
    from burstengine.model import fused

    def scaled(x):  # a fresh function: its own dynamo cache
        return (x.to(torch.float32) * 3.0).to(x.dtype)

    xs = [torch.ones(4, dtype=dt) for dt in (torch.float32, torch.float64, torch.bfloat16, torch.float16)]
    before = fused._RECOMPILE_LIMIT
    fused._RECOMPILE_LIMIT = 2
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            assert torch.equal(fused._run_compiled(scaled, xs[0]), scaled(xs[0]))
            assert torch.equal(fused._run_compiled(scaled, xs[1]), scaled(xs[1]))  # the second limit
            assert fused._compiled[scaled][0] is not scaled and fused._compiled[scaled][1]
            with pytest.warns(UserWarning, match="runs eager"):
                assert torch.equal(fused._run_compiled(scaled, xs[2]), scaled(xs[2]))
            assert fused._compiled[scaled][0] is scaled  # eager from now on, without another warning
            assert torch.equal(fused._run_compiled(scaled, xs[3]), scaled(xs[3]))
    finally:
        fused._RECOMPILE_LIMIT = before
        fused._compiled.pop(scaled, None)


def test_fused_gemma_ops_compile_to_the_eager_arithmetic():
    """Gemma's RMSNorm (1 + weight) and GeGLU through model/fused.py's compiled path (inductor on
    CPU here, Triton on GPUs) against the eager functions, float32 and bfloat16."""
    import torch
    from burstengine.model import fused

    g = torch.Generator().manual_seed(0)
    for dt, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        x, gate, up = (torch.randn(3, 5, 24, generator=g).to(dt) for _ in range(3))
        w = (0.5 * torch.randn(24, generator=g)).to(dt)
        for got, want in ((fused._run_compiled(fused.rms_norm_eager, x, w, 1e-6, True),
                           fused.rms_norm_eager(x, w, 1e-6, True)),
                          (fused._run_compiled(fused.geglu_eager, gate, up), fused.geglu_eager(gate, up))):
            assert got.dtype == want.dtype == dt
            assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
    # 1 + weight, not weight: the norm of a zero weight is the plain normalisation
    assert torch.allclose(fused.rms_norm_eager(x.float(), torch.zeros(24), 1e-6, True),
                          fused.rms_norm_eager(x.float(), torch.ones(24), 1e-6))


def test_prefill_compiles_the_fused_ops_once_for_any_length(monkeypatch):
    """A prefill at a new prompt length compiles nothing new (model/fused.py's any_length: the
    batch and token dims are dynamic from the first compile), where a run outside it (training's
    forward) specialises the first length and compiles again at the second: the first-call
    penalty of a new length on a GPU.  Counted with a backend that records each graph dynamo
    hands it (the fused ops run compiled on CPU here)."""
    import torch
    import torch._dynamo
    from burstengine.inference import prefill
    from burstengine.inference.models import OurLlama, random_llama
    from burstengine.model import ModelArgs, fused

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(fused, "_BACKEND", counting)
    monkeypatch.setattr(fused, "_use_compiled", lambda x: x.dtype != torch.float64)
    monkeypatch.setattr(fused, "_compiled", {})
    torch._dynamo.reset()
    a = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=96)
    model = OurLlama(random_llama(a, "cpu", torch.float32, seed=0), "compile test")
    g = torch.Generator().manual_seed(0)
    counts = []
    try:
        for n in (40, 56, 72, 33):
            prefill(model, torch.randint(0, 97, (1, n), generator=g), layout="contiguous")
            counts.append(len(graphs))
        # chunked: pieces of one size and a remainder, also nothing new
        prefill(model, torch.randint(0, 97, (1, 90), generator=g), layout="contiguous", chunk=32)
        counts.append(len(graphs))
        assert counts[0] > 0 and counts[1:] == [counts[0]] * 4, counts
        # training's forward (outside any_length) specialises a length, then compiles again
        with torch.no_grad():
            for n in (24, 48):
                model.model(torch.randint(0, 97, (2, n), generator=g), torch.arange(n))
        assert len(graphs) >= counts[-1] + 2, (counts, len(graphs))
    finally:
        torch._dynamo.reset()
