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
from ..kernels import acc_dtype
from ..model import PRESETS, ContextParallel, Transformer
from ..model.llama import context_parallel_attention
from ..model.hf_dir import hf_config_from_args, load_hf_model as load_hf_llama, ours_to_hf

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


def _by_rows(fn, n: int, chunk: int | None):
    """The tuple of tensors ``fn(a, z)`` gives for token rows [a, z) (dim 1), for all n rows:
    in one call, or ``chunk`` rows at a time into preallocated outputs."""
    if not chunk or n <= chunk:
        return fn(0, n)
    outs = None
    for a in range(0, n, chunk):
        z = min(n, a + chunk)
        part = fn(a, z)
        if outs is None:
            outs = tuple(t.new_empty((t.shape[0], n) + tuple(t.shape[2:])) for t in part)
        for o, t in zip(outs, part):
            o[:, a:z] = t
    return outs


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
        # a Mistral checkpoint's sliding window: every query sees the `window` most recent keys,
        # itself included
        self.window = a.window or None
        self.local_sdpa = False
        extra = f", sliding window {self.window}" if self.window else ""
        self.describe = (f"{describe}: burstengine LLaMA{extra}, {a.n_layers} layers, dim {a.dim}, heads {a.n_heads}/"
                         f"{a.n_kv_heads} kv, ffn {a.ffn_dim}, vocab {a.vocab_size}, "
                         f"{_count(a.num_params())} params")

    @staticmethod
    def context_parallel(how: Sharding) -> ContextParallel:
        if how.attention == "burst":
            group = how.group
            if group is None and world_of() >= 1 and dist.is_initialized():
                # the model reads group=None as "plain SDPA on the whole sequence"; in a job,
                # even of one rank, attention "burst" means BurstAttention's kernels
                group = dist.group.WORLD
            return ContextParallel(group=group, layout=how.layout, backward=how.backward, kernel=how.kernel)
        if how.attention != "sdpa":
            raise ValueError(f"unknown attention {how.attention!r}; expected 'burst' or 'sdpa'")
        # plain SDPA on the shard: the model has said so with attention="sdpa", and in its
        # newer form with no group
        names = {f.name for f in fields(ContextParallel)}
        return ContextParallel(group=None, layout=how.layout, **({"attention": "sdpa"} if "attention" in names else {}))

    def attend(self, q, k, v, cp: ContextParallel):
        """Causal attention of this rank's shard over the sequence, within the checkpoint's sliding
        window when it has one."""
        if self.window is not None and cp.group is None and self.local_sdpa:
            raise ValueError("plain SDPA attention has no sliding window; this model needs attention 'burst'")
        return context_parallel_attention(q, k, v, cp, self.window or 0)

    @torch.no_grad()
    def run_layers(self, ids, positions, how: Sharding, kv_sink=None, chunk: int | None = None):
        """Every block on this rank's tokens (B, n) at global ``positions`` (n,); the last block's
        output (B, n, dim), before the final norm.  ``kv_sink(layer, k, v)`` receives each
        layer's (B, n, kv_heads, head_dim) keys (after RoPE) and values as they are made (the
        decode cache copies them and lets them go).  ``chunk``: run the token-wise parts of a
        block (norms, projections, MLP) this many tokens at a time, so a long prompt's MLP
        intermediates never exist whole; attention always sees the whole shard."""
        m = self.model
        cp = self.context_parallel(how)
        self.local_sdpa = how.attention == "sdpa"
        h = m.tok_embeddings(ids)
        # dynamic RoPE scaling reads the global length: this rank's tokens times the ring's ranks
        world = world_of(cp.group) if cp.group is not None else 1
        cos, sin = m.rope(positions, acc_dtype(h), seq_len=h.shape[1] * world)
        n = h.shape[1]
        for i, b in enumerate(m.layers):
            q, k, v = _by_rows(lambda a, z, b=b: b.pre_attention(h[:, a:z], cos[a:z], sin[a:z]), n, chunk)
            o = self.attend(q, k, v, cp)
            del q
            if kv_sink is not None:
                kv_sink(i, k, v)
            del k, v
            (h,) = _by_rows(lambda a, z, b=b: (b.post_attention(h[:, a:z], o[:, a:z]),), n, chunk)
            del o
        return h

    @torch.no_grad()
    def hidden(self, ids, positions, how, keep_kv=False):
        kv = [None] * self.n_layers if keep_kv else None
        sink = (lambda i, k, v: kv.__setitem__(i, (k, v))) if keep_kv else None
        return self.model.norm(self.run_layers(ids, positions, how, sink)), kv

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
        from ..integrations.hf import burst_context  # imports transformers: only for --impl hf

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
    from transformers import AutoModelForCausalLM, LlamaConfig

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
