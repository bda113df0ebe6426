"""Tensor parallelism of a decoder's projections over a group of ranks (Megatron's split), for
decoding over the ranks that hold a sharded KV cache: Helix's scheme, the cache split by
sequence and the weights by tensor parallelism over the same GPUs, so a decode step reads 1/W of
both on each of W ranks.

Rank r of W keeps, of every layer, the q heads [r H/W, (r+1) H/W) and the kv heads
[r Hkv/W, (r+1) Hkv/W) (rows of wq, wk, wv and of their biases), the ffn columns
[r F/W, (r+1) F/W) (rows of w1 and w3), the same ranges of wo's and w2's inputs (columns of their
weights, dim 1), and the vocabulary rows [r V/W, (r+1) V/W) of the LM head.  The norms and the
embedding table stay whole (a step reads one row of the table per token).

A *sliced* model is a :class:`~.decoder.Transformer` of the full shape (``model.args`` is the
whole model's) whose attention and MLP modules have the local widths, with ``model.tp`` its
:class:`Split`: :func:`sliced` builds one that owns its slices (random presets draw only the
slice: ``Transformer.init_weights``; a checkpoint is read a slice at a time:
``hf_dir.load_weights``), :func:`view` one whose parameters are views of a whole model's.

Per layer, a step of a sliced model (inference/step.py) runs four small collectives: one
all-gather of the step's q, k and v (the local heads of all three packed in one buffer:
:func:`gather_qkv`), so that each rank attends to its sequence shard of the cache with every
head; the existing all-gather merge of the partial attentions (inference/kvcache.py); and one
all-reduce of the partial sums after wo and after w2 (:func:`all_reduce`).  The LM head's slices
of the logits are all-gathered at the end (:func:`gather_vocab`).

A prefill of a model that owns only its slices stays context-parallel: each layer runs as a
full-width block whose weights are all-gathered from the ranks' slices just before it runs (one
all-gather per layer: :class:`LayerGather`), so attention keeps whole heads on every rank's
token shard.  A long prompt's prefill is attention-bound and the ring passes K/V (2 Hkv D per
token and layer) where a head-parallel prefill would gather and scatter activations (dim per
token, four times a layer); the weights gathered (one layer's, ~0.44 GB in an 8B model) do not
grow with the prompt.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm.dist import world_of
from ..kernels import acc_dtype
from . import fused
from .args import ModelArgs
from .decoder import Transformer
from .layers import adjacent
from .projection import linear

# our parameters a rank keeps a slice of: (module suffix, dim the slice is taken along, width kind)
_SLICED = {
    "attention.wq": (0, "q"), "attention.wk": (0, "kv"), "attention.wv": (0, "kv"), "attention.wo": (1, "q"),
    "feed_forward.w1": (0, "ffn"), "feed_forward.w3": (0, "ffn"), "feed_forward.w2": (1, "ffn"),
}


def _widths(a: ModelArgs) -> dict[str, int]:
    return {"q": a.n_heads * a.head_dim, "kv": a.n_kv_heads * a.head_dim, "ffn": a.ffn_dim, "vocab": a.vocab_size}


@dataclass(frozen=True)
class Cut:
    """This rank's slice of one parameter: ``size`` entries from ``start`` along ``dim``, of ``full``."""

    dim: int
    start: int
    size: int
    full: int


@dataclass(frozen=True)
class Split:
    """Rank ``rank`` of ``world``'s share of a model's projections."""

    rank: int
    world: int

    def cut(self, name: str, args: ModelArgs) -> Cut | None:
        """This rank's slice of our parameter ``name`` (e.g. ``layers.3.attention.wo.weight``),
        or None for one every rank keeps whole."""
        if name == "output.weight":
            dim, kind = 0, "vocab"
        else:
            module, _, leaf = name.rpartition(".")
            hit = next((v for k, v in _SLICED.items() if module.endswith("." + k)), None)
            if hit is None or (leaf == "bias" and hit[0] == 1):
                return None
            dim, kind = hit
        full = _widths(args)[kind]
        size = full // self.world
        return Cut(dim, self.rank * size, size, full)

    def full_shape(self, name: str, shape, args: ModelArgs) -> tuple[int, ...]:
        """The whole parameter's shape from this rank's slice's ``shape``."""
        c = self.cut(name, args)
        shape = list(shape)
        if c is not None:
            shape[c.dim] = c.full
        return tuple(shape)


def refuses(args: ModelArgs, world: int) -> str | None:
    """Why ``args``' model cannot be split over ``world`` ranks, or None."""
    a = args
    for what, n in (("heads", a.n_heads), ("kv heads", a.n_kv_heads), ("ffn width", a.ffn_dim),
                    ("vocabulary", a.vocab_size)):
        if n % world:
            return f"tensor parallelism over {world} ranks needs the model's {what} ({n}) divisible by {world}"
    return None


