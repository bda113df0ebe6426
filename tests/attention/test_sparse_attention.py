"""burst_attn_func with sliding windows, packed documents and block-sparse masks on 1-4 gloo
ranks, against the float64 dense oracle with the explicit mask: output, lse and the three
gradients for every layout, both backward schemes and GQA; rows that see nothing give zeros
and no NaN; the bytes each rank sends match the byte model at the schedule's last step."""
import itertools

import pytest

import sparse_cases

WORLDS = (1, 2, 3, 4)
LAYOUTS = ("contiguous", "zigzag", "striped")
TOL = 1e-4
N = 8  # local tokens


def _window_cases(world):
    S = N * world
    # shorter than a shard, one shard, into the shard before, spanning 2.5 shards (a tail that
    # shrinks hop by hop), the whole sequence
    for i, (layout, W, bwd) in enumerate(itertools.product(LAYOUTS, (3, N, N + 3, 2 * N + N // 2, S + 5),
                                                           ("burst", "ring"))):
        yield dict(layout=layout, n=N, backward=bwd, window=W, seed=100 + i, hkv=(4, 2, 1)[i % 3], B=1 + i % 2)


def _document_cases(world):
    S = N * world
    docs = {
        "crossing": sorted({c for c in (0, 3, 5, N + 2, S // 2 + 1, S) if c <= S}),
        "tiny": list(range(0, S, 2)) + [S],
        "one": [0, S],
        "in-shard": list(range(0, S + 1, N // 2)),
    }
    i = 0
    for layout, (name, cu), bwd in itertools.product(LAYOUTS, docs.items(), ("burst", "ring")):
        yield dict(layout=layout, n=N, backward=bwd, cu_seqlens=cu, seed=200 + i, hkv=(4, 2, 1)[i % 3])
        i += 1
    for layout, bwd in itertools.product(LAYOUTS, ("burst", "ring")):
        cu = docs["crossing"]
        yield dict(layout=layout, n=N, backward=bwd, cu_seqlens=cu, causal=False, seed=300 + i, hkv=2)
        yield dict(layout=layout, n=N, backward=bwd, cu_seqlens=cu, window=3, seed=400 + i, hkv=1)
        i += 1


def _block_cases(world):
    S = N * world
    bs = {"striped": world, "contiguous": 2, "zigzag": 2}
    for i, (layout, causal, bwd) in enumerate(itertools.product(LAYOUTS, (False, True), ("burst", "ring"))):
        nb = S // bs[layout]
        yield dict(layout=layout, n=N, backward=bwd, causal=causal, block=(nb, 0.4, max(1, nb // 4)), seed=500 + i,
                   hkv=(4, 2, 1)[i % 3], B=1 + i % 2)


FAMILIES = {"window": _window_cases, "documents": _document_cases, "block": _block_cases}


def _check(cases, per_rank):
    for rank, rows in enumerate(per_rank):
        for c, r in zip(cases, rows):
            where = f"rank {rank} {c}"
            for key in ("out", "lse", "dq", "dk", "dv"):
                assert r[key] <= TOL, f"{where}: {key} rel err {r[key]:.2e}"
            assert r["finite"], where
            assert r["empty_ok"], f"{where}: rows with nothing visible must give out 0, lse -inf, dq 0"
            assert r["fwd_bytes"] == r["want_fwd"], where
            assert r["bwd_bytes"] == r["want_bwd"], where


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("world", WORLDS)
def test_sparse_matches_float64_reference(pool, world, family):
    cases = list(FAMILIES[family](world))
    _check(cases, pool.run(sparse_cases.run_cases, cases, world=world))


@pytest.mark.parametrize("world", (2, 4))
def test_sparse_through_piecewise_kernel(pool, world):
    """The ring with the kernel the SDPA backends use for sparse blocks (FULL / CAUSAL pieces)."""
    cases = [dict(c, kernel="pieces") for f in FAMILIES.values() for c in list(f(world))[::3]]
    _check(cases, pool.run(sparse_cases.run_cases, cases, world=world))


def test_contiguous_window_skips_steps_and_bytes(pool):
    world = 4
    cases = [dict(layout="contiguous", n=N, backward=b, window=W, seed=W) for W in (3, N, N + 1, N + 2, 3 * N)
             for b in ("burst", "ring")]
    per_rank = pool.run(sparse_cases.run_cases, cases, world=world)
    _check(cases, per_rank)
    assert [r["hops"] for r in per_rank[0]] == [1, 1, 1, 1, 1, 1, 2, 2, 3, 3]
    # the trimmed ring sends less than whole shards would, and never more
    for rows in per_rank:
        for r in rows:
            assert r["fwd_bytes"] <= r["full_fwd"] and r["bwd_bytes"] <= r["full_bwd"]


@pytest.mark.parametrize("hkv", (4, 1))
def test_contiguous_short_window_sends_only_the_tail(pool, hkv):
    """W <= n, contiguous: step 1 reads the last W-1 rows of the previous shard, so that is all
    that travels (closed forms, not the schedule's code): forward K, V of rank r < G-1 to r+1;
    burst backward Q, dO (input dtype) + lse, D (fp32) of rank r >= 1 to r-1 and dQ's partial
    (first W-1 rows, fp32) from r-1 home to r; ring backward K, V forward and the dK, dV
    partial (last W-1 rows, fp32) home.  Rank 0 receives no K/V, rank G-1 sends none."""
    world, H, D, e = 4, 4, 16, 4
    cases = [dict(layout="contiguous", n=N, backward=b, window=W, seed=W, hkv=hkv) for W in (2, 5, N)
             for b in ("burst", "ring")]
    per_rank = pool.run(sparse_cases.run_cases, cases, world=world)
    _check(cases, per_rank)
    for rank, rows in enumerate(per_rank):
        for c, r in zip(cases, rows):
            t = c["window"] - 1  # rows that travel
            kv_out = rank < world - 1  # rank r's K/V go to r+1, the Q side to r-1
            q_out = rank > 0
            kv = t * hkv * D * e * 2 * kv_out
            assert r["fwd_bytes"] == kv, (rank, c)
            if c["backward"] == "burst":
                assert r["bwd_bytes"] == t * H * (2 * D * e + 8) * q_out + t * H * D * 4 * kv_out, (rank, c)
                want = {"q": t * H * D * e * q_out, "delta": t * H * 4 * q_out, "dq": t * H * D * 4 * kv_out}
            else:
                assert r["bwd_bytes"] == kv + t * hkv * D * 4 * 2 * q_out, (rank, c)
                want = {"k": t * hkv * D * e * kv_out, "dv": t * hkv * D * 4 * q_out}
            for name, nbytes in want.items():
                assert r["by_tensor"].get(f"backward.{name}", 0) == nbytes, (rank, c, name, r["by_tensor"])


def test_sparse_on_the_double_ring_moves_whole_shards(pool):
    """A sparse mask that runs every step may run on the double ring (2 emulated nodes x 2):
    exact, and whole shards travel there (its three buffers and delayed hops are unchanged)."""
    world, S = 4, 4 * N
    cases = [dict(layout="striped", n=N, backward=b, topology="2x2", seed=20 + i, **m)
             for i, (b, m) in enumerate(itertools.product(("burst", "ring"),
                                                           (dict(window=5), dict(cu_seqlens=[0, 3, N + 2, S]))))]
    per_rank = pool.run(sparse_cases.run_cases, cases, world=world)
    _check(cases, per_rank)
    assert all(r["steps"] == tuple(range(world)) and r["fwd_bytes"] == r["full_fwd"] for rows in per_rank for r in rows)


def test_zigzag_window_jumps_idle_steps(pool):
    """zigzag + a short window runs steps 0, 1 and G-1: the kv shard jumps two ranks on at once,
    the burst backward's Q side and dQ likewise the other way, and the results stay exact."""
    cases = [dict(layout="zigzag", n=N, backward=b, window=3, seed=9, hkv=h) for b in ("burst", "ring") for h in (4, 1)]
    for rows in pool.run(sparse_cases.run_cases, cases, world=4):
        _check(cases, [rows])
        assert all(tuple(r["steps"]) == (0, 1, 3) and r["hops"] == 2 for r in rows)


def test_documents_inside_shards_send_nothing(pool):
    cases = [dict(layout="contiguous", n=N, backward=b, cu_seqlens=list(range(0, 4 * N + 1, N // 2)), seed=1)
             for b in ("burst", "ring")]
    for rows in pool.run(sparse_cases.run_cases, cases, world=4):
        _check(cases, [rows])
        assert all(r["steps"] == (0,) and r["fwd_bytes"] == 0 and r["bwd_bytes"] == 0 for r in rows)


BAD = {
    "window_not_causal": "causal=True",
    "window_zero": "positive int",
    "window_float": "positive int",
    "cu_not_from_zero": "from 0 to the global sequence length",
    "cu_short_of_length": "from 0 to the global sequence length",
    "cu_decreasing": "non-decreasing",
    "cu_float_tensor": "integer tensor",
    "cu_not_ints": "sequence of ints",
    "block_not_bool": "bool tensor",
    "block_not_square": "square",
    "block_not_dividing": "does not divide",
    "block_size_mismatch": "does not match",
    "block_striped_not_multiple": "multiple of the world size",
    "block_contiguous_straddles": "divide the local length",
    "block_with_window": "cannot be combined",
    "block_size_alone": "without a block_mask",
}


@pytest.mark.parametrize("world", (2, 4))
def test_bad_sparse_calls_raise_on_every_rank(pool, world):
    for case, phrase in BAD.items():
        msgs = pool.run(sparse_cases.bad_sparse_call, case, world=world)
        assert all(m is not None and phrase.lower() in m.lower() for m in msgs), (case, msgs)
        assert len(set(msgs)) == 1, (case, msgs)
    # the ranks are still in step: a good sparse call right after
    cases = [dict(layout="striped", n=N, backward="burst", window=5, seed=3)]
    _check(cases, pool.run(sparse_cases.run_cases, cases, world=world))
