"""The model behind prefill: a thin, swappable piece.

Prefill needs three things of a model: the final-norm hidden states of this rank's tokens,
the LM head applied to a few of them, and (optionally) the keys and values every layer
attended with.  Two implementations provide them:

* ``ours`` (default): :class:`burstengine.model.Transformer`, the model BurstEngine trains, with
  weights from a preset (random) or an HF checkpoint of a supported family (:mod:`burstengine.model.hf_dir`).
* ``hf``: any transformers causal LM loaded with ``attn_implementation="burst"``
  (:mod:`burstengine.integrations.hf`), for checkpoints our LLaMA does not reproduce.
"""
from __future__ import annotations

import json
import os
import warnings

import torch

from ..comm.dist import rank_of, world_of
from ..kernels import acc_dtype
from ..model import PRESETS, ContextParallel, Hooks, ModelArgs, Transformer, fused, tensor_parallel
from ..model.layers import CHUNK, pack_model
from ..model.hf_dir import UntiedHead, args_from_hf_config, args_from_hf_dir, hf_config_from_args, load_hf_model, \
    ours_to_hf, read_config, tensor_files

IMPLS = ("ours", "hf")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


class PrefillModel:
    """Interface: ``hidden(ids (B, n), positions (n,), cp: ContextParallel, rows=None,
    kv_sink=None, chunk=None)`` -> the final-norm hidden states of this rank's tokens, (B, n, dim),
    or (R, dim) at ``rows`` ((batch, token) index tensors); ``kv_sink(layer, k, v)`` receives each
    layer's keys (after RoPE) and values of this rank's tokens, (B, n, kv_heads, head_dim);
    ``chunk``: the token-wise work this many tokens at a time (None: the default for the shard's
    length, 0: all at once).  ``logits(h (..., dim))`` -> float32 (float64 for a float64 model).
    ``refuses(attention)``: why this model cannot run prefill's ``attention`` ("burst", "sdpa"),
    or None.  ``describe`` is one line for the log.  ``sliced``: the model holds only this rank's
    tensor-parallel slices (its ``logits`` is then a collective of its group)."""

    vocab_size: int
    n_layers: int
    device: torch.device
    dtype: torch.dtype
    describe: str
    sliced: bool = False

    def hidden(self, ids, positions, cp: ContextParallel, rows=None, kv_sink=None, chunk: int | None = None):
        raise NotImplementedError

    def logits(self, h):
        raise NotImplementedError

    def refuses(self, attention: str) -> str | None:
        return None


class OurLlama(PrefillModel):
    """burstengine's decoder, whole, or (``model.tp`` set) only this rank's tensor-parallel slices
    over ``tp_group`` (:mod:`burstengine.model.tensor_parallel`): its prefill then gathers each
    layer's weights as it runs, and its decoding is tensor-parallel over the same group."""

    def __init__(self, model: Transformer, describe: str, tp_group=None):
        self.model = model.eval()
        self.tp_group = tp_group
        self._views = {}  # (rank, world) -> a tensor-parallel view of the whole model's weights
        a = model.args
        self.vocab_size, self.n_layers = a.vocab_size, a.n_layers
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # a Mistral checkpoint's sliding window: every query sees the `window` most recent keys,
        # itself included
        self.window = a.window or None
        extra = f", sliding window {self.window}" if self.window else ""
        if model.tp is not None:
            extra += f", tensor-parallel slice {model.tp.rank + 1} of {model.tp.world}"
        self.describe = (f"{describe}: burstengine LLaMA{extra}, {a.n_layers} layers, dim {a.dim}, heads {a.n_heads}/"
                         f"{a.n_kv_heads} kv, ffn {a.ffn_dim}, vocab {a.vocab_size}, "
                         f"{_count(a.num_params())} params")

    def refuses(self, attention):
        if attention == "sdpa" and self.window is not None:
            return "plain SDPA attention has no sliding window; this model needs attention 'burst'"
        return None

    @property
    def sliced(self) -> bool:
        """The model holds only this rank's tensor-parallel slices."""
        return self.model.tp is not None

    def decoder(self, group=None) -> Transformer:
        """The Transformer a tensor-parallel decode step over ``group`` runs: the model itself
        when it holds only its slices, else views of its whole weights (made once per place)."""
        rank, world = rank_of(group), world_of(group)
        split = self.model.tp
        if split is not None:
            if (split.rank, split.world) != (rank, world):
                raise ValueError(f"the model holds the tensor-parallel slice of rank {split.rank} of {split.world}; "
                                 f"this run is rank {rank} of {world}")
            return self.model
        if (rank, world) not in self._views:
            self._views[(rank, world)] = tensor_parallel.view(self.model, tensor_parallel.Split(rank, world))
        return self._views[(rank, world)]

    @torch.no_grad()
    def hidden(self, ids, positions, cp, rows=None, kv_sink=None, chunk=None):
        self.model.set_context_parallel(cp)
        block = tensor_parallel.LayerGather(self.model, self.tp_group) if self.sliced else None
        if chunk is None:  # the default: a long shard in pieces of CHUNK tokens over the batch
            B, n = ids.shape
            chunk = max(1, CHUNK // B) if B * n > CHUNK else 0
        with fused.any_length():  # a prompt's length is new at nearly every call: compile for any
            return self.model.hidden(ids, positions, hooks=Hooks(kv_sink=kv_sink, chunk=chunk or None, block=block),
                                     rows=rows)

    @torch.no_grad()
    def logits(self, h):
        """float32 logits (float64 for a float64 model, the tests' oracle); of a sliced model,
        gathered from every rank's vocabulary slice (every rank of its group calls this with the
        same rows)."""
        if self.sliced:
            return tensor_parallel.logits(self.model, h, self.tp_group)
        return self.model.logits(h).to(acc_dtype(h))


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

    def refuses(self, attention):
        if attention != "burst":
            return f"the transformers model runs attention 'burst' only, not {attention!r}"
        return None

    @torch.no_grad()
    def hidden(self, ids, positions, cp, rows=None, kv_sink=None, chunk=None):
        from ..integrations.hf import burst_context  # imports transformers: only for --impl hf

        if chunk:
            raise ValueError("the transformers model runs its prefill whole: chunk is for burstengine's LLaMA "
                             "(impl 'ours')")
        # attention "burst" over the group; without one (no job), on this process's whole sequences
        with burst_context(group=cp.group, layout=cp.layout, backward=cp.backward, kernel=cp.kernel):
            out = self.model.base_model(input_ids=ids, position_ids=positions[None].expand(ids.shape[0], -1),
                                        use_cache=kv_sink is not None)
        if kv_sink is not None:
            for i, layer in enumerate(out.past_key_values.layers):
                kv_sink(i, layer.keys.transpose(1, 2), layer.values.transpose(1, 2))
        h = out.last_hidden_state
        return h if rows is None else h[rows]

    @torch.no_grad()
    def logits(self, h):
        return self.model.get_output_embeddings()(h).to(acc_dtype(h))


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; expected auto or one of {sorted(table)}")
    return table[name]


def spec_args(spec: str) -> ModelArgs:
    """The ModelArgs of a preset or of a model directory's config.json (a ValueError for a family
    burstengine's model does not run)."""
    return PRESETS[spec] if spec in PRESETS else args_from_hf_config(read_config(spec), f"{spec}/config.json")


def check_spec(spec: str, impl: str) -> str | None:
    """A message when ``spec`` is neither a preset nor a model directory, or (``impl="ours"``) a
    directory of a family burstengine's model does not reproduce (checked before any rank starts)."""
    if impl not in IMPLS:
        return f"unknown --impl {impl!r}; expected one of {IMPLS}"
    if spec in PRESETS:
        return None
    if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "config.json")):
        if impl == "ours":  # a family our model does not reproduce: said here, not by every rank's load
            try:
                spec_args(spec)
            except json.JSONDecodeError as e:
                return f"{spec}/config.json is not JSON ({e})"
            except ValueError as e:
                return str(e)
            except (KeyError, TypeError) as e:
                return f"{spec}/config.json lacks or mistypes {e}"
        return None
    return f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a directory with a config.json"


