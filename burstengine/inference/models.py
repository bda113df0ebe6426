"""The model behind prefill: a thin, swappable piece.

Prefill needs three things of a model: the final-norm hidden states of this rank's tokens,
the LM head applied to a few of them, and (optionally) the keys and values every layer
attended with.  Two implementations provide them:

* ``ours`` (default): :class:`burstengine.model.Transformer`, the model BurstEngine trains, with
  weights from a preset (random) or an HF LLaMA checkpoint (:mod:`.weights`).
* ``hf``: any transformers causal LM loaded with ``attn_implementation="burst"``
  (:mod:`burstengine.integrations.hf`), for checkpoints our LLaMA does not reproduce.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from ..comm.dist import world_of
from ..model import PRESETS, ContextParallel, Transformer
from .weights import hf_config_from_args, load_hf_llama, ours_to_hf

IMPLS = ("ours", "hf")


@dataclass(frozen=True)
class Sharding:
    """How this rank's tokens relate to the others': the context-parallel group (None: the
    default group), the layout of the shards, BurstAttention's knobs.  ``attention="sdpa"``
    runs plain SDPA on the shard instead, which is what torch's context_parallel patches into
    its own ring (the benchmark's peer)."""

    group: Any = None
    layout: str = "zigzag"
    backward: str = "auto"
    kernel: str | None = None
    attention: str = "burst"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


class PrefillModel:
    """Interface: ``hidden(ids (B, n), positions (n,), how: Sharding, keep_kv)`` -> (B, n, dim)
    final-norm hidden states of this rank's tokens and, with ``keep_kv``, a list over layers of
    this rank's (k, v) shards (B, n, kv_heads, head_dim), after RoPE; ``logits(h (B, dim))`` ->
    (B, vocab) float32.  ``describe`` is one line for the log."""

    vocab_size: int
    n_layers: int
    device: torch.device
    dtype: torch.dtype
    describe: str

    def hidden(self, ids, positions, how: Sharding, keep_kv: bool = False):
        raise NotImplementedError

    def logits(self, h):
        raise NotImplementedError


class OurLlama(PrefillModel):
    def __init__(self, model: Transformer, describe: str):
        self.model = model.eval()
        a = model.args
        self.vocab_size, self.n_layers = a.vocab_size, a.n_layers
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.describe = (f"{describe}: burstengine LLaMA, {a.n_layers} layers, dim {a.dim}, heads {a.n_heads}/"
                         f"{a.n_kv_heads} kv, ffn {a.ffn_dim}, vocab {a.vocab_size}, "
                         f"{_count(a.num_params())} params")

    @staticmethod
    def context_parallel(how: Sharding) -> ContextParallel:
        if how.attention == "burst":
            group = how.group
            if group is None and world_of() > 1:
                group = dist.group.WORLD  # the model reads group=None as "the whole sequence is here"
            return ContextParallel(group=group, layout=how.layout, backward=how.backward, kernel=how.kernel)
        if how.attention != "sdpa":
            raise ValueError(f"unknown attention {how.attention!r}; expected 'burst' or 'sdpa'")
        # plain SDPA on the shard: the model has said so with attention="sdpa", and in its
        # newer form with no group
        names = {f.name for f in fields(ContextParallel)}
        return ContextParallel(group=None, layout=how.layout, **({"attention": "sdpa"} if "attention" in names else {}))

    @torch.no_grad()
    def hidden(self, ids, positions, how, keep_kv=False):
        self.model.set_context_parallel(self.context_parallel(how))
        if not keep_kv:
            return self.model.hidden(ids, positions), None
        kv = [None] * self.n_layers
        blocks = list(self.model.layers)
        # the keys and values each block hands its attention are exactly what a decoder's
        # cache holds (after RoPE); catch them on the way in, per instance, and let go after
        for i, b in enumerate(blocks):
            def attend(q, k, v, docs=None, _b=b, _i=i):
                kv[_i] = (k, v)
                return type(_b).attend(_b, q, k, v, docs)
            b.attend = attend
        try:
            h = self.model.hidden(ids, positions)
        finally:
            for b in blocks:
                del b.attend
        return h, kv

    @torch.no_grad()
    def logits(self, h):
        return (h @ self.model.head_weight.to(h.dtype).t()).float()


class HFCausalLM(PrefillModel):
    def __init__(self, model, describe: str):
        import burstengine.integrations.hf  # noqa: F401  (registers "burst")

        if model.config._attn_implementation != "burst":
            model.set_attn_implementation("burst")
        self.model = model.eval()
        cfg = model.config
        self.vocab_size, self.n_layers = cfg.vocab_size, cfg.num_hidden_layers
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        n = sum(p.numel() for p in model.parameters())
        self.describe = f"{describe}: transformers {type(model).__name__} with attn 'burst', {_count(n)} params"

    @torch.no_grad()
    def hidden(self, ids, positions, how, keep_kv=False):
        from ..integrations.hf import burst_context  # needs transformers (optional): only for its models

        if how.attention != "burst":
            raise ValueError(f"the transformers model runs attention 'burst' only, not {how.attention!r}")
        with burst_context(group=how.group, layout=how.layout, backward=how.backward, kernel=how.kernel):
            out = self.model.base_model(input_ids=ids, position_ids=positions[None].expand(ids.shape[0], -1),
                                        use_cache=keep_kv)
        kv = None
        if keep_kv:
            cache = out.past_key_values
            kv = [(layer.keys.transpose(1, 2), layer.values.transpose(1, 2)) for layer in cache.layers]
        return out.last_hidden_state, kv

    @torch.no_grad()
    def logits(self, h):
        return self.model.get_output_embeddings()(h).float()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; expected auto or one of {sorted(table)}")
    return table[name]


def check_spec(spec: str, impl: str) -> str | None:
    """A message when ``spec`` is neither a preset nor a model directory (checked before any
    rank starts)."""
    if impl not in IMPLS:
        return f"unknown --impl {impl!r}; expected one of {IMPLS}"
    if spec in PRESETS:
        return None
    if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "config.json")):
        return None
    return f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a directory with a config.json"


