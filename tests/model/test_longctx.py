"""Training at the longest lengths (issue 36): the tiled MLP (model/tiled.py) equals the plain
MLP in float64, forward and gradients, keeping only its input; the planner's counts for it, for
full-offload and for LoRA / CPU-offloaded states; FSDP2's CPU offload trains as without it and
keeps the optimizer on the host; the host-side gradient clip equals torch's; the line the trainer
says before its first step."""
import dataclasses

import pytest
import torch

import longctx_cases as lx
from burstengine.model import PRESETS, Transformer, lora
from burstengine.model import recompute as C
from burstengine.model import tiled as T
from burstengine.testing import rel_err
from test_pointwise import reference


# --- the tiled MLP ------------------------------------------------------------------------------

def _mlp_inputs(a, n, requires_grad=True):
    torch.manual_seed(0)
    ref = reference(dataclasses.replace(a, n_layers=1))
    blk = ref.layers[0]
    h = torch.randn(2, n, a.dim, dtype=torch.float64, requires_grad=requires_grad)
    return blk, h


@pytest.mark.parametrize("n,chunk", [(37, 8), (37, 37), (37, 64), (16, 4)])
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen-norm"])
def test_tiled_mlp_equals_the_mlp(n, chunk, frozen):
    a = PRESETS["tiny"]
    blk, h = _mlp_inputs(a, n)
    if frozen:
        blk.ffn_norm.weight.requires_grad_(False)
    params = blk._mlp_params()
    dy = torch.randn(2, n, a.dim, dtype=torch.float64)
    want = blk._mlp(h)
    wgrads = torch.autograd.grad(want, [h] + [p for p in params if p.requires_grad], dy)
    got = T.mlp(h, blk._mlp, chunk, params)
    grads = torch.autograd.grad(got, [h] + [p for p in params if p.requires_grad], dy)
    assert rel_err(got, want) <= 1e-14
    for g, w in zip(grads, wgrads):
        assert rel_err(g, w) <= 1e-13
    with torch.no_grad():  # inference: chunks, no Function
        assert rel_err(T.mlp(h, blk._mlp, chunk, params), want) <= 1e-14


def test_tiled_mlp_keeps_only_its_input():
    """What autograd keeps for the tiled MLP: its input and the parameters, nothing ffn-wide."""
    a = PRESETS["tiny"]
    blk, h = _mlp_inputs(a, 37)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        T.mlp(h, blk._mlp, 8, blk._mlp_params())
    params = {p.data_ptr() for p in blk._mlp_params()}
    others = [t for t in saved if t.data_ptr() not in params]
    assert len(others) == 1 and others[0].data_ptr() == h.data_ptr()
    assert not any(t.shape[-1] == a.ffn_dim and t.dim() == 3 for t in saved)


def test_tiled_mlp_input_without_gradient():
    a = PRESETS["tiny"]
    blk, h = _mlp_inputs(a, 21, requires_grad=False)
    params = blk._mlp_params()
    out = T.mlp(h, blk._mlp, 5, params)
    got = torch.autograd.grad(out.square().sum(), params)
    want = torch.autograd.grad(blk._mlp(h).square().sum(), params)
    assert all(rel_err(g, w) <= 1e-13 for g, w in zip(got, want))


def test_tiled_mlp_refuses_double_backward():
    a = PRESETS["tiny"]
    blk, h = _mlp_inputs(a, 9)
    (g,) = torch.autograd.grad(T.mlp(h, blk._mlp, 4, blk._mlp_params()).sum(), h, create_graph=True)
    with pytest.raises(RuntimeError, match="tiled_mlp .* does not support double backward"):
        g.sum().backward()


@pytest.mark.parametrize("world", [1, 2])
def test_trainer_tiled_mlp_equals_untiled(pool, world):
    import train_cases as tc

    off = pool.run(tc.loss_and_grads, None, [f"cp={world}", "tiled_mlp=off"], world=world)[0]
    on = pool.run(tc.loss_and_grads, None, [f"cp={world}", "tiled_mlp=on", "tiled_mlp_chunk=5"], world=world)[0]
    assert abs(on[0] - off[0]) <= 1e-6 * abs(off[0])
    assert all(rel_err(on[1][n], off[1][n]) <= 1e-5 for n in off[1])


