"""checkpoint="auto": per-layer checkpointing policies planned from an activation budget.  The
plan is a pure function of the byte counts (tested against every plan), and a model trained under a
mixed plan gives the loss and gradients of the float64 reference, since every policy is exact."""
import dataclasses
import itertools

import pytest

import train_cases as tc
from burstengine.model import recompute as C
from burstengine.model import PRESETS

# kept bytes grow up the ladder (offload and full-offload keep nothing on the device; offload's
# host copy is what pointwise keeps, full-offload's the block input), a recomputing layer's
# backward holds a whole layer's activations (full-offload's its input back too), a pointwise
# one's a little, an offload one's two layers' copies: integer shapes of the real ratios, and one
# where pointwise is nearly as dear as none and its transient large.  Last: host bytes per layer
# of each host policy.
CASES = [({"full-offload": 0, "full": 1, "sequence": 3, "offload": 0, "pointwise": 7, "none": 10},
          {"full-offload": 12, "full": 10, "sequence": 10, "offload": 16, "pointwise": 2, "none": 0},
          {"offload": 7, "full-offload": 1}),
         ({"full-offload": 0, "full": 2, "sequence": 3, "offload": 0, "pointwise": 9, "none": 10},
          {"full-offload": 14, "full": 10, "sequence": 10, "offload": 25, "pointwise": 7, "none": 0},
          {"offload": 9, "full-offload": 2})]


def _cost(plan, per, transient):
    return C.plan_bytes(plan, per, transient)


def _recompute(plan):
    """How much a plan recomputes or copies, most expensive first: layers that recompute attention
    with their input on the host, then on the device, then projections, then copy to the host,
    then recompute pointwise ops (compare lexicographically)."""
    return tuple(plan.count(p) for p in C.LADDER[:-1])


def _host(plan, host_per):
    """Host bytes of a plan; None where it uses a host policy with no host bytes (not planned)."""
    if any(p in C.HOST and not host_per.get(p) for p in plan):
        return None
    return sum(host_per[p] for p in plan if p in C.HOST)


def _check_plans(n, per, transient, budgets, host_per=None, host_budget=0):
    """plan_layers over ``budgets`` (ascending) against every plan of n layers."""
    host_per = host_per if host_budget else {}
    every = [(_cost(q, per, transient), _recompute(q)) for q in itertools.product(C.LADDER, repeat=n)
             if _host(q, host_per) is not None and _host(q, host_per) <= host_budget]
    last = None
    for budget in budgets:
        plan = C.plan_layers(n, per, budget, transient, host_per, host_budget)
        assert len(plan) == n and set(plan) <= set(C.LADDER) <= set(C.POLICIES)
        assert plan == sorted(plan, key=C.ORDER.index)
        assert _host(plan, host_per) <= host_budget
        fitting = [r for c, r in every if c <= budget]
        if not fitting:  # nothing fits: every layer fully recomputed
            assert plan == ["full"] * n, (budget, plan)
            continue
        assert _cost(plan, per, transient) <= budget, (budget, plan)
        # no plan that fits recomputes less
        assert _recompute(plan) == min(fitting), (budget, plan)
        if budget >= n * per["none"]:
            assert plan == ["none"] * n, (budget, plan)
        # more budget never recomputes more (than the plan that fitted a smaller one)
        assert last is None or _recompute(plan) <= last, (budget, plan)
        last = _recompute(plan)


def test_plan_bytes():
    per, transient, _ = CASES[0]
    assert C.plan_bytes(["none", "sequence"], per, transient) == 10 + 3 + 10
    # host layers come first and run backward last, after the others have freed theirs
    assert C.plan_bytes(["offload", "none", "none"], per, transient) == max(16, 20)
    assert C.plan_bytes(["offload", "pointwise"], per, transient) == max(16, 7 + 2)
    assert C.plan_bytes(["offload"] * 3, per, transient) == 16
    assert C.plan_bytes(["full-offload", "offload", "full"], per, transient) == max(12, 16, 1 + 10)
    assert C.plan_bytes(["full-offload"] * 2, per, transient) == 12


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("n", range(1, 7))
@pytest.mark.parametrize("host_layers", [0, 1, 3, 6])
def test_plan_is_the_least_recompute_that_fits(n, case, host_layers):
    per, transient, host_per = CASES[case]
    if host_layers > n:
        pytest.skip("as many host layers as layers")
    unit = host_per["offload"]
    host_budget = host_layers * unit + unit // 2  # room for host_layers offload layers, not one more
    _check_plans(n, per, transient, range(_cost(["none"] * n, per, transient) + 3), host_per,
                 host_budget if host_layers else 0)


@pytest.mark.parametrize("n", [1, 2, 3, 28])
def test_plan_of_llama_3b_at_every_threshold(n):
    """The real byte counts (bf16, 64K tokens), budgets at and just under every plan's cost
    (every plan of up to 3 layers; 28 layers: the uniform plans and one-off mixes)."""
    a = PRESETS["llama-3b"]
    per = {k: v * 65536 for k, v in C.activation_bytes(a, 2).items()}
    transient = {k: v * 65536 for k, v in C.transient_bytes(a, 2).items()}
    if n <= 3:
        plans = itertools.product(C.LADDER, repeat=n)
    else:
        plans = [[p] * n for p in C.LADDER] + [[p] + [q] * (n - 1) for p in C.LADDER for q in C.LADDER]
    costs = sorted({_cost(list(q), per, transient) for q in plans})
    budgets = [0] + sorted({b for c in costs for b in (c - 1, c)})
    if n <= 3:
        _check_plans(n, per, transient, budgets)
        return
    last = None
    for budget in budgets:
        plan = C.plan_layers(n, per, budget, transient)
        assert plan == ["full"] * n or _cost(plan, per, transient) <= budget
        assert last is None or _recompute(plan) <= last
        last = _recompute(plan)
    assert C.plan_layers(n, per, n * per["none"], transient) == ["none"] * n
    assert C.plan_layers(n, per, n * per["pointwise"] + transient["pointwise"], transient) == ["pointwise"] * n