def random_llama(args, device, dtype, seed: int = 0) -> Transformer:
    """Our LLaMA with ``args``' shape and random weights (the same on every rank for a seed),
    allocated once, directly in ``dtype`` on ``device``."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to(dtype).to_empty(device=device)
    model.init_weights(seed)
    return model


def load_model(spec: str, impl: str = "ours", device="cpu", dtype=torch.float32, seed: int = 0) -> PrefillModel:
    """A preset name (random weights drawn from ``seed``, the same on every rank) or a local HF
    model directory (config.json + safetensors)."""
    device = torch.device(device)
    msg = check_spec(spec, impl)
    if msg:
        raise ValueError(msg)
    if impl == "ours":
        if spec in PRESETS:
            return OurLlama(random_llama(PRESETS[spec], device, dtype, seed),
                            f"preset {spec} (random weights, seed {seed})")
        return OurLlama(load_hf_llama(spec, device, dtype), spec)
    from transformers import AutoModelForCausalLM, LlamaConfig  # optional dependency: only for the transformers models

    import burstengine.integrations.hf  # noqa: F401

    if spec in PRESETS:
        cfg = hf_config_from_args(PRESETS[spec])
        cfg.pop("model_type")
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), attn_implementation="burst", dtype=dtype)
        # the random weights of our preset, so that both implementations of a preset agree
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, p in random_llama(PRESETS[spec], device, dtype, seed).named_parameters():
                params[ours_to_hf(name)].copy_(p)
        return HFCausalLM(model, f"preset {spec} (random weights, seed {seed})")
    model = AutoModelForCausalLM.from_pretrained(spec, attn_implementation="burst", dtype=dtype, device_map=None)
    return HFCausalLM(model.to(device), spec)
