"""Hugging Face transformers drop-in: ``attn_implementation="burst"``.

Importing this module registers "burst" with transformers' ``AttentionInterface`` (the attention
call: BurstAttention over the ranks of a context-parallel group) and ``AttentionMaskInterface``
(the mask: none at all, since the ring applies causality from the layout; this is also where
padding and other masks are turned away).  Every rank loads the whole model and feeds it its
shard of the sequence together with the *global* positions of the tokens it holds::

    import burstengine as be
    from burstengine.integrations.hf import burst_context   # registers "burst"

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="burst")
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = be.shard(input_ids, "zigzag", rank, world)                       # (B, S / world)
    pos = be.position_ids(input_ids.shape[1], "zigzag", rank, world)[None]  # (1, S / world)
    with burst_context(group=None, layout="zigzag"):
        logits = model(input_ids=ids, position_ids=pos).logits             # this rank's rows
        loss(logits).backward()                                            # exact gradients

What is supported, exactly: causal self-attention over the full sharded sequence (prefill and
training, forward and backward), GQA/MQA without expanding K/V, sliding-window models (Mistral's
``sliding_window`` W: each query sees the W most recent keys, itself included), packed documents
(global position_ids that restart at 0 at each document start, the same boundaries in every row
of the batch: attention never crosses a document), ``use_cache=True`` (the cache then holds this
rank's shard of K/V).  What is refused with a ValueError, raised on every rank of the group before
any ring traffic: a padding ``attention_mask`` with zeros (an all-ones mask is accepted), 4-D
masks, chunked / bidirectional / multimodal masks, attention dropout, softcapping, attention
sinks, position_ids that are neither the layout's global positions nor positions restarting per
document, rows with different document boundaries, shards of different lengths,
``output_attentions=True``, and, over several ranks, decoding steps against a cache (each rank's
cache holds a shard: decode with :func:`burstengine.inference.generate`) and a causal-LM loss
from plain ``labels=`` (transformers would shift them inside each shard): pass ``shift_labels``,
the labels shifted on the global sequence and then sharded (the error message shows the call).
In one process ``model.generate()`` works: its prefill is "burst" attention, and each decoding
step attends plainly (exactly) over transformers' cache.

The group and layout come from :func:`burst_context` (a context manager) or :func:`configure`
(a process-wide setting).  In a single process without torch.distributed neither is needed: the
"group" is that process and "burst" is ordinary exact attention.  Works with transformers 5.x.
"""
from __future__ import annotations

import contextlib
import sys
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..attention import burst_attn_func
from ..attention.checks import BACKWARDS
from ..comm.dist import rank_of, world_of
from ..layout import LAYOUTS, position_ids as layout_positions, unshard

NAME = "burst"


@dataclass(frozen=True)
class BurstSettings:
    """Where and how "burst" attention runs: the context-parallel group (None: the default
    group), the sequence layout of the shards, the backward scheme and the local kernel (see
    :func:`burstengine.burst_attn_func`)."""

    group: Any = None
    layout: str = "contiguous"
    backward: str = "auto"
    kernel: str | None = None

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; expected one of {LAYOUTS}")
        if self.backward not in BACKWARDS:
            raise ValueError(f"unknown backward {self.backward!r}; expected one of {BACKWARDS}")

    def world(self) -> tuple[int, int]:
        return rank_of(self.group), world_of(self.group)


# A process-wide stack rather than a contextvar: autograd runs backward (and any activation
# recomputation) on its own threads, which must see the same settings as the forward.
_stack: list[BurstSettings] = []
_configured: BurstSettings | None = None


@contextlib.contextmanager
def burst_context(group=None, layout: str = "contiguous", backward: str = "auto", kernel: str | None = None):
    """Run "burst" attention over ``group`` with shards in ``layout`` inside the block."""
    _stack.append(BurstSettings(group, layout, backward, kernel))
    try:
        yield _stack[-1]
    finally:
        _stack.pop()


def configure(group=None, layout: str = "contiguous", backward: str = "auto",
              kernel: str | None = None) -> BurstSettings:
    """Set the process-wide settings used outside any :func:`burst_context` (a setup call for
    code that cannot wrap its forward in a ``with``, e.g. a trainer); :func:`reset` clears them."""
    global _configured
    _configured = BurstSettings(group, layout, backward, kernel)
    return _configured


def reset() -> None:
    """Forget the settings of :func:`configure`."""
    global _configured
    _configured = None