# --- the planner's counts -----------------------------------------------------------------------

def test_tiled_counts():
    """Tiling keeps only h for the MLP half: none and pointwise lose the ffn-wide tensors, and the
    transient of a recomputing layer is its tiled none's."""
    a = PRESETS["llama-8b"]
    d, q, kv, f, H = a.dim, a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.ffn_dim, a.n_heads
    b, t = C.activation_bytes(a, 2), C.activation_bytes(a, 2, tiled=True)
    assert b["none"] - t["none"] == 2 * (d + 3 * f) + 4
    assert b["pointwise"] - t["pointwise"] == 2 * 2 * f
    assert {p: t[p] for p in ("full", "sequence", "offload", "full-offload")} == \
        {p: b[p] for p in ("full", "sequence", "offload", "full-offload")}
    tt = C.transient_bytes(a, 2, tiled=True)
    assert tt["full"] == t["none"] and tt["full-offload"] == t["none"] + 2 * 2 * d and tt["pointwise"] == 2 * 2 * d
    assert C.host_bytes(a, 2, tiled=True) == {"offload": t["pointwise"], "full-offload": 2 * d}
    assert T.chunk_bytes(a, 2, 8192) == 2 * (d + 3 * f) * 2 * 8192


def test_auto_tiles_where_the_plan_recomputes_less():
    """tiled_mlp="auto" under checkpoint="auto": the plan with the tiled MLP where it recomputes
    less (here: where the untiled plan recomputes a whole layer), the plain one where they tie
    (here: every budget big enough to keep everything)."""
    a = dataclasses.replace(PRESETS["llama-8b"], n_layers=4)
    tokens = 1 << 15
    with torch.device("meta"):
        m = Transformer(a, checkpoint="auto", tiled_mlp="auto")
    per, tr, _ = m.activation_model(tokens, 2, False)
    # a budget where the untiled model keeps everything: untiled
    m.activation_budget = 4 * per["none"] + tr["none"]
    assert m.plan_checkpointing(tokens, 2, torch.device("cpu")) == ["none"] * 4
    assert all(b.mlp_chunk == 0 for b in m.layers)
    # one where untiled must recompute a whole layer and tiled need not
    per_t, tr_t, _ = m.activation_model(tokens, 2, True)
    m.activation_budget = 4 * per_t["none"] + tr_t["none"]
    assert m.activation_budget < 4 * per["none"]
    assert m.plan_checkpointing(tokens, 2, torch.device("cpu")) == ["none"] * 4
    assert all(b.mlp_chunk == m.mlp_chunk for b in m.layers)
    m.tiled_mlp = "off"
    assert "none" not in m.plan_checkpointing(tokens, 2, torch.device("cpu"))


def test_auto_counts_the_tiled_mlps_own_recompute():
    """The tiled MLP runs every layer's MLP forward again (recompute.plan_cost): auto prefers an
    untiled plan that recomputes only pointwise ops to a tiled one that keeps everything, and the
    tiled one to an untiled plan that re-projects layers or recomputes attention."""
    a = dataclasses.replace(PRESETS["llama-8b"], n_layers=8)
    tokens = 1 << 15
    with torch.device("meta"):
        m = Transformer(a, checkpoint="auto", tiled_mlp="auto")
    per, tr, _ = m.activation_model(tokens, 2, False)
    cpu = torch.device("cpu")

    def plans(frac):
        m.activation_budget = int(frac * (8 * per["none"] + tr["none"]))
        out = {}
        for mode in ("off", "on", "auto"):
            m.tiled_mlp = mode
            out[mode] = (m.plan_checkpointing(tokens, 2, cpu), m.layers[0].mlp_chunk > 0)
        m.tiled_mlp = "auto"
        return out

    p = plans(0.9)  # untiled: some pointwise layers; tiled: everything kept
    assert p["on"][0] == ["none"] * 8 and "pointwise" in p["off"][0]
    assert set(p["off"][0]) <= {"none", "pointwise"}
    assert C.recompute_rank(p["on"][0]) < C.recompute_rank(p["off"][0])  # the layer count alone says tiled
    assert p["auto"] == (p["off"][0], False)
    p = plans(0.6)  # untiled re-projects layers
    assert "sequence" in p["off"][0] and "sequence" not in p["on"][0]
    assert p["auto"] == (p["on"][0], True)
    p = plans(0.2)  # untiled recomputes attention
    assert "full" in p["off"][0] and "full" not in p["on"][0]
    assert p["auto"] == (p["on"][0], True)


