"""Tiny pretrained models of each supported architecture (made with transformers, saved with
save_pretrained) and the work run on them inside the gloo pool (tests/train/test_finetune.py)."""
import os

import torch
import torch.distributed as dist

from hf_cases import gemma3_overrides

VOCAB = 128
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
# Phi-3's LongRoPE for head dim 16, switching to the long factors past 16 tokens (the tests' sequences are longer)
LONGROPE = {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [1.5 ** i for i in range(8)]}

# name -> (transformers class names, config overrides)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-tied": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=LLAMA3, tie_word_embeddings=True,
                                                             rope_theta=500000.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),  # head_dim != hidden / heads
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", gemma3_overrides(window=5)),  # tied by default
    # fused qkv / gate_up, LongRoPE, a window, a pad token the export keeps
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(rope_scaling=LONGROPE, original_max_position_embeddings=16,
                                                   sliding_window=5, pad_token_id=VOCAB - 1, bos_token_id=1,
                                                   eos_token_id=2)),
}


def save_tiny(path, arch, seed=0, dtype=torch.float32, max_shard_size=None):
    """A random ``arch`` model (norms and biases random too, so the test sees them) saved to ``path``."""
    import transformers

    cfg_cls, model_cls, kw = ARCHS[arch]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**{**BASE, **kw}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.uniform_(0.5, 1.5)
    model.to(dtype).save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return str(path)


def hf_model(path, attn="eager"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32).eval()


def hf_loss(path, toks, labs):
    """transformers' mean cross-entropy of labels ``labs`` (-100 ignored) given inputs ``toks``."""
    with torch.no_grad():
        logits = hf_model(path)(input_ids=toks).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), labs.flatten(), ignore_index=-100).item()


def overrides(init, data, seq_len, extra=()):
    return [f"init={init}", f"data={data}", f"seq_len={seq_len}", "batch_size=2", "progress=false", "cp=0",
            "eval_samples=2", *extra]


def first_loss(group, init, data, seq_len, extra=()):
    """The trainer's global loss of step 0's batch with ``init`` on this mesh, and transformers'
    loss of the same sequences (rank 0 returns both)."""
    from burstengine.train import Trainer, load
    from burstengine.train import data as D

    cfg = load("tiny", overrides(init, data, seq_len, extra))
    t = Trainer(cfg, group=group, echo=False, lock=False)
    loss, grads = t.loss_and_grads(t.batch(0))
    if dist.get_rank(group) != 0:
        return None
    toks, labs, _ = D.global_sequences(t.loader.source, t.loader.indices(0))
    return loss, hf_loss(init, toks, labs), max(g.abs().max().item() for g in grads.values())


def policy_variants(group, init, data, seq_len, plans, extra=(), auto_gib=None):
    """The trainer's global loss and full gradients of step 0's batch with ``init``, one model and
    one batch, with the layers' checkpoint policies set to each plan of ``plans`` (a policy per
    layer; "offload" sends every saved tensor to the host); then, with ``auto_gib``, a trainer
    under activation_checkpoint=auto with that budget: (its plan, loss, gradients).  Rank 0
    returns them."""
    from burstengine.model import offload
    from burstengine.train import Trainer, load

    old, offload.MIN_BYTES = offload.MIN_BYTES, 0
    try:
        t = Trainer(load("tiny", overrides(init, data, seq_len, extra)), group=group, echo=False)
        batch = t.batch(0)
        out = []
        for plan in plans:
            for b, policy in zip(t.model.layers, plan):
                b.policy = policy
            out.append(t.loss_and_grads(batch))
        auto = None
        if auto_gib is not None:
            cfg = load("tiny", overrides(init, data, seq_len, [*extra, "activation_checkpoint=auto",
                                                                   f"activation_memory_gib={auto_gib}"]))
            t = Trainer(cfg, group=group, echo=False)
            loss, grads = t.loss_and_grads(t.batch(0))
            auto = (t.model.checkpoint_plan, loss, grads)
    finally:
        offload.MIN_BYTES = old
    return (out, auto) if dist.get_rank(group) == 0 else None


