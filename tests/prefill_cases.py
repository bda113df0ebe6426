"""Worker functions for tests/inference/test_prefill.py (run inside the gloo pool)."""
import functools

import torch
import torch.distributed as dist

import burstengine as be
from burstengine.inference import load_model, prefill
from burstengine.testing import rel_err
from hf_cases import VOCAB


@functools.lru_cache(maxsize=4)
def _model(path, impl):
    return load_model(path, impl)


@functools.lru_cache(maxsize=4)
def eager_reference(path, batch, S, seed):
    """The HF eager model on the full prompt: last-position logits, and every layer's K/V (a plain
    cache: a sliding layer's own would keep only the window's last keys)."""
    from transformers import DynamicCache

    from hf_cases import load

    ids = torch.randint(0, VOCAB, (batch, S), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = load(path, "eager")(input_ids=ids, cache=DynamicCache(), use_cache=True)
    kv = [(layer.keys.transpose(1, 2), layer.values.transpose(1, 2)) for layer in out.past_key_values.layers]
    return ids, out.logits[:, -1].float(), kv


def prefill_vs_hf(group, path, layout, impl, seed, batch=2, seq_per_rank=16, chunk=None):
    """Our prefill's next-token logits and KV shards against transformers' eager model
    (``chunk``: the token-wise work that many tokens at a time)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    S = seq_per_rank * world
    ids, ref_logits, ref_kv = eager_reference(path, batch, S, seed)
    out = prefill(_model(path, impl), ids, group=group, layout=layout, keep_kv=True, chunk=chunk)
    errs = {"logits": rel_err(out.logits, ref_logits)}
    for i, ((k, v), (rk, rv)) in enumerate(zip(out.kv, ref_kv)):
        errs[f"k{i}"] = rel_err(k, be.shard(rk, layout, rank, world))
        errs[f"v{i}"] = rel_err(v, be.shard(rv, layout, rank, world))
    ok_pos = bool((out.positions == be.position_ids(S, layout, rank, world)).all())
    return errs, len(out.kv), ok_pos, tuple(out.logits.shape)


def run_cli(group, argv):
    from burstengine import cli

    return cli.main(argv)


def bench(group, argv):
    """burstengine bench prefill's ranks, inside the pool's group."""
    from burstengine.bench.peers import prefill as pb

    return pb.run_rank(pb.build_parser().parse_args(argv), group)


def bench_warm_fails_on_rank_1(group, argv):
    """bench prefill's ranks where rank 1's warm-up call (the short length before the first one)
    raises after its collectives and rank 0's does not: a failure one rank alone sees (one before
    the ring would leave rank 0 waiting in it, the hang the call's own deadlines end)."""
    import torch.distributed as dist

    from burstengine.bench.peers import prefill as pb

    case = pb._case

    def failing(method, S, ids, ours, tp, group_, args, device):
        fn, ctx = case(method, S, ids, ours, tp, group_, args, device)
        if dist.get_rank(group_) == 1 and S < int(args.seqs.split(",")[0]):
            real = fn

            def fn():
                real()
                raise RuntimeError("a warm-up failure on rank 1 (a test)")
        return fn, ctx

    pb._case = failing
    try:
        return pb.run_rank(pb.build_parser().parse_args(argv), group)
    finally:
        pb._case = case


def prefill_kernel_error(group, path, layout, seed, kernel, seq_per_rank=16):
    """Our prefill's next-token logits with local kernel ``kernel`` against transformers' eager model."""
    try:  # where triton is installed, the FP8 kernel runs in its interpreter: with the fixes to it
        import triton_interp  # noqa: F401
    except ImportError:
        pass
    S = seq_per_rank * dist.get_world_size(group)
    ids, ref_logits, _ = eager_reference(path, 2, S, seed)
    out = prefill(_model(path, "ours"), ids, group=group, layout=layout, kernel=kernel)
    return rel_err(out.logits, ref_logits)