def current_settings() -> BurstSettings:
    if _stack:
        return _stack[-1]
    if _configured is not None:
        return _configured
    if world_of() > 1:
        raise ValueError('attn_implementation="burst" runs inside a context-parallel group: wrap the forward in '
                         'burstengine.integrations.hf.burst_context(group=..., layout=...) or call configure(...)')
    return BurstSettings()


# --- the mask ----------------------------------------------------------------------------------

class _Padded:
    """What the mask function hands the attention when a 2-D mask has zeros.  The attention
    raises on it after all ranks have compared notes (a rank may hold no padding at all)."""

    def __repr__(self):
        return "<padding mask refused by burst attention>"


PADDED = _Padded()


def _closure(fn, name):
    code = getattr(fn, "__code__", None)
    if code is None or fn.__closure__ is None:
        return None
    cells = dict(zip(code.co_freevars, fn.__closure__))
    return cells[name].cell_contents if name in cells else None


def _mask_parts(fn) -> set | None:
    """The parts of a transformers mask function: {'causal'} for the plain causal mask, with
    'window' for its sliding-window overlay and 'packed' for its packed-sequence handling (which it
    adds when a rank's positions jump, as zigzag and striped shards' and restarting documents' do;
    the positions themselves are read in the attention); None for anything else."""
    from transformers import masking_utils as mu  # optional dependency: imported when used

    if fn is mu.causal_mask_function:
        return {"causal"}
    name = getattr(fn, "__qualname__", "")
    if name.startswith("packed_sequence_mask_function."):
        return {"packed"}
    if name.startswith("sliding_window_overlay."):
        return {"window"}
    if name.startswith("remap_positions_for_packed_sequence."):
        return _mask_parts(_closure(fn, "mask_function"))
    if name.startswith("and_masks."):
        parts = [_mask_parts(f) for f in (_closure(fn, "mask_functions") or ())]
        if parts and all(p is not None for p in parts):
            return set().union(*parts)
    return None


def burst_mask(batch_size=None, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
               attention_mask=None, **kwargs):
    """The AttentionMaskInterface entry for "burst": builds nothing (the ring applies causality
    from the layout, the window from the attention's ``sliding_window``, document boundaries
    from the positions), refuses every other mask."""
    parts = _mask_parts(mask_function)
    if parts is None or "causal" not in parts:
        what = getattr(mask_function, "__qualname__", repr(mask_function))
        raise ValueError(f'attn_implementation="burst" computes causal attention (with a sliding window or packed '
                         f'documents) only; this model asked for the mask {what} (chunked, bidirectional or '
                         f'multimodal masks are not supported)')
    if attention_mask is not None and not bool(attention_mask.all()):
        return PADDED
    return None


# --- the attention -----------------------------------------------------------------------------

# the document boundaries layer 0 found, for the other layers of the same forward
_docs: tuple | None = None