def test_bytes_grow_with_what_is_kept():
    a = PRESETS["llama-3b"]
    b = C.activation_bytes(a, 2)
    kept = [p for p in C.LADDER if p not in C.HOST]
    assert [b[p] for p in kept] == sorted(b[p] for p in kept) and len({b[p] for p in kept}) == len(kept)
    assert b["offload"] == b["full-offload"] == 0
    assert C.host_bytes(a, 2) == {"offload": b["pointwise"], "full-offload": b["full"]}
    d, q, kv, f, H = a.dim, a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.ffn_dim, a.n_heads
    assert b["full"] == 2 * d
    assert b["pointwise"] == 2 * (2 * d + 2 * q + 2 * kv + 2 * f) + 4 * H
    assert b["none"] == 2 * (4 * d + 2 * q + 2 * kv + 3 * f) + 4 * H + 8
    assert 0.6 < b["pointwise"] / b["none"] < 0.72  # the point of the policy: ~2/3 of none
    t = C.transient_bytes(a, 2)
    assert t["full"] == t["sequence"] == b["none"] and t["none"] == 0 < t["pointwise"] < b["pointwise"]
    assert t["offload"] == 2 * b["pointwise"] + t["pointwise"]
    assert t["full-offload"] == b["none"] + 2 * b["full"]  # its input back, and the next one's on its way
    # q/k norms: pointwise and none keep q and k before them (and their 1/rms); full and sequence do not
    bq = C.activation_bytes(dataclasses.replace(a, qk_norm=True), 2)
    extra = 2 * (q + kv) + 4 * (H + a.n_kv_heads)
    assert {p: bq[p] - b[p] for p in b} == {"full": 0, "sequence": 0, "offload": 0, "full-offload": 0,
                                            "pointwise": extra, "none": extra}


def test_default_budget_unknown_on_cpu():
    import torch
    assert C.default_budget(10, torch.device("cpu")) is None


def _budget_gib(between):
    """A budget (GiB) for the small model at its 32 local tokens (batch 2 x seq_len 32 over cp=2,
    float32) that holds ``between``: policy -> layers (the rest "full"), with its transient."""
    a = tc.small_config().model
    per = {k: v * 2 * 16 for k, v in C.activation_bytes(a, 4).items()}
    transient = {k: v * 2 * 16 for k, v in C.transient_bytes(a, 4).items()}
    plan = [p for p, n in between.items() for _ in range(n)]
    plan += ["full"] * (a.n_layers - len(plan))
    return _cost(plan, per, transient) / 2**30


@pytest.mark.parametrize("budget,expect", [
    (1e-9, ["full", "full"]), (100.0, ["none", "none"]),
    # the small model's 2 layers: both keep attention only; both pointwise; one keeps everything
    ({"sequence": 2}, ["sequence", "sequence"]),
    ({"pointwise": 2}, ["pointwise", "pointwise"]),
    ({"none": 1, "pointwise": 1}, ["none", "pointwise"]),
], ids=["full", "none", "sequence", "pointwise", "none+pointwise"])
def test_mixed_plan_is_exact(pool, budget, expect):
    from test_train import reference, check_same

    budget_gib = budget if isinstance(budget, float) else _budget_gib(budget)
    plan, loss, grads = pool.run(tc.auto_plan, budget_gib, ["cp=2"], world=2)[0]
    assert plan == expect, plan
    check_same((loss, grads), reference(None, 1))


def test_the_plan_counts_the_sharded_state_in_the_forward(pool):
    """checkpoint="auto" plans in the first forward, when FSDP2 has unsharded the root's parameters
    (embedding, LM head): counted then, they weighed whole, the budget for activations shrank (~4
    GiB at 8B over 4 ranks) and the plan recomputed more layers than the one the trainer printed."""
    for before, seen in pool.run(tc.planned_state, world=2):
        assert seen and all(s == before for s in seen), (before, seen)


def test_torch_cp_plans_no_sequence_layers():
    """Under torch's context_parallel (attention='torch-cp') a layer's tokens are a shard that
    torch's ring attends across: sequence-level checkpointing's own ring would attend within the
    shard only.  "auto" must plan "selective" where it would plan "sequence", and an explicit
    "sequence" layer must refuse."""
    import torch
    from burstengine.model import ContextParallel, Transformer
    from burstengine.model.recompute import sequence

    a = tc.small_config().model
    budget = int(_budget_gib({"sequence": 2}) * 2**30)
    plans = {}
    for outside in (False, True):
        m = Transformer(a, checkpoint="auto", activation_budget=budget)
        m.set_context_parallel(ContextParallel(attention="torch-cp" if outside else None))
        plans[outside] = m.plan_checkpointing(32, 4, torch.device("cpu"))
        # the same plan as packed documents get, whose layers cannot run the ring either
        assert plans[outside] == (m.plan_checkpointing(32, 4, torch.device("cpu"), sparse=True) if outside
                                  else ["sequence"] * 2), (outside, plans[outside])
    assert "sequence" not in plans[True], plans
    blk = m.layers[0]
    x = torch.randn(1, 8, a.dim)
    with pytest.raises(ValueError, match="torch's context_parallel"):
        sequence(blk, x, None, None)
