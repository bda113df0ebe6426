"""checkpoint="auto": per-layer checkpointing policies planned from an activation budget.  The
plan is a pure function of the byte counts (tested by enumeration), and a model trained under a
mixed plan gives the loss and gradients of the float64 reference, since every policy is exact."""
import itertools

import pytest

import train_cases as tc
from burstengine.model import checkpointing as C
from burstengine.model.llama import PRESETS

PER = {"full": 1, "sequence": 3, "none": 10}
ORDER = {"full": 0, "sequence": 1, "none": 2}


def _cost(plan):
    kept = sum(PER[p] for p in plan)
    return kept + (PER["none"] if any(p != "none" for p in plan) else 0)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_plan_is_the_least_recompute_that_fits(n):
    for budget in range(0, 12 * n + 12):
        plan = C.plan_layers(n, PER, budget)
        assert len(plan) == n
        fits = _cost(plan) <= budget
        if not fits:  # nothing fits: every layer fully recomputed
            assert plan == ["full"] * n
            continue
        # no plan that fits keeps more (promotes any layer further) than this one
        best = max((sum(ORDER[p] for p in q) for q in itertools.product(ORDER, repeat=n) if _cost(q) <= budget))
        assert sum(ORDER[p] for p in plan) == best, (budget, plan)
        # layers keep their attention before any layer keeps everything
        assert not ("none" in plan and "full" in plan)


def test_bytes_grow_with_what_is_kept():
    a = PRESETS["llama-3b"]
    b = C.activation_bytes(a, 2)
    assert b["full"] < b["sequence"] < b["none"]
    assert b["full"] == 2 * a.dim


def test_default_budget_unknown_on_cpu():
    import torch
    assert C.default_budget(10, torch.device("cpu")) is None


@pytest.mark.parametrize("budget_gib,expect", [(1e-9, {"full"}), (100.0, {"none"}), (None, None)])
def test_mixed_plan_is_exact(pool, budget_gib, expect):
    from test_train import reference, check_same

    if budget_gib is None:
        # between: the small model's per-layer bytes at 32 local tokens (cp=2 of 64? seq_len=32) place
        # the budget so that some layers keep attention only
        a = tc.small_config().model
        per = {k: v * 2 * 16 for k, v in C.activation_bytes(a, 4).items()}  # batch 2 x 16 local tokens, fp32
        budget_gib = (per["sequence"] * a.n_layers + per["none"]) / 2**30
        expect = {"sequence"}
    plan, loss, grads = pool.run(tc.auto_plan, budget_gib, ["cp=2"], world=2)[0]
    assert set(plan) == expect, plan
    check_same((loss, grads), reference(None, 1))