def _agree(settings: BurstSettings, module, query, key, attention_mask, position_ids) -> tuple | None:
    """Checks whose outcome may differ between ranks (padding, positions, shard lengths):
    every rank gathers every rank's findings, so all raise the same error or none does.
    Returns the global document boundaries (cu_seqlens) the positions describe, or None."""
    rank, world = settings.world()
    B, _, n, _ = query.shape
    padded = attention_mask is PADDED
    other_mask = attention_mask is not None and not padded
    pos_shape = tuple(position_ids.shape) if position_ids is not None else ()
    pos_ok = len(pos_shape) == 2 and pos_shape[1] == n and pos_shape[0] in (1, B)
    mine = [B, n, int(padded), int(other_mask), int(not pos_ok)]
    dev = query.device
    if world > 1:
        parts = [torch.zeros(len(mine), dtype=torch.int64, device=dev) for _ in range(world)]
        dist.all_gather(parts, torch.tensor(mine, dtype=torch.int64, device=dev), group=settings.group)
        table = [p.tolist() for p in parts]
    else:
        table = [mine]
    if len({(r[0], r[1]) for r in table}) > 1:
        raise ValueError("ranks hold shards of different shapes (batch, tokens) "
                         f"{[(r[0], r[1]) for r in table]}: every rank must hold S / world tokens of the same batch")
    ranks = lambda i: [r for r, row in enumerate(table) if row[i]]  # noqa: E731
    if ranks(2):
        raise ValueError(f'attn_implementation="burst" does not support padding: the attention_mask has zeros on '
                         f'rank(s) {ranks(2)}; pass unpadded sequences (an all-ones mask or None)')
    if ranks(3):
        raise ValueError(f'attn_implementation="burst" takes no explicit attention mask (rank(s) {ranks(3)} passed a '
                         f'{type(attention_mask).__name__}); causality comes from the layout')
    S = n * world
    hint = (f"pass burstengine.position_ids(S, {settings.layout!r}, rank, world) for a sequence of S = {S} tokens, or "
            f"the shards of positions restarting at 0 at each packed document")
    if ranks(4):
        raise ValueError(f"position_ids on rank(s) {ranks(4)} are not the global positions of layout "
                         f"{settings.layout!r}: {hint}")
    pos = position_ids.expand(B, n).to(device=dev, dtype=torch.int64).contiguous()
    if world > 1:  # every rank sees the whole sequence's positions, so all find the same documents
        shards = [torch.empty_like(pos) for _ in range(world)]
        dist.all_gather(shards, pos, group=settings.group)
        pos = unshard(shards, settings.layout)
    pos = pos.cpu()
    # positions restarting per document: each is 0 or its predecessor + 1, and the first is 0
    follows = torch.cat([pos[:, :1] == 0, (pos[:, 1:] == pos[:, :-1] + 1) | (pos[:, 1:] == 0)], dim=1)
    if not bool(follows.all()):
        bad = sorted({int(r) for r in _owners(torch.nonzero(~follows)[:, 1], settings.layout, world, S)})
        raise ValueError(f"position_ids on rank(s) {bad} are not the global positions of layout "
                         f"{settings.layout!r}: {hint}")
    starts = pos == 0
    if not bool((starts == starts[:1]).all()):
        raise ValueError("the rows of the batch pack documents at different boundaries; burst attention takes one "
                         "set of document boundaries for the batch: pack every row alike, or run rows apart")
    cuts = torch.nonzero(starts[0]).flatten().tolist()
    return None if cuts == [0] else tuple(cuts) + (S,)


def _owners(global_idx: torch.Tensor, layout: str, world: int, S: int) -> list[int]:
    """The ranks holding the given global token indices under ``layout``."""
    owner = torch.empty(S, dtype=torch.int64)
    for r in range(world):
        owner[layout_positions(S, layout, r, world)] = r
    return owner[global_idx].tolist()


def burst_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                            sliding_window=None, softcap=None, s_aux=None, position_ids=None, **kwargs):
    """The AttentionInterface entry for "burst".  query (B, H, n, D), key/value (B, Hkv, n, D):
    this rank's shard; returns (out (B, n, H, D), None)."""
    global _docs
    settings = current_settings()
    refused = [name for name, bad in (("attention dropout", dropout and dropout > 0),
                                      ("softcap", softcap is not None),
                                      ("attention sinks (s_aux)", s_aux is not None),
                                      ("non-causal attention", not getattr(module, "is_causal", True))) if bad]
    if kwargs.get("output_attentions"):
        refused.append("output_attentions=True (the attention weights are never formed)")
    if refused:
        raise ValueError(f'attn_implementation="burst" does not support {", ".join(refused)}')
    _SHARDED[:] = [(query.shape[0], query.shape[2], settings.layout, _config_of(module))] \
        if settings.world()[1] > 1 else []
    if key.shape[2] != query.shape[2]:
        return _cached_step(settings, query, key, value, attention_mask, scaling, sliding_window), None
    if getattr(module, "layer_idx", 0) in (0, None):
        _docs = _agree(settings, module, query, key, attention_mask, position_ids)
    # transformers' sliding_window W keeps keys with kv > q - W: the W most recent, the query's own
    # included, which is burst_attn_func's window=W
    out = burst_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), group=settings.group,
                          causal=True, layout=settings.layout, softmax_scale=scaling, backward=settings.backward,
                          kernel=settings.kernel, window=sliding_window or None, cu_seqlens=_docs)
    return out, None


