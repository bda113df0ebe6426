"""Worker functions for tests/model/test_tensor_parallel.py (run inside the gloo pool).

Random float64 models whose heads (24), kv heads (12), ffn width (384) and vocabulary (480)
divide over 1-4 ranks; the LM head is scaled up so that greedy choices are far from ties."""
import torch

ARGS = dict(dim=192, n_layers=2, n_heads=24, n_kv_heads=12, vocab_size=480, ffn_dim=384)
LENGTHS = (61, 37)  # a batch of two lengths: the cache's visibility mask


def model(group, source: str, seed: int = 0, **overrides):
    """An OurLlama of ARGS (with ``overrides``): ``source`` "whole" (every rank the whole model),
    "sliced" (only this rank's tensor-parallel slices over ``group``); with "-packed", its q/k/v and
    gate/up weights packed as load_model packs them (model/layers.py: pack_model)."""
    import torch.distributed as dist

    from burstengine.comm.dist import rank_of, world_of
    from burstengine.inference.models import OurLlama, random_llama
    from burstengine.model import ModelArgs
    from burstengine.model.tensor_parallel import Split

    from burstengine.model.layers import pack_model

    a = ModelArgs(**dict(ARGS, **overrides))
    split = tp_group = None
    source, packs = source.removesuffix("-packed"), source.endswith("-packed")
    if source == "sliced":
        tp_group = group if group is not None else dist.group.WORLD
        split = Split(rank_of(group), world_of(group))
    m = random_llama(a, "cpu", torch.float64, seed, split)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for n, p in m.named_parameters():  # norms and biases that count (init_weights makes them 1 and 0)
            if n.endswith(".bias") or n.endswith("norm.weight"):
                full = torch.randn(split.full_shape(n, p.shape, a) if split else p.shape, generator=g,
                                   dtype=p.dtype) * 0.1
                c = split.cut(n, a) if split else None
                p.add_(full if c is None else full.narrow(c.dim, c.start, c.size))
        (m.output.weight if m.output is not None else m.tok_embeddings.weight).mul_(30.0)
    if packs:
        pack_model(m)
    return OurLlama(m, f"tp test ({source})", tp_group)


def prompts(seed=0, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, ARGS["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def run_decode(group, source: str, tensor_parallel, new: int = 6, overrides=None, lengths=LENGTHS, **kw):
    """Greedy tokens, every step's logits (steps, B, V) float64 (step 0: the prefill's) and
    whether the step ran the slices."""
    from burstengine.inference import generate

    seen = []
    out = generate(model(group, source, **(overrides or {})), prompts(lengths=lengths), new, group=group,
                   tensor_parallel=tensor_parallel, on_logits=lambda i, x: seen.append(x.clone()), **kw)
    return out.tokens, (torch.stack(seen) if seen else None), out.timings["tensor_parallel"]


def raises(group, source: str, tensor_parallel, overrides=None):
    """The message of the ValueError generate raises on this rank, or None."""
    from burstengine.inference import generate

    try:
        generate(model(group, source, **(overrides or {})), prompts(), 2, group=group, tensor_parallel=tensor_parallel)
    except ValueError as e:
        return str(e)
    return None


def run_hf_sliced(group, path, lengths, new):
    """Greedy tokens of an HF checkpoint loaded as this rank's slices only."""
    import torch.distributed as dist

    import generate_cases as gc
    from burstengine.inference import generate, load_model

    m = load_model(path, tp_group=group if group is not None else dist.group.WORLD)
    assert m.sliced
    return generate(m, gc.prompts(lengths), new, group=group).tokens


def watch_step(group, kv_dtype=None):
    """Every op the tensor-parallel decode step's forward runs on this rank (aten and c10d), and
    those that read a device value on the host or index with a boolean mask (``kv_dtype``:
    generate's)."""
    import decode_cases
    from burstengine.inference import generate
    from burstengine.inference import step as st

    ops, bad = set(), []
    forward = st.DecodeStep.forward
    st.DecodeStep.forward = decode_cases.watched(forward, ops, bad)
    try:
        out = generate(model(group, "sliced", window=9), prompts(), 4, group=group, kv_dtype=kv_dtype)
    finally:
        st.DecodeStep.forward = forward
    return out.tokens, sorted(ops), sorted(set(bad))


def capture_fails_on_the_last_rank(group, graphs: str):
    """generate with a CUDA graph 'captured' (a stand-in that cannot replay) on every rank but the
    last, whose capture fails: every rank must decode op by op (or, under "on", raise)."""
    import importlib
    import warnings

    import torch.distributed as dist

    from burstengine.comm.dist import rank_of, world_of
    from burstengine.inference import step as st

    gen = importlib.import_module("burstengine.inference.generate")  # the module (the package exports the function)
    last = rank_of(group) == world_of(group) - 1

    def capture(self, warmup=2, strict=False):
        if last:
            raise RuntimeError("capturing the decode step in a CUDA graph failed: out of graph memory")
        self.graph = object()  # replaying it would raise: no rank may keep a graph another lacks

    old = gen.use_graphs, st.DecodeStep.capture
    gen.use_graphs, st.DecodeStep.capture = (lambda mode, device: True), capture
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                tokens = gen.generate(model(group, "whole"), prompts(), 4, group=group, graphs=graphs).tokens
            except RuntimeError as e:
                return "raised", str(e)
    finally:
        gen.use_graphs, st.DecodeStep.capture = old
    dist.barrier(group=group)
    return tokens, [str(w.message) for w in caught if "decoding op by op" in str(w.message)]