def _narrow(model: nn.Module, split: Split, make) -> nn.Module:
    """Replace each sliced parameter of ``model`` (built whole, usually on meta) by ``make(name,
    parameter, cut)`` and set the modules' widths to the local ones."""
    args = model.args
    for name, p in list(model.named_parameters()):
        c = split.cut(name, args)
        if c is None:
            continue
        owner, _, leaf = name.rpartition(".")
        mod = model.get_submodule(owner)
        setattr(mod, leaf, nn.Parameter(make(name, p, c), requires_grad=p.requires_grad))
        if isinstance(mod, nn.Linear):
            mod.out_features, mod.in_features = mod.weight.shape
    for b in model.layers:
        b.attention.n_heads //= split.world
        b.attention.n_kv_heads //= split.world
    model.tp = split
    return model


def sliced(args: ModelArgs, split: Split, device, dtype) -> Transformer:
    """A Transformer of ``args``' shape holding only ``split``'s slices, uninitialised, directly on
    ``device`` in ``dtype`` (nothing whole is ever allocated)."""
    if refuses(args, split.world):
        raise ValueError(refuses(args, split.world))
    with torch.device("meta"):
        model = Transformer(args).to(dtype)
        # one full-width copy of each layer's structure (on meta: no memory), for a prefill that
        # runs it with the whole weights (LayerGather)
        templates = [copy.deepcopy(b) for b in model.layers]

        def shrink(name, p, c):
            shape = list(p.shape)
            shape[c.dim] = c.size
            return torch.empty(shape, dtype=p.dtype)

        _narrow(model, split, shrink)
    model.to_empty(device=device)
    model.tp_templates = templates  # a list: not submodules, no parameters of the model
    return model


def empty_model(args: ModelArgs, device, dtype, split: Split | None = None) -> Transformer:
    """A Transformer of ``args``, uninitialised, allocated once directly on ``device`` in ``dtype``:
    whole, or only ``split``'s slices."""
    if split is not None:
        return sliced(args, split, device, dtype)
    with torch.device("meta"):
        model = Transformer(args)
    return model.to(dtype).to_empty(device=device)


def view(model: Transformer, split: Split) -> Transformer:
    """A sliced Transformer whose parameters are views of whole ``model``'s (no memory): the
    slices rows or columns of the same storage, the norms and embedding the same tensors."""
    if refuses(model.args, split.world):
        raise ValueError(refuses(model.args, split.world))
    with torch.device("meta"):
        out = Transformer(model.args)
    whole = dict(model.named_parameters())
    for name in list(dict(out.named_parameters())):
        owner, _, leaf = name.rpartition(".")
        setattr(out.get_submodule(owner), leaf, whole[name])
    _narrow(out, split, lambda name, p, c: p.detach().narrow(c.dim, c.start, c.size))
    return out.eval()


def head_weight(model: nn.Module) -> torch.Tensor:
    """This rank's vocabulary rows of a sliced model's LM head (of the embedding table when tied)."""
    if model.output is not None:
        return model.output.weight
    c = model.tp.cut("output.weight", model.args)
    return model.tok_embeddings.weight.narrow(0, c.start, c.size)


# --- the collectives of a sliced model's decode step --------------------------------------------

def _all_gather(out: torch.Tensor, mine: torch.Tensor, group) -> None:
    """``out`` (W, *mine.shape) = every rank's ``mine`` (a copy on one rank)."""
    if out.shape[0] == 1:
        out[0].copy_(mine)
        return
    # torch >= 2.13 names it all_gather_single (all_gather_into_tensor warns there)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out.flatten(0, 1), mine, group=group)  # the output as every rank's dim 0 in turn (gloo's form)


def gather_qkv(q, k, v, world: int, group) -> torch.Tensor:
    """Every rank's q, k and v heads of the step, (W, B, (hq + hk + hv) D): rank r's row its q
    heads, then its k heads, then its v heads.  On GPUs the packing is one compiled kernel
    (fused.run); a step of one sequence whose q, k, v are the packed projection's output
    (model/layers.py: pack) needs no packing."""
    mine = None
    if q.shape[1] == 1 and all(t.is_contiguous() for t in (q, k, v)):
        mine = adjacent([t.view(-1) for t in (q, k, v)])
    mine = fused.run(_pack_heads, q, k, v) if mine is None else mine.view(1, -1)
    every = mine.new_empty((world,) + tuple(mine.shape))
    _all_gather(every, mine, group)
    return every


