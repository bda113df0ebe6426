"""burst_attn_func against a float64 dense oracle on 1-4 gloo ranks."""
import pytest
import torch

import dist_cases

WORLDS = (1, 2, 3, 4)
TOL = 1e-4


@pytest.mark.parametrize("backward", ["burst", "ring"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("world", WORLDS)
def test_matches_float64_reference(pool, world, causal, layout, backward):
    seed = hash((world, causal, layout, backward)) % 100000
    per_rank = pool.run(dist_cases.attention_matrix, seed, causal, layout, backward, world=world)
    for rank, rows in enumerate(per_rank):
        for r in rows:
            where = f"rank {rank} hkv={r['hkv']} D={r['D']} B={r['B']}"
            for key in ("out", "lse", "dq", "dk", "dv"):
                assert r[key] <= TOL, f"{where}: {key} rel err {r[key]:.2e}"
            assert r["fwd_bytes"] == r["want_fwd"], where
            assert r["bwd_bytes"] == r["want_bwd"], where


def test_auto_picks_fewer_bytes(pool):
    rows = pool.run(dist_cases.attention_matrix, 7, True, "zigzag", "auto", world=4)[0]
    for r in rows:
        # MHA: the Q side (q, dO, dQ + 2 scalars) is smaller than K, V, dK, dV; GQA 2 and 4: the reverse
        assert r["scheme"] == ("burst" if r["hkv"] == 4 else "ring"), r
        assert max(r[k] for k in ("out", "dq", "dk", "dv")) <= TOL


@pytest.mark.parametrize("world,causal,backward", [(2, True, "burst"), (2, True, "ring"), (3, False, "burst"),
                                                    (3, False, "ring")])
def test_finished_gradient_goes_home_in_bf16_and_changes_no_bit(pool, world, causal, backward):
    """The last gradient hop (the one no compute hides) carries the finished dQ (burst) or dK, dV
    (ring) in the inputs' dtype instead of float32: half its bytes, the same gradients bit for bit
    (they were rounded to bf16 on arrival anyway)."""
    from burstengine.schedule import home_bytes

    for rank, ((new, new_bytes), (old, old_bytes)) in enumerate(
            pool.run(dist_cases.home_hop, backward, causal, world=world)):
        for a, b, name in zip(new, old, ("dq", "dk", "dv")):
            assert a.dtype == b.dtype and torch.equal(a, b), (rank, name)
        n = 10
        saved = home_bytes(backward, 1, n, 4, 2, 32, 2)
        assert old_bytes - new_bytes == saved > 0, (rank, old_bytes, new_bytes)


@pytest.mark.parametrize("world,backward", [(2, "burst"), (3, "ring")])
def test_float64_bytes_are_the_schedules(pool, world, backward):
    """float64 inputs accumulate, and send their partials, lse and D, in float64: comm_stats and
    schedule.backward_bytes agree there too (they counted float32 partials before)."""
    for rank, rows in enumerate(pool.run(dist_cases.attention_matrix, 3, True, "zigzag", backward,
                                         dtype=torch.float64, world=world)):
        for r in rows:
            assert r["bwd_bytes"] == r["want_bwd"] and r["fwd_bytes"] == r["want_fwd"], (rank, r)
            assert max(r[k] for k in ("out", "dq", "dk", "dv")) <= TOL
