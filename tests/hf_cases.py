"""Worker functions for tests/integrations/test_hf.py and tests/inference/test_prefill.py (run inside the gloo pool).

The model is a tiny LlamaForCausalLM with random weights saved to a temporary directory by
the test; every rank loads it with from_pretrained, as a user would.
"""
import functools

import torch
import torch.distributed as dist

import burstengine as be
from burstengine.schedule import forward_bytes
from burstengine.testing import rel_err

VOCAB = 256


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=False)
    kw.update(overrides)
    return LlamaConfig(**kw)


def save_tiny_llama(path, seed=0, **overrides):
    """A LlamaForCausalLM with random weights (GQA 4:2), saved as config.json + safetensors."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides))
    with torch.no_grad():  # HF initialises norms to 1; random ones make the test see them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return str(path)


@functools.lru_cache(maxsize=8)
def load(path, attn):
    from transformers import AutoModelForCausalLM

    import burstengine.integrations.hf  # noqa: F401  (registers "burst")

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32).eval()


def _world(group):
    return dist.get_rank(group), dist.get_world_size(group)


def hf_vs_eager(group, path, layout, seed, batch=2, seq_per_rank=12, setup="context", docs=None):
    """Logits and every parameter's gradient of the "burst" model on this rank's shard, against
    the eager model on the full sequence.  Also checks that K/V travel unexpanded (bytes).
    ``setup``: the settings come from burst_context ("context") or configure() ("configure").
    ``docs``: packed documents (global boundaries): positions restart at each, for both models."""
    import contextlib

    from burstengine.integrations import hf

    rank, world = _world(group)
    S = seq_per_rank * world
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, S), generator=g)
    w = torch.randn(batch, S, VOCAB, generator=g)

    if docs is None:
        full_pos = torch.arange(S)
    else:
        full_pos = torch.cat([torch.arange(e - s) for s, e in zip(docs[:-1], docs[1:])])
    eager = load(path, "eager")
    eager.zero_grad(set_to_none=True)
    # use_cache=False: transformers looks for packed documents in the positions only without a cache
    ref = eager(input_ids=ids, position_ids=full_pos[None].expand(batch, -1), use_cache=False).logits
    (ref * w).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in eager.named_parameters()}

    burst = load(path, "burst")
    burst.zero_grad(set_to_none=True)
    pos = full_pos[be.position_ids(S, layout, rank, world)].unsqueeze(0)
    if setup == "configure":
        hf.configure(group=group, layout=layout)
        settings = contextlib.nullcontext()
    else:
        settings = hf.burst_context(group=group, layout=layout)
    try:
        with settings, be.comm_stats() as st:
            logits = burst(input_ids=be.shard(ids, layout, rank, world), position_ids=pos).logits
            fwd_bytes = st.forward_bytes
            (logits * be.shard(w, layout, rank, world)).sum().backward()
    finally:
        hf.reset()
    errs = {"logits": rel_err(logits, be.shard(ref.detach(), layout, rank, world))}
    for n, p in burst.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)  # each rank holds the gradient of its tokens' loss
        errs[n] = rel_err(grad, ref_grads[n])
    cfg = burst.config
    D = cfg.hidden_size // cfg.num_attention_heads
    want = cfg.num_hidden_layers * forward_bytes(batch, seq_per_rank, cfg.num_key_value_heads, D, 4, world)
    if docs is not None or getattr(cfg, "sliding_window", None):
        want = None  # a sparse mask's ring sends fewer rows
    return errs, fwd_bytes, want


def bad_hf_call(group, path, case):
    """One bad use of the "burst" model; returns the ValueError's message (every rank must raise)."""
    from burstengine.integrations.hf import burst_context

    rank, world = _world(group)
    layout, n = "zigzag", 8
    S = n * world
    ids = torch.randint(0, VOCAB, (1, S), generator=torch.Generator().manual_seed(3))
    kw = dict(input_ids=be.shard(ids, layout, rank, world),
              position_ids=be.position_ids(S, layout, rank, world).unsqueeze(0))
    ctx = burst_context(group=group, layout=layout)
    model = load(path, "burst")
    if case == "padding_on_last_rank":
        mask = torch.ones(1, n, dtype=torch.long)
        if rank == world - 1:
            mask[0, -1] = 0
        kw["attention_mask"] = mask
    elif case == "local_positions":
        kw["position_ids"] = torch.arange(n).unsqueeze(0)
    elif case == "no_positions":
        del kw["position_ids"]
    elif case == "wrong_layout":
        ctx = burst_context(group=group, layout="striped")
    elif case == "uneven_shards":
        kw["input_ids"] = kw["input_ids"][:, : n - 2 * (rank == 0)]
        kw["position_ids"] = kw["position_ids"][:, : n - 2 * (rank == 0)]
    elif case == "no_context":
        ctx = None
    elif case == "rows_differ":
        pos = torch.cat([torch.arange(5), torch.arange(S - 5)])
        both = torch.stack([torch.arange(S), pos])
        kw["input_ids"] = be.shard(torch.cat([ids, ids]), layout, rank, world)
        kw["position_ids"] = be.shard(both, layout, rank, world)
    elif case == "positions_jump":
        pos = torch.arange(S)
        pos[S // 2:] += 3
        kw["position_ids"] = be.shard(pos[None], layout, rank, world)
    elif case == "decode_step":
        with ctx:
            out = model(**kw, use_cache=True)
        kw = dict(input_ids=ids[:, :1], position_ids=torch.tensor([[S]]), past_key_values=out.past_key_values,
                  use_cache=True)
        ctx = burst_context(group=group, layout=layout)
    elif case == "plain_labels":
        kw["labels"] = kw["input_ids"]
    elif case == "output_attentions":
        kw["output_attentions"] = True
    elif case == "bad_layout_name":
        try:
            burst_context(group=group, layout="diagonal").__enter__()
        except ValueError as e:
            return str(e)
        return "no error"
    try:
        if ctx is None:
            model(**kw)
        else:
            with ctx:
                model(**kw)
    except ValueError as e:
        return str(e)
    return "no error"


def gemma3_overrides(window: int) -> dict:
    """What a tiny Gemma 3 text config sets beyond the tests' Llama shapes: three layers (sliding,
    full, sliding) with a sliding window of ``window``, a head width apart from hidden / heads, an
    attention scale apart from head_dim, a RoPE base per layer type, the global one linearly
    scaled (the hub's larger Gemma 3s)."""
    return dict(num_hidden_layers=3, head_dim=32, sliding_window=window, query_pre_attn_scalar=20,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})