def unpack_heads(every: torch.Tensor, heads: tuple[int, int, int], rope=None, norms=None):
    """q, k, v (1, B, W h, D) from :func:`gather_qkv`'s ``every`` with ``heads`` (hq, hk, hv) a
    rank; with ``rope`` (cos, sin) q and k normed (``norms``) and roped as they are unpacked (one
    compiled kernel on GPUs; a decode step's cache writes them in one Triton kernel instead:
    inference/kvcache.py ``write_heads``)."""
    if rope is None:
        return fused.run(_unpack_heads, every, *heads)
    qn, kn = norms if norms is not None and norms[0] is not None else (None, None)
    return fused.run(_unpack_roped, every, *heads, rope[0], rope[1], qn.weight if qn else None,
                     kn.weight if kn else None, qn.eps if qn else 0.0, bool(qn and qn.plus_one))


def _pack_heads(q, k, v):
    B = q.shape[1]
    return torch.cat([t[0].reshape(B, -1) for t in (q, k, v)], dim=-1)


def _unpack_heads(every, hq: int, hk: int, hv: int):
    W, B = every.shape[:2]
    D = every.shape[2] // (hq + hk + hv)
    out, at = [], 0
    for h in (hq, hk, hv):
        t = every[:, :, at * D:(at + h) * D].reshape(W, B, h, D)
        out.append(t.transpose(0, 1).reshape(1, B, W * h, D))
        at += h
    return tuple(out)


def _unpack_roped(every, hq: int, hk: int, hv: int, cos, sin, qw, kw, eps: float, plus_one: bool):
    """_unpack_heads, then what Attention.heads does to q and k: the q/k norms (with weights), RoPE."""
    q, k, v = _unpack_heads(every, hq, hk, hv)
    if qw is not None:
        q, k = fused.rms_norm_eager(q, qw, eps, plus_one), fused.rms_norm_eager(k, kw, eps, plus_one)
    return fused.rope_eager(q, cos, sin), fused.rope_eager(k, cos, sin), v


def my_heads(heads: int, split: Split) -> tuple[int, int]:
    """This rank's range [lo, hi) of ``heads`` attention heads."""
    h = heads // split.world
    return split.rank * h, (split.rank + 1) * h


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over the ranks of a row-parallel projection's partial outputs (in place)."""
    if world_of(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def gather_vocab(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """(R, V) from every rank's (R, V / W) vocabulary slice of the logits."""
    x = x.contiguous()
    every = x.new_empty((world,) + tuple(x.shape))
    _all_gather(every, x, group)
    return every.transpose(0, 1).reshape(x.shape[0], -1)


def logits(model: nn.Module, h: torch.Tensor, group) -> torch.Tensor:
    """(R, V) logits of final-norm rows ``h`` (R, dim), float32 (float64 for float64 rows), from a
    sliced model's vocabulary slice of the LM head on every rank of ``group`` (each passes the
    same rows)."""
    local = linear(h, head_weight(model).to(h.dtype)).to(acc_dtype(h))
    return gather_vocab(local, model.tp.world, group)


# --- prefill of a model that owns only its slices ------------------------------------------------

class LayerGather:
    """``Hooks.block`` of a prefill of a model that owns only its slices: each layer runs as a
    full-width copy of its own structure and settings (a meta template made with the model)
    whose weights are all-gathered from every rank's slices just before it runs: all of a layer's
    slices packed in one buffer, one all-gather per layer.  The whole weights live in one set of
    buffers, reused by every layer."""

    def __init__(self, model: nn.Module, group):
        self.model, self.group, self.split = model, group, model.tp
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.store = None  # name -> one layer's whole weight

    def __call__(self, b: nn.Module) -> nn.Module:
        i, W = b.index, self.split.world
        t = self.model.tp_templates[i]
        if self.store is None:
            self.store = {n: torch.empty(p.shape, dtype=self.dtype, device=self.device)
                          for n, p in t.named_parameters()}
        memo = {id(p): nn.Parameter(self.store[n], requires_grad=False) for n, p in t.named_parameters()}
        full = copy.deepcopy(t, memo)
        for k, v in vars(b).items():  # the run's settings of the layer (hooks, ring, index, policy)
            if not k.startswith("_"):
                full.__dict__[k] = v
        mine = dict(b.named_parameters())
        cuts = {n: self.split.cut(f"layers.{i}.{n}", self.model.args) for n in mine}
        with torch.no_grad():
            names = [n for n, c in cuts.items() if c is not None]
            packed = torch.cat([mine[n].reshape(-1) for n in names])
            every = packed.new_empty((W, packed.numel()))
            _all_gather(every, packed, self.group)
            at = 0
            for n, c in cuts.items():
                if c is None:
                    self.store[n].copy_(mine[n])
                    continue
                m = mine[n].numel()
                parts = every[:, at:at + m].reshape((W,) + tuple(mine[n].shape))
                self.store[n].copy_(torch.cat(parts.unbind(0), dim=c.dim))
                at += m
        return full