def test_full_offload_is_planned_only_when_full_does_not_fit():
    a = dataclasses.replace(PRESETS["llama-8b"], n_layers=8)
    tokens = 1 << 19
    with torch.device("meta"):
        m = Transformer(a, checkpoint="auto", tiled_mlp="on", offload_budget=1 << 50, host_policies=("full-offload",))
    per, tr, host = m.activation_model(tokens, 2, True)
    m.activation_budget = 8 * per["full"] + tr["full"]
    assert m.plan_checkpointing(tokens, 2, torch.device("cpu")) == ["full"] * 8
    m.activation_budget -= per["full"]
    assert m.plan_checkpointing(tokens, 2, torch.device("cpu")) == ["full-offload"] + ["full"] * 7
    m.offload_budget = 0  # no host memory: nothing better than every layer full (which will not fit)
    assert m.plan_checkpointing(tokens, 2, torch.device("cpu")) == ["full"] * 8
    m.offload_budget, m.host_policies = 1 << 50, ()  # no host policy allowed
    assert m.plan_checkpointing(tokens, 2, torch.device("cpu")) == ["full"] * 8


def test_state_bytes_follow_lora_and_cpu_offload():
    """default_budget's parameters and states: 16 bytes a trained float32 parameter, a frozen one
    its own size (LoRA's bf16 base: 2), nothing under CPU offload."""
    a = PRESETS["tiny"]
    m = Transformer(a)
    n = sum(p.numel() for p in m.parameters())
    assert C.state_bytes(m.parameters()) == 16 * n
    lora.apply(m, lora.LoraArgs(rank=2), frozen_dtype=torch.bfloat16)
    adapters = sum(p.numel() for p in lora.adapters(m).values())
    assert C.state_bytes(m.parameters()) == 2 * n + 16 * adapters
    assert C.state_bytes(m.parameters(), on_host=True) == 0
    assert C.default_budget(C.state_bytes(m.parameters()), torch.device("cpu")) is None


# --- CPU offload, the host clip, the fit line -----------------------------------------------------

@pytest.mark.parametrize("extra", [[], ["lora.rank=2"]], ids=["full", "lora"])
def test_cpu_offload_trains_as_without(pool, extra):
    """cpu_offload=true (FSDP2's CPUOffloadPolicy) on CPU ranks: the same losses and weights step
    after step; the optimizer's state on the host; the policy set on the model's units."""
    base = ["cp=2", *extra]
    plain = pool.run(lx.steps_and_placement, 3, base, world=2)[0]
    off = pool.run(lx.steps_and_placement, 3, base + ["cpu_offload=true"], world=2)[0]
    assert off[0] == plain[0]
    assert all(torch.equal(off[1][n], plain[1][n]) for n in plain[1])
    assert off[2] == ["cpu"] and off[3] == "CPUOffloadPolicy" and off[4]
    assert plain[3] == "OffloadPolicy" and not plain[4]


def test_cpu_offload_resumes(pool, tmp_path):
    import train_cases as tc

    extra = ["cp=2", "save_every=1", "cpu_offload=true", "grad_clip=0.5"]
    full = pool.run(tc.run_steps, str(tmp_path / "a"), 3, extra, world=2)[0]
    pool.run(tc.run_steps, str(tmp_path / "b"), 3, extra, stop_after=2, world=2)
    resumed = pool.run(tc.run_steps, str(tmp_path / "b"), 3, extra, resume=True, world=2)[0]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]


