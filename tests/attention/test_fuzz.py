"""Random bad (and odd but valid) calls on 2-4 gloo ranks: every bad call raises the same
ValueError on every rank, naming the problem (and the rank, when one rank alone is wrong);
every valid call matches the float64 oracle; no call hangs (a hang would stall the pool,
which fails the test) and the ranks stay in step afterwards."""
import re

import pytest

import fuzz_cases

CASES = 90  # per world size: ~80% of them bad, so > 200 bad calls over worlds 2, 3, 4
ENV_CASES = 60  # per world size (2, 4): ~80% bad, so > 300 bad calls in all with the above


def _names_rank(msg: str, rank: int) -> bool:
    return any(rank in map(int, m.split(", ")) for m in re.findall(r"\branks? ((?:\d+, )*\d+)", msg))


def _judge(world, per_rank):
    """(bad, good, failures) for one world's results."""
    *rows, end = zip(*per_rank)
    failures = []
    bad = good = 0
    for case in rows:
        r0 = case[0]
        what = f"world {world} case {r0['i']} {r0['names']} targets {r0['targets']}"
        outcomes = [r["outcome"] for r in case]
        harness = [r["harness"] for r in case if "harness" in r]
        if harness:
            failures.append(f"{what}: the test itself failed to build the call: {harness}")
            continue
        if r0["expected"] is None:
            good += 1
            if outcomes != ["ok"] * world:
                failures.append(f"{what}: a valid call failed: {[(r['outcome'], r.get('msg')) for r in case]}")
            elif max(r["err"] for r in case) > r0["tol"]:
                failures.append(f"{what}: WRONG RESULT, errors {[r['err'] for r in case]} > {r0['tol']}")
            continue
        bad += 1
        msgs = {r.get("msg") for r in case}
        if outcomes != ["ValueError"] * world:
            failures.append(f"{what}: expected ValueError on every rank, got {outcomes} {msgs}")
            continue
        if len(msgs) != 1:
            failures.append(f"{what}: ranks raised different messages: {msgs}")
            continue
        msg = msgs.pop()
        if not any(any(alt in msg.lower() for alt in kw.lower().split("|")) for kw in r0["expected"]):
            failures.append(f"{what}: message {msg!r} names none of {r0['expected']}")
        target = r0["targets"][0]
        if len(r0["targets"]) == 1 and target != "all" and not _names_rank(msg, target):
            failures.append(f"{what}: message {msg!r} does not name rank {target}")
    assert [e["rank_sum"] for e in end[0:1]] == [world * (world - 1) / 2]
    return bad, good, failures


def test_fuzz_burst_attn_func(pool):
    totals = dict(bad=0, good=0, failures=[], slowest=0.0)
    for world in (2, 3, 4):
        per_rank = pool.run(fuzz_cases.fuzz_batch, 100 + world, CASES, world=world)
        bad, good, failures = _judge(world, per_rank)
        totals["bad"] += bad
        totals["good"] += good
        totals["failures"] += failures
        totals["slowest"] = max([totals["slowest"]] + [r["secs"] for rows in per_rank for r in rows[:-1]])
    print(f"\nfuzz burst_attn_func: {totals['bad']} bad + {totals['good']} valid calls on worlds 2-4, "
          f"{len(totals['failures'])} failures, 0 hangs, slowest case {totals['slowest']:.3f} s")
    assert not totals["failures"], "\n".join(totals["failures"][:20])
    assert totals["bad"] >= 200 and totals["good"] >= 30, totals


@pytest.mark.parametrize("world", [2, 4])
def test_fuzz_environment_settings(pool, world):
    """Settings from the environment (LOCAL_WORLD_SIZE, BURST_TOPOLOGY, BURST_CHECKS,
    BURST_TIMEOUT, BURST_CLUSTER) and requires_grad differing per rank: the same ValueError
    on every rank naming the setting; alike on every rank: the oracle's answer."""
    per_rank = pool.run(fuzz_cases.env_batch, 200 + world, ENV_CASES, world=world)
    bad, good, failures = _judge(world, per_rank)
    print(f"\nfuzz environment settings, world {world}: {bad} bad + {good} valid calls, {len(failures)} failures")
    assert not failures, "\n".join(failures[:20])
    assert bad >= ENV_CASES // 2 and good >= 5, (bad, good)


def test_fuzz_layout_helpers(pool):
    per_rank = pool.run(fuzz_cases.layout_batch, 7, 150, world=4)
    failures, bad, good = [], 0, 0
    for rank, rows in enumerate(per_rank):
        for r in rows:
            what = f"rank {rank} case {r['i']} {r['fn']}"
            if r["expected"] is None:
                good += 1
                if r["outcome"] != "ok":
                    failures.append(f"{what}: valid call gave {r['outcome']} {r.get('msg')}")
            else:
                bad += 1
                if r["outcome"] != "ValueError" or r["expected"].lower() not in r["msg"].lower():
                    failures.append(f"{what}: expected ValueError naming {r['expected']!r}, got {r['outcome']} "
                                    f"{r.get('msg')!r}")
    print(f"\nfuzz layout helpers: {bad} bad + {good} valid calls, {len(failures)} failures")
    assert not failures, "\n".join(failures[:20])
    assert bad >= 300 and good >= 80


@pytest.mark.parametrize("world", [2, 4])
def test_no_finite_scan_at_level_agree(pool, world):
    """BURST_CHECKS=agree skips the scan: NaN in q then reaches exactly the output rows that
    see it (loud, never a finite wrong answer); level full raises."""
    res = pool.run(fuzz_cases.nan_levels, world=world)
    for rank, r in enumerate(res):
        assert "k contains NaN or inf" in r["full"], r
        assert r["same_rows"] and r["agree_nan_rows"] == r["want_nan_rows"], (rank, r)
        assert r["agree_err"] <= 1e-4, (rank, r)
        assert r["local_bad"] == "q must be 4-D" and r["local_collectives"] == 0, (rank, r)


@pytest.mark.parametrize("case,want", [
    ("same", None),
    ("raise_one", "arguments rejected on rank 1: window must be a positive int, got -1 (world 3) "
                  "(ranks 0, 2 passed their own checks)"),
    ("differ", "disagree on window: 8 on rank 0, 4 on ranks 1, 2."),
    ("tensor_differ", "disagree on block_mask: 4x4 blocks, first difference at block (0, 3): True on ranks 0, 2, "
                      "False on rank 1."),
])
def test_extra_arguments_join_the_agreement(pool, case, want):
    res = pool.run(fuzz_cases.extra_hook, case, world=3)
    if want is None:
        assert res == [("ok", ["block_mask", "cu_seqlens", "window"])] * 3
    else:
        assert {r[0] for r in res} == {"ValueError"} and len({r[1] for r in res}) == 1, res
        assert want in res[0][1], res[0][1]
        if case == "tensor_differ":
            assert "on rank 1" in res[0][1] and "on ranks 0, 2" in res[0][1]