def train_and_export(group, init, data, seq_len, run_dir, out_dir, extra=(), max_shard_bytes=None):
    """init -> 1 step (lr 0 unless ``extra`` says otherwise) -> checkpoint -> export on rank 0.
    Returns (export summary, the trainer's loss of a fresh batch after the step) on rank 0."""
    from burstengine.train import Trainer, load
    from burstengine.train import data as D
    from burstengine.train.export import export

    cfg = load("tiny", overrides(init, data, seq_len, ["steps=1", "lr=0", "save_every=1", "warmup_steps=0",
                                                          f"out_dir={run_dir}", *extra]))
    t = Trainer(cfg, group=group, echo=False)
    t.fit(overwrite=True)
    loss, _ = t.loss_and_grads(t.batch(5))
    dist.barrier(group)
    if dist.get_rank(group) != 0:
        return None
    res = export(run_dir, out_dir, max_shard_bytes=max_shard_bytes)
    toks, labs, _ = D.global_sequences(t.loader.source, t.loader.indices(5))
    return res, loss, hf_loss(out_dir, toks, labs)


def weights_only_resume(group, init, data, seq_len, saved_dir, fresh_dir, out_dir):
    """`bench finetune load --save` (a weights-only step-0 checkpoint) -> `export` of it to
    ``out_dir`` on rank 0; then one step at lr 1e-2 resumed from it, and one step from ``init``
    afresh.  Returns on rank 0 (max |difference| of the weights after the step, whether the
    checkpoint holds optimizer entries, its meta.json)."""
    from argparse import Namespace

    import torch.distributed.checkpoint as dcp
    from burstengine.bench.peers import finetune as ft
    from burstengine.train import Trainer, load
    from burstengine.train import checkpoint as ckpt
    from burstengine.train.export import export

    train = ["steps=1", "lr=1e-2", "warmup_steps=0", "save_every=0"]
    ft.load(Namespace(init=init, save=saved_dir, seq_len=seq_len, record=None,
                      overrides=overrides(init, data, seq_len, train)[1:]), group)
    path = os.path.join(saved_dir, "checkpoints", "step_00000000")
    if dist.get_rank(group) == 0:
        keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        meta = ckpt.read_meta(path)
        export(path, out_dir)
    dist.barrier(group)
    after = []
    for run_dir, resume in ((saved_dir, True), (fresh_dir, False)):
        t = Trainer(load("tiny", overrides(init, data, seq_len, [*train, f"out_dir={run_dir}"])), group=group,
                    echo=False)
        t.fit(resume=resume, overwrite=not resume)
        after.append({k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach()
                      for k, v in t.model.state_dict().items()})
    if dist.get_rank(group) != 0:
        return None
    diff = max((after[0][k].float() - after[1][k].float()).abs().max().item() for k in after[0])
    return diff, any(k.startswith("optim") for k in keys), meta


def packed_vs_alone(group, init, seq_len, docs, layout, extra_model=None):
    """Our loss sum of packed documents (global cu_seqlens, positions restarting per document) on
    this CP group, and the sum over the documents run one by one in one process."""
    from burstengine.layout import position_ids, shard
    from burstengine.model.hf_dir import args_from_hf_config, load_weights, read_config
    from burstengine.model import ContextParallel, Transformer

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    args = args_from_hf_config(read_config(init))
    for k, v in (extra_model or {}).items():
        setattr(args, k, v)
    model = Transformer(args)
    load_weights(model, init)
    g = torch.Generator().manual_seed(5)
    toks = torch.randint(0, VOCAB, (2, seq_len), generator=g)
    labs = torch.randint(0, VOCAB, (2, seq_len), generator=g)
    pos = torch.cat([torch.arange(e - s) for s, e in zip(docs[:-1], docs[1:])])
    alone = sum(model(toks[:, s:e], torch.arange(e - s), labs[:, s:e]).item() for s, e in zip(docs[:-1], docs[1:]))
    if world > 1:
        model.set_context_parallel(ContextParallel(group=group or dist.group.WORLD, layout=layout))
    idx = position_ids(seq_len, layout, rank, world)
    mine = model(shard(toks, layout, rank, world), pos[idx], shard(labs, layout, rank, world),
                 cu_seqlens=torch.tensor(docs))
    total = mine.detach().clone()
    if world > 1:
        dist.all_reduce(total, group=group)
    return total.item(), alone


def token_file(path, n=6000, high=64):
    import numpy as np

    np.random.default_rng(0).integers(0, high, size=n, dtype=np.uint16).tofile(path)
    return str(path)


def exists(p):
    return os.path.exists(p)