@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_host_clip_equals_torch(pool, max_norm):
    host, ref, diff = pool.run(lx.host_clip, max_norm, world=2)[0]
    assert abs(host - ref) <= 1e-6 * ref and diff <= 1e-6


def test_memory_line_before_the_first_step(pool):
    line, need, plan = pool.run(lx.memory_line, ["cp=2", "activation_checkpoint=auto", "lora.rank=2"], world=2)[0]
    assert line.startswith("memory at 32 tokens per rank: not checked (the device's memory is unknown here)")
    assert "\n" not in line and "parameters and states" in line and "kept activations (2 none)" in line
    assert need["tokens"] == 32 and plan == ["none", "none"]


# --- bench train --longest, train --memory-plan ----------------------------------------------------

@pytest.mark.parametrize("limit", [700_000, 131072, 2_000_000, 90_000, 4096])
def test_longest_doubles_then_bisects(limit):
    """``bench train --longest``'s lengths for a method that trains up to ``limit`` tokens: doubling
    from the last --seqs length until one fails, then bisecting (multiples of the unit) until the gap
    is within the resolution; halving while nothing has trained."""
    from burstengine.bench.peers.train import next_longest

    unit, cap, res = 4096, 1 << 22, 0.125
    tried, trained, failed, todo = [], None, None, [131072]
    while todo:
        s = todo.pop()
        tried.append(s)
        if s <= limit:
            trained = max(trained or 0, s)
        else:
            failed = min(failed or s, s)
        nxt = next_longest(trained, failed, cap, unit, res)
        if nxt is not None:
            todo.append(nxt)
    assert len(tried) == len(set(tried)) and all(s % unit == 0 for s in tried)
    if limit < unit:
        assert trained is None
        return
    assert trained <= limit and (failed is None and trained * 2 > cap or failed - trained <= max(unit, res * trained))
    if limit >= 262144:
        assert tried[1] == 262144  # doubling first
    elif limit < 131072:
        assert tried[1] == 65536  # halving while nothing trained


def test_train_memory_plan_says_one_line_and_trains_nothing(tmp_path):
    import cli_cases

    out = tmp_path / "run"
    rc, stdout, stderr = cli_cases.run(["train", "--config", "tiny", "--memory-plan", "--set", f"out_dir={out}",
                                        "--set", "activation_checkpoint=auto", "--set", "tiled_mlp=on"])
    assert rc == 0, stderr
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("memory at 2,048 tokens per rank") and "tiled MLP" in lines[0]
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


def test_auto_ranks_the_tiled_mlp_above_offloaded_layers():
    """recompute.plan_cost puts the tiled MLP's own recompute above ``offload`` layers (they copy
    activations, recompute no matmul): with a host budget, an untiled plan of offload and pointwise
    layers wins over a tiled plan that keeps everything."""
    a = dataclasses.replace(PRESETS["llama-8b"], n_layers=8)
    tokens = 1 << 15
    with torch.device("meta"):
        m = Transformer(a, checkpoint="auto", tiled_mlp="auto", offload_budget=1 << 40,
                        host_policies=("full-offload", "offload"))
    per, tr, _ = m.activation_model(tokens, 2, False)
    m.activation_budget = int(0.6 * (8 * per["none"] + tr["none"]))
    cpu = torch.device("cpu")
    m.tiled_mlp = "off"
    off = m.plan_checkpointing(tokens, 2, cpu)
    m.tiled_mlp = "on"
    on = m.plan_checkpointing(tokens, 2, cpu)
    assert "offload" in off and set(off) <= {"none", "pointwise", "offload"} and on == ["none"] * 8
    m.tiled_mlp = "auto"
    assert m.plan_checkpointing(tokens, 2, cpu) == off and m.layers[0].mlp_chunk == 0