def _cached_step(settings: BurstSettings, query, key, value, attention_mask, scaling, sliding_window):
    """A decoding step against transformers' cache (``model.generate()``): the m new queries,
    the last m of the K cached + new keys, attend causally to the keys, plainly (exact; a
    step's m x K scores are small).  In one process only: over several ranks each rank's cache
    holds its shard of the sequence (burstengine.inference.generate decodes against that)."""
    m, K = query.shape[2], key.shape[2]
    if settings.world()[1] > 1:
        raise ValueError('attn_implementation="burst" decodes against a cache in one process only: over several ranks '
                         "each rank's cache holds its shard of the prompt; decode with burstengine.inference.generate "
                         "(`burstengine generate`)")
    if m > K:
        raise ValueError(f'attn_implementation="burst": {m} queries against {K} keys')
    if attention_mask is PADDED:
        raise ValueError('attn_implementation="burst" does not support padding: the attention_mask has zeros; pass '
                         'unpadded sequences (an all-ones mask or None)')
    if attention_mask is not None:
        raise ValueError(f'attn_implementation="burst" takes no explicit attention mask (got a '
                         f'{type(attention_mask).__name__}); causality comes from the positions')
    # query i is the token at K - m + i: it sees the keys up to itself, the W most recent with a window
    q_at = torch.arange(K - m, K, device=query.device)[:, None]
    k_at = torch.arange(K, device=query.device)[None, :]
    visible = (k_at <= q_at) & ((k_at > q_at - sliding_window) if sliding_window else True)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scaling,
                                                           enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous()


# (batch, local tokens, layout, the model's config) of the last "burst" forward over several
# ranks: a causal-LM loss on logits of that shape, computed by that model, is this rank's shard
# (see _sharded_loss)
_SHARDED: list = []

# what the refusal of plain labels= tells the user to run instead (tests/integrations/test_hf.py runs it)
SHIFT_RECIPE = ("shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]; "
                "mine = burstengine.shard(shift, {layout!r}, rank, world).contiguous(); "
                "loss = model(input_ids=ids, position_ids=pos, labels=mine, shift_labels=mine, "
                "num_items_in_batch=(shift != -100).sum()).loss")


def _config_of(module):
    """A weak reference to the config an attention module shares with its model (None if none)."""
    cfg = getattr(module, "config", None)
    try:
        return weakref.ref(cfg) if cfg is not None else None
    except TypeError:
        return None


def _calling_model():
    """The transformers model whose forward is computing this loss (found up the call stack:
    ``XForCausalLM.forward`` calls ``self.loss_function``), or None when the loss is called
    from elsewhere."""
    f = sys._getframe(2)
    for _ in range(12):
        if f is None:
            return None
        me = f.f_locals.get("self")
        if me is not None and hasattr(me, "config") and hasattr(me, "loss_function"):
            return me
        f = f.f_back
    return None


def _sharded_loss(loss_fn):
    """transformers' causal-LM loss, refusing plain ``labels=`` on a shard: transformers shifts
    the labels inside the tensor it gets, so each shard's last token would be paired with the
    wrong label (a loss off by a fraction of a percent, silently).  Pre-shifted labels of the
    global sequence (``shift_labels``, sharded like the inputs) are exact.  Only the model that
    ran the last "burst" forward is refused: another model (eager, say) computing a loss of the
    same shape afterwards is not."""
    def loss(logits, labels, vocab_size, *args, shift_labels=None, **kwargs):
        if _SHARDED and shift_labels is None and labels is not None and \
                tuple(logits.shape[:2]) == _SHARDED[0][:2] and _burst_model_computes(_SHARDED[0][3]):
            layout = _SHARDED[0][2]
            raise ValueError(
                'attn_implementation="burst" over several ranks: labels= would be shifted inside this rank\'s shard, '
                "pairing its last token with the wrong label. Shift on the global sequence before sharding and pass "
                f"it as shift_labels: {SHIFT_RECIPE.format(layout=layout)}; then all_reduce the ranks' losses (SUM)")
        return loss_fn(logits, labels, vocab_size, *args, shift_labels=shift_labels, **kwargs)
    loss.burst_wrapped = loss_fn
    return loss


def _burst_model_computes(config_ref) -> bool:
    model = _calling_model()
    if model is None or config_ref is None:
        return True  # called outside a model's forward: the shape is all there is to go by
    return model.config is config_ref()


def register() -> None:
    """Register "burst" with transformers (done on import; safe to repeat)."""
    from transformers.loss.loss_utils import LOSS_MAPPING  # optional dependency: imported when used
    from transformers import AttentionInterface  # optional dependency: imported when used
    from transformers.masking_utils import AttentionMaskInterface  # optional dependency: imported when used

    AttentionInterface.register(NAME, burst_attention_forward)
    AttentionMaskInterface.register(NAME, burst_mask)
    if not hasattr(LOSS_MAPPING["ForCausalLM"], "burst_wrapped"):
        LOSS_MAPPING["ForCausalLM"] = _sharded_loss(LOSS_MAPPING["ForCausalLM"])


register()

__all__ = ["NAME", "BurstSettings", "burst_context", "configure", "reset", "current_settings",
           "burst_attention_forward", "burst_mask", "register"]