def save_tiny_gemma3(path, seed=0, window=7):
    """A Gemma3ForCausalLM (tied embeddings) with random weights, norms included."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=1024, **gemma3_overrides(window))
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():  # HF initialises Gemma's norms to 0 (a scale of 1); random ones make the test see them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return str(path)


def save_tiny_mistral(path, seed=0):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=4, max_position_embeddings=256)
    MistralForCausalLM(cfg).save_pretrained(path)
    return str(path)


def hf_loss_exact(group, path, layout="zigzag", n=8):
    """The causal-LM loss of the "burst" model with shift_labels (shifted on the global
    sequence, then sharded) summed over the ranks, against the eager model's loss from plain
    labels on the whole sequence; -100 labels included."""
    from burstengine.integrations.hf import burst_context

    rank, world = _world(group)
    S = n * world
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, VOCAB, (2, S), generator=g)
    labels = ids.clone()
    labels[0, 3] = -100
    want = load(path, "eager")(input_ids=ids, labels=labels).loss
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    mine = be.shard(shift, layout, rank, world)
    with burst_context(group=group, layout=layout):
        got = load(path, "burst")(input_ids=be.shard(ids, layout, rank, world),
                                  position_ids=be.position_ids(S, layout, rank, world).unsqueeze(0),
                                  labels=mine, shift_labels=mine, num_items_in_batch=(shift != -100).sum()).loss
    got = got.detach().clone()
    dist.all_reduce(got, group=group)
    return abs(got.item() - want.item()) / abs(want.item())


def shift_recipe_loss(group, path, layout, batch=2, n=8):
    """The loss of the call the plain-labels refusal prints (SHIFT_RECIPE, run as printed),
    summed over the ranks, against the eager model's loss from plain labels on the whole
    sequence: relative error.  Batch > 1, every layout (contiguous shards are views: the
    recipe's .contiguous() is what transformers' loss needs)."""
    import burstengine
    from burstengine.integrations.hf import SHIFT_RECIPE, burst_context

    rank, world = _world(group)
    S = n * world
    ids_all = torch.randint(0, VOCAB, (batch, S), generator=torch.Generator().manual_seed(12))
    labels = ids_all.clone()
    labels[-1, 5] = -100
    want = load(path, "eager")(input_ids=ids_all, labels=labels).loss
    scope = dict(torch=torch, burstengine=burstengine, labels=labels, rank=rank, world=world,
                 model=load(path, "burst"), ids=burstengine.shard(ids_all, layout, rank, world),
                 pos=burstengine.position_ids(S, layout, rank, world).unsqueeze(0))
    with burst_context(group=group, layout=layout):
        exec(SHIFT_RECIPE.format(layout=layout), scope)
    got = scope["loss"].detach().clone()
    dist.all_reduce(got, group=group)
    return abs(got.item() - want.item()) / abs(want.item())


def eager_loss_after_burst(group, path, n=8):
    """After a burst forward (no labels), an eager model's labels= loss on logits of the same
    shape is computed (not refused) and equals transformers'; the burst model's own labels= loss
    is still refused.  Returns (eager error or the refusal, the burst model's outcome)."""
    from burstengine.integrations.hf import burst_context

    rank, world = _world(group)
    S = n * world
    ids_all = torch.randint(0, VOCAB, (1, S), generator=torch.Generator().manual_seed(13))
    mine = be.shard(ids_all, "zigzag", rank, world)
    pos = be.position_ids(S, "zigzag", rank, world).unsqueeze(0)
    burst, eager = load(path, "burst"), load(path, "eager")
    with burst_context(group=group, layout="zigzag"):
        burst(input_ids=mine, position_ids=pos)
    try:
        local = eager(input_ids=mine, labels=mine).loss  # a model of its own on this rank's tokens
        logits = eager(input_ids=mine).logits[:, :-1]
        want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten())
        first = abs(local.item() - want.item())
    except ValueError as e:
        first = str(e)
    try:
        with burst_context(group=group, layout="zigzag"):
            burst(input_ids=mine, position_ids=pos, labels=mine)
        second = "no error"
    except ValueError as e:
        second = str(e)
    return first, second