def check_model_files(spec: str, impl: str) -> str | None:
    """A message naming the file when model directory ``spec`` is damaged (config.json or the
    index not JSON, a shard missing, truncated or garbled, an index pointing at the wrong file)
    or, for ``impl`` "ours", not a model burstengine reproduces; None for a preset.  Headers
    only: commands call it before any rank starts (a NaN weight is found as the ranks load)."""
    if spec in PRESETS or not os.path.isdir(spec):
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UntiedHead)  # the ranks say it as they load
            if impl == "ours":
                args_from_hf_dir(spec)
            else:
                read_config(spec)
                tensor_files(spec)
    except ValueError as e:
        return str(e)
    return None


def random_llama(args, device, dtype, seed: int = 0, split=None) -> Transformer:
    """Our LLaMA with ``args``' shape and random weights (the same on every rank for a seed),
    allocated once, directly in ``dtype`` on ``device``; with a tensor-parallel ``split``
    (:class:`~burstengine.model.tensor_parallel.Split`) only its slices, the same values as the
    whole model's there."""
    model = tensor_parallel.empty_model(args, device, dtype, split)
    model.init_weights(seed)
    return model


def load_model(spec: str, impl: str = "ours", device="cpu", dtype=torch.float32, seed: int = 0, *,
               tp_group=None) -> PrefillModel:
    """A preset name (random weights drawn from ``seed``, the same on every rank) or a local HF
    model directory (config.json + safetensors).  ``tp_group``: load only this rank's
    tensor-parallel slices over that group (a preset draws only them, a checkpoint is read a
    slice at a time), for decoding over it (:func:`~.generate.generate`); a ValueError when the
    model's heads, kv heads, ffn width or vocabulary do not divide over it."""
    device = torch.device(device)
    msg = check_spec(spec, impl)
    if msg:
        raise ValueError(msg)
    if impl == "ours":
        split = None
        if tp_group is not None:
            split = tensor_parallel.Split(rank_of(tp_group), world_of(tp_group))
            why = tensor_parallel.refuses(spec_args(spec), split.world)
            if why:
                raise ValueError(f"--model {spec}: {why}")
        if spec in PRESETS:
            model, describe = random_llama(PRESETS[spec], device, dtype, seed, split), \
                f"preset {spec} (random weights, seed {seed})"
        else:
            model, describe = load_hf_model(spec, device, dtype, split), spec
        pack_model(model)  # one matmul for q, k, v and one for gate and up (model/layers.py: pack)
        return OurLlama(model, describe, tp_group)
    if tp_group is not None:
        raise ValueError("tensor-parallel loading is for burstengine's LLaMA (impl 'ours')")
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
