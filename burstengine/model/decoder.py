"""The decoder: embedding, the layers, the final norm, and the LM head / loss, run by one loop.

Training (:meth:`Transformer.forward`), prefill, generation's prefill and its decode step
(:mod:`burstengine.inference`) all run :meth:`Transformer.hidden`; what differs between them
reaches the layers as :class:`~.layers.Hooks` (a KV sink that prefill fills, a decode step's
cache in place of attention, chunked token-wise work), and the per-layer checkpoint policy
(:mod:`.recompute`) decides what training keeps for backward.  Under context parallelism
each rank holds the tokens of its shard of the global sequence, so RoPE is computed from the
*global* positions those tokens have (:class:`~.context_parallel.ContextParallel`).

The model ends at the final norm: turning hidden states into a loss is a separate, pluggable
step (:mod:`burstengine.loss.model_loss`) that the root ``forward`` calls with the LM head's weight,
so that a fused LM head + cross-entropy never has to materialise the logits.
"""
from __future__ import annotations

import functools
import hashlib
import math
from contextlib import contextmanager

import torch
import torch.nn as nn

from ..comm.dist import world_of
from ..kernels import acc_dtype
from ..loss import model_loss
from . import offload, recompute, tiled
from .args import ModelArgs
from .context_parallel import ContextParallel
from .layers import NO_HOOKS, Block, Hooks, RMSNorm
from .projection import linear
from .rope import rope_tables


class Transformer(nn.Module):
    """The decoder: token embedding, ``n_layers`` :class:`~.layers.Block` s, the final norm, and
    the LM head (the embedding's weight when tied), with the checkpoint policy of its layers
    (``checkpoint``: one of :data:`.recompute.POLICIES`, or "auto": planned per layer) and
    the loss ``forward`` ends in (:data:`burstengine.loss.model_loss.LOSSES`)."""

    def __init__(self, args: ModelArgs, checkpoint: str = "none", loss: str = "naive", checkpoint_split: float = 0.5,
                 activation_budget: int | None = None, offload_budget: int | None = 0,
                 host_policies: tuple = recompute.HOST, tiled_mlp: str = "off", mlp_chunk: int = 8192):
        super().__init__()
        args.validate()
        recompute.check(checkpoint, checkpoint_split)
        tiled.check(tiled_mlp, mlp_chunk)
        model_loss.check(loss)
        self.args = args
        self.loss_name = loss
        # checkpoint="auto": per-layer policies planned from this budget (bytes; None: the device's
        # default) when the local token count is first seen (recompute.plan_layers)
        self.auto_checkpoint = checkpoint == recompute.AUTO
        self.activation_budget = activation_budget
        # host bytes the host layers of an auto plan may keep (0, the default: no layer is
        # offloaded; None: the host's default, recompute.default_host_budget), and which host
        # policies it may plan (recompute.HOST)
        self.offload_budget = offload_budget
        self.host_policies = tuple(host_policies)
        # the MLP run a chunk of tokens at a time (model/tiled.py): "on", "off", or "auto" (with
        # checkpoint="auto": where the plan with it recomputes less than the plan without)
        self.tiled_mlp, self.mlp_chunk = tiled_mlp, mlp_chunk
        self.states_on_host = False  # FSDP2's CPU offload keeps parameters, gradients and optimizer states there
        # this rank's parameter and optimizer-state bytes, counted once while FSDP2 keeps its shards
        # (train/parallel.py): counted in a forward, the root's unsharded parameters (embedding, LM
        # head) weighed whole, ~4 GiB too much at 8B over 4 ranks, and the plan recomputed more
        self.state_nbytes: int | None = None
        self.offloader = None  # made at the first forward with an "offload" layer
        self._planned_for = None
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, "full" if self.auto_checkpoint else checkpoint, checkpoint_split, i)
                                    for i in range(args.n_layers))
        for b in self.layers:
            b.mlp_chunk = mlp_chunk if tiled_mlp == "on" else 0
        self.norm = RMSNorm(args.dim, args.norm_eps, args.norm_plus_one)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.cp = ContextParallel()
        self.tp = None  # a sliced model's Split (model/tensor_parallel.py): this rank's share of the projections

    def set_context_parallel(self, cp: ContextParallel) -> None:
        self.cp = cp
        for b in self.layers:
            b.cp = cp

    @property
    def head_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, cu_seqlens=None, hooks: Hooks | None = None,
               rows=None, tables=None) -> torch.Tensor:
        """Final-norm hidden states (B, n, dim) of this rank's tokens (B, n) at global
        ``positions`` (n,): the one decoder loop.  ``cu_seqlens``: packed documents, the GLOBAL
        boundaries 0 = c_0 < ... < c_m = global length (the same on every CP rank; positions then
        restart per document, as the batch provides them); attention never crosses a boundary.

        ``hooks``: what this run does besides training's forward (:class:`~.layers.Hooks`).
        ``rows``: (batch index, token index) tensors of the rows wanted: only those are normed and
        returned, (R, dim) (prefill's next-token rows; a rank that holds none of them still runs
        every layer, which the ring needs).  ``tables``: RoPE's (cos, sin) for ``positions``, one
        pair per RoPE of the model (:meth:`ropes`), made by the caller (a decode step keeps its
        frequencies in device buffers); with them the loop reads no host value of the run, as a
        CUDA graph's capture needs."""
        docs = _docs(cu_seqlens)
        h = self.tok_embeddings(tokens)
        if self.args.embed_scale:
            h = h * embed_scale(self.args.dim, h.dtype)
        if self.auto_checkpoint and self._planned_for != (h.shape[:2], docs is not None):
            self.plan_checkpointing(h.shape[0] * h.shape[1], h.element_size(), h.device, sparse=docs is not None)
            self._planned_for = (h.shape[:2], docs is not None)
        if tables is None:
            tables = self.ropes(positions, acc_dtype(h), self._global_length(tokens.shape[1], docs))
        off = self._offloader(h.device)
        swap = hooks.block if hooks is not None else None
        with self._hooked(hooks):
            for b in self.layers:
                below = off.newest() if off else None  # an offloaded layer below: copy it back from this one's backward
                h = (swap(b) if swap else b)(h, *tables[b.rope_index], docs)
                if below is not None:
                    off.follow(below, h)
        if rows is not None:
            h = h[rows]
            if not h.numel():
                return h
        return self.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head on final-norm hidden states (..., dim), in their dtype: for the few rows
        a caller wants (prefill's next tokens, a decode step's, training's predictions); the
        training loss never makes them (:mod:`burstengine.loss.model_loss`)."""
        return linear(h, self.head_weight.to(h.dtype))

    def _global_length(self, n: int, docs) -> int:
        """The global sequence length (what dynamic RoPE scaling reads): the longest packed
        document, else this rank's ``n`` tokens times the ring's ranks (the same on every rank)."""
        if docs is not None:
            return max(e - s for s, e in zip(docs[:-1], docs[1:]))
        return n * (1 if self.cp.local else world_of(self.cp.group))

    @contextmanager
    def _hooked(self, hooks: Hooks | None):
        """Every layer runs with ``hooks`` for the length of the block (a recomputation in
        backward runs after it, without them: training passes none)."""
        if hooks is None:
            yield
            return
        for b in self.layers:
            b.hooks = hooks
        try:
            yield
        finally:
            for b in self.layers:
                b.hooks = NO_HOOKS

    def _offloader(self, device):
        """The Offloader of this model's "offload" layers (one side stream and its host buffers), or None."""
        if not any(b.policy in recompute.HOST for b in self.layers):
            return None
        if self.offloader is None:
            self.offloader = offload.Offloader(device)
        for b in self.layers:
            b.offloader = self.offloader
        return self.offloader

    def rope(self, positions: torch.Tensor, dtype: torch.dtype, seq_len: int = 0):
        """cos, sin (n, head_dim) in ``dtype`` for global ``positions`` (n,) under the model's RoPE
        settings; ``seq_len``: the global sequence length (only dynamic and longrope scaling read it)."""
        a = self.args
        return tuple(t.to(dtype) for t in rope_tables(positions, a.head_dim, a.rope_theta, a.rope_scaling,
                                                      a.max_position_embeddings, seq_len))

    def ropes(self, positions: torch.Tensor, dtype: torch.dtype, seq_len: int = 0) -> tuple:
        """One (cos, sin) per RoPE of the model, indexed by the layers' ``rope_index``: the global
        one (:meth:`rope`), then the sliding layers' when they have their own base
        (``local_rope_theta``, unscaled)."""
        out = (self.rope(positions, dtype, seq_len),)
        if self.args.local_rope_theta:
            out += (tuple(t.to(dtype) for t in rope_tables(positions, self.args.head_dim, self.args.local_rope_theta)),)
        return out

    def forward(self, tokens, positions, labels=None, ignore_index: int = -100, predict: bool = False,
                cu_seqlens=None):
        """With ``labels`` (B, n): the float32 *sum* of the losses of this rank's labelled tokens
        (the caller divides by the global count).  With ``predict`` too: the argmax prediction
        (B, n) at labelled positions, ``ignore_index`` elsewhere.  Without labels: the hidden
        states.  The LM head runs here, inside the root module, so a sharded head weight is
        gathered for it.  ``cu_seqlens``: see :meth:`hidden`."""
        h = self.hidden(tokens, positions, cu_seqlens)
        if labels is None:
            return h
        if predict:
            keep = labels != ignore_index
            preds = torch.full_like(labels, ignore_index)
            preds[keep] = self.logits(h[keep]).argmax(-1)
            return preds
        return model_loss.LOSSES[self.loss_name](h.flatten(0, 1), self.head_weight, labels.flatten(), ignore_index)

    def plan_checkpointing(self, tokens: int, elem: int, device, sparse: bool = False) -> list[str]:
        """Set each layer's policy for ``tokens`` local tokens of ``elem``-byte activations from
        the activation budget (checkpoint="auto"), and the tiled MLP on or off (tiled_mlp="auto":
        the plan that recomputes less, its MLP forwards counted (:func:`.recompute.plan_cost`),
        untiled on a tie); returns the plan.  ``sparse`` (packed
        documents, or a model with a sliding window): the layers that keep their attention output
        use ``selective``, since sequence-level checkpointing's ring takes no sparse mask; so do
        layers that draw random numbers (LoRA dropout), which it does not replay, and these plan
        no ``pointwise`` or ``offload`` layers."""
        budget = self.activation_budget
        if budget is None:
            budget = recompute.default_budget(self.state_bytes(), device)
        host = self.offload_budget
        if host is None:
            host = recompute.default_host_budget(device)
        random = any(b.random for b in self.layers)
        allowed = [p for p in recompute.LADDER
                   if (p not in recompute.HOST or p in self.host_policies)
                   and not (random and p in ("pointwise", "offload"))]
        best = None
        for on in ((False, True) if self.tiled_mlp == "auto" else (self.tiled_mlp == "on",)):
            per_layer, transient, host_per_layer = self.activation_model(tokens, elem, on, sparse)
            plan = (["none"] * len(self.layers) if budget is None
                    else recompute.plan_layers(len(self.layers), per_layer, budget, transient, host_per_layer,
                                                   host, allowed))
            if best is None or recompute.plan_cost(plan, on) < recompute.plan_cost(*best):
                best = (plan, on)
        plan, on = best
        if self._no_ring(sparse):
            plan = ["selective" if p == "sequence" else p for p in plan]
        for b, p in zip(self.layers, plan):
            b.policy = p
            b.mlp_chunk = self.mlp_chunk if on else 0
            if p == "sequence":
                b.checkpoint_split = 1.0
        self.checkpoint_plan = plan
        return plan

    def state_bytes(self) -> int:
        """Device bytes of this rank's parameters and what training keeps for them (the count made
        while sharded, :attr:`state_nbytes`, where the trainer made one)."""
        if self.state_nbytes is not None:
            return self.state_nbytes
        return recompute.state_bytes(self.parameters(), self.states_on_host)

    def _no_ring(self, sparse: bool) -> bool:
        return bool(sparse or self.args.window or self.cp.sharded_outside or any(b.random for b in self.layers))

    def activation_model(self, tokens: int, elem: int, tiled_mlp: bool, sparse: bool = False):
        """(kept device bytes per layer, transient bytes, host bytes per layer), each by policy,
        for ``tokens`` local tokens of ``elem``-byte activations (:mod:`.recompute`'s counts)."""
        a = self.args
        per_token = recompute.activation_bytes(a, elem, tiled_mlp)
        transient = recompute.transient_bytes(a, elem, tiled_mlp)
        # "selective" keeps the roped q, k, v as well; it runs where "sequence" cannot
        per_token["selective"] = per_token["sequence"] + (a.n_heads + 2 * a.n_kv_heads) * a.head_dim * elem
        transient["selective"] = transient["sequence"]
        if self._no_ring(sparse):
            per_token["sequence"] = per_token["selective"]
        chunk = tiled.chunk_bytes(a, elem, min(self.mlp_chunk, tokens)) if tiled_mlp else 0
        head = recompute.head_bytes(a, elem) * tokens  # the backward's start: the loss's part
        return ({k: v * tokens for k, v in per_token.items()},
                {k: max(v * tokens + chunk, head) for k, v in transient.items()},
                {k: v * tokens for k, v in recompute.host_bytes(a, elem, tiled_mlp).items()})

    def memory_needs(self, tokens: int, elem: int, device, sparse: bool = False) -> dict:
        """What a training step of ``tokens`` local tokens needs under the layers' policies (plan
        them first with checkpoint="auto"), in bytes, from :mod:`.recompute`'s counts: the
        parameters and their training states on the device, the fixed workspace, the layers' kept
        activations, the transient of the backward, the host memory of host layers, and the device
        memory a plan may fill (None where unknown: CPU)."""
        plan = [b.policy for b in self.layers]
        per_layer, transient, host_per_layer = self.activation_model(tokens, elem, bool(self.layers[0].mlp_chunk),
                                                                     sparse)
        kept = sum(per_layer[p] for p in plan if p not in recompute.HOST)
        return {"tokens": tokens, "plan": {p: plan.count(p) for p in dict.fromkeys(plan)},
                "tiled_mlp": bool(self.layers[0].mlp_chunk),
                "state": self.state_bytes(),
                "workspace": recompute.WORKSPACE, "activations": kept,
                "transient": recompute.plan_bytes(plan, per_layer, transient) - kept,
                "host": sum(host_per_layer[p] for p in plan if p in recompute.HOST),
                "usable": recompute.usable_bytes(device) if getattr(device, "type", device) == "cuda"
                and torch.cuda.is_available() else None}

    # --- initialisation -----------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, seed: int = 0, only=None) -> None:
        """Deterministic initialisation that does not depend on how parameters are sharded:
        each full parameter is drawn from a generator seeded by (seed, its name), on the
        parameter's device, and this rank keeps its shard.  Linear and embedding weights
        ~ N(0, 0.02); output projections of attention and MLP scaled by 1/sqrt(2 n_layers); norms
        scale by 1 (a weight of 0 under ``norm_plus_one``); LoRA adapters as PEFT starts them: A
        kaiming-uniform (U(+-1/sqrt(fan_in))), B zero.  ``only(name)``: initialise only the
        parameters it accepts."""
        from torch.distributed.tensor import DTensor, distribute_tensor  # only for DTensor (FSDP-sharded) weights

        for name, p in self.named_parameters():
            if only is not None and not only(name):
                continue
            local = p.to_local() if isinstance(p, DTensor) else p
            dev = local.device
            # a sliced model (tensor parallelism) draws the whole parameter and keeps its slice
            cut = self.tp.cut(name, self.args) if self.tp is not None else None
            shape = p.shape if cut is None else self.tp.full_shape(name, p.shape, self.args)
            if name.endswith("norm.weight"):
                full = torch.full(shape, 0.0 if self.args.norm_plus_one else 1.0, device=dev, dtype=torch.float32)
            elif name.endswith(".bias") or name.endswith(".lora_B.weight"):
                full = torch.zeros(shape, device=dev, dtype=torch.float32)
            else:
                std = 0.02
                if name.endswith("wo.weight") or name.endswith("w2.weight"):
                    std /= math.sqrt(2 * self.args.n_layers)
                g = torch.Generator(device=dev)
                g.manual_seed(_param_seed(seed, name))
                full = torch.empty(shape, device=dev, dtype=torch.float32)
                if name.endswith(".lora_A.weight"):  # kaiming_uniform_(a=sqrt(5)), nn.Linear's and PEFT's
                    bound = 1.0 / math.sqrt(shape[1])
                    full.uniform_(-bound, bound, generator=g)
                else:
                    full.normal_(0.0, std, generator=g)
            if cut is not None:
                full = full.narrow(cut.dim, cut.start, cut.size)
            if isinstance(p, DTensor):
                full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
            local.copy_(full.to(local.dtype))


def _docs(cu_seqlens) -> tuple | None:
    """Global document boundaries as a tuple of ints (one host read of a tensor), or None."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        return tuple(int(c) for c in cu_seqlens.tolist())
    return tuple(int(c) for c in cu_seqlens)


@functools.lru_cache(maxsize=None)
def embed_scale(dim: int, dtype: torch.dtype) -> float:
    """sqrt(dim) rounded to ``dtype``, the embeddings' (Gemma's scale: a tensor of the weights'
    dtype, so 55.4256 becomes 55.5 in bfloat16); a host value, computed once per dtype."""
    return torch.tensor(dim ** 0.5, dtype=dtype, device="cpu").item()


def _param_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)
