"""Generation: a sharded prefill of the prompts, then decoding against the sharded KV cache.

:func:`generate` runs on every rank of a context-parallel group (or alone, without one) with
the same arguments and returns the same tokens on every rank.

Prompts of any length and batches of prompts of different lengths: the batch is padded at the
end to the shortest length the layout can shard, and each sequence's pad tokens sit after its
last real token, so under the causal mask no real token sees one; the cache drops the slots
that are padding for every sequence and hides the rest from the sequence they pad
(:mod:`.kvcache`).  The first new token of a sequence comes from its last real token's logits,
the i-th next from the token at position ``length + i`` of that sequence: every sequence gets
the tokens it would get alone.

Each decode step runs the token-wise parts of the model (embedding, norms, projections, RoPE,
MLP, LM head) for the step's B tokens on every rank: whole and identically, or (tensor
parallelism, by default where the model's shapes divide over the ranks) each rank its slices of
the projections and of the LM head (:mod:`burstengine.model.tensor_parallel`), so a step reads
1/W of the weights on each of W ranks.  Attention is sharded either way: each rank attends to
its own slots and one all-gather per layer merges the partials exactly.  The step's K/V are
written on one rank (the shortest shard).  Rank 0 chooses the tokens and broadcasts them (B
ints), so every rank continues with the same tokens.  Greedy tokens are chosen, broadcast and fed
to the next step on the device; the host reads them a step late, while the GPU runs the step
they feed (the host is out of the loop: nothing waits for it between steps).  Sampling draws
on the host (float64, a seeded CPU generator), so each sampled step waits for its logits.

The step has static shapes and reads its per-step state from device tensors (:mod:`.step`), so
with ``graphs`` on (by default on CUDA, any number of ranks) it is captured once in a CUDA graph
and replayed, its collectives included; on every rank or on none (a capture that fails on one
rank runs the step op by op on all).  Sampling runs on the step's logits either way, so the
tokens are the same.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..comm.dist import rank_of, world_of
from ..layout import position_ids as layout_positions
from .engine import padded_length, prefill
from .kvcache import ShardedKVCache, appends, kv_dtype_error, next_owner
from .models import OurLlama, PrefillModel
from .sampling import Sampling, choose
from .step import DecodeStep, _first_line, use_graphs, use_tensor_parallel


@dataclass
class GenerateOutput:
    tokens: list[list[int]]      # per prompt, the new tokens (ending at a stop token when one came)
    timings: dict                # seconds: prefill (first-token latency), per decode step, total
    shard_lengths: list[list[int]] = field(default_factory=list)  # every rank's cache slots after prefill, each step


# the profiler range around each decode step's launch (bench decode --profile)
STEP_LABEL = "burstengine.decode_step"

def _as_lists(prompts) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            prompts = prompts[None]
        if prompts.dim() != 2:
            raise ValueError(f"prompts must be a (batch, seq) tensor or a list of token lists, got shape "
                             f"{tuple(prompts.shape)}")
        return [[int(t) for t in row] for row in prompts.tolist()]
    try:
        out = [[int(t) for t in (p.tolist() if isinstance(p, torch.Tensor) else p)] for p in prompts]
    except (TypeError, ValueError) as e:
        raise ValueError(f"prompts must be token id lists (or a (batch, seq) tensor): {e}") from None
    return out


def check_generate(prompts: list[list[int]], vocab: int, max_new_tokens: int, sampling: Sampling) -> str | None:
    """A message for a generation that cannot run, else None (checked on every rank before any
    collective; every rank passes the same arguments)."""
    if not prompts:
        return "no prompts"
    for i, p in enumerate(prompts):
        if not p:
            return f"prompt {i} is empty: a prompt needs at least one token"
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= vocab:
            return f"prompt {i} has token id {lo if lo < 0 else hi}, outside the model's vocabulary [0, {vocab})"
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        return f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}"
    return sampling.check(vocab)


@torch.no_grad()
def generate(model: PrefillModel, prompts, max_new_tokens: int, sampling: Sampling | None = None, *, group=None,
             layout: str = "zigzag", attention: str = "burst", kernel: str | None = None,
             chunk: int | None = None, graphs: str = "auto", tensor_parallel="auto", kv_dtype: str | None = None,
             on_tokens=None, on_logits=None) -> GenerateOutput:
    """New tokens for each prompt (a list of token id lists, or a (batch, seq) tensor).

    ``sampling``: greedy by default (:class:`~.sampling.Sampling`).  ``group``: the
    context-parallel group (None: the default group when one is initialised, else this process
    alone).  ``attention="sdpa"`` runs the prefill's attention as plain SDPA (one rank; the
    benchmark's peer).  ``chunk``: token rows per piece of the prefill's token-wise work (None:
    the default for the shard's length; 0: whole).  ``graphs``: capture the decode step in a CUDA
    graph and replay it (``"auto"``: on CUDA; ``"on"``: the same, an error elsewhere; ``"off"``:
    launch its kernels each step).  ``tensor_parallel``: the decode step runs the model's slices
    over the group (``"auto"``: where its shapes divide over more than one rank; ``True``: an
    error where they do not; ``False``: the whole model on every rank): :func:`.step.use_tensor_parallel`.
    ``kv_dtype``: None keeps the cache in the model's dtype; ``"fp8"`` in float8_e4m3fn with a scale
    per slot and kv head (:mod:`.kvcache`: about half the bytes a long-context step reads).
    ``on_tokens(step, tokens (B,) list, done (B,) list)`` is called on every rank after each
    step's tokens are known (streaming); ``on_logits(step, logits)`` on rank 0 with the (B,
    vocab) float32 logits (float64 for a float64 model) each step's tokens are chosen from (step
    0: the prefill's), on the device, just before that step's on_tokens (never for a step dropped
    unseen); the tensor may be the step's own buffer (a CUDA graph's output), so copy what you keep."""
    sampling = sampling or Sampling()
    if not isinstance(model, OurLlama):
        raise ValueError("generate runs burstengine's LLaMA (impl 'ours'); this model is a transformers one")
    rank, world = rank_of(group), world_of(group)
    prompts = _as_lists(prompts)
    msg = check_generate(prompts, model.vocab_size, max_new_tokens, sampling)
    if msg:
        raise ValueError(msg)
    msg = kv_dtype_error(kv_dtype, model.device)
    if msg:
        raise ValueError(msg)
    if attention == "sdpa" and world > 1:
        raise ValueError("attention 'sdpa' is plain SDPA on one rank; run it with world 1")
    a = model.model.args
    dev = model.device
    graphed = use_graphs(graphs, dev)  # a ValueError here is the same on every rank
    sliced = use_tensor_parallel(tensor_parallel, model, world)
    B = len(prompts)
    L = [len(p) for p in prompts]
    ids = torch.zeros(B, max(L), dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p)
    sync = _sync_fn(dev)
    t_start = time.perf_counter()

    # --- prefill: this rank's shard, every layer's K/V into the cache ----------------------------
    S = padded_length(max(L), layout, world)
    pos = layout_positions(S, layout, rank, world)                     # (n,) global positions, host
    kept = [int((layout_positions(S, layout, r, world) < max(L)).sum()) for r in range(world)]
    keep = torch.nonzero(pos < max(L)).flatten()
    cap = kept[rank] + appends(kept, max_new_tokens - 1)[rank]
    cache = ShardedKVCache(a.n_layers, B, a.n_kv_heads, a.head_dim, cap, kept, rank, model.dtype, dev, kv_dtype)
    lens = torch.tensor(L)
    slot_pos = pos[keep]
    visible = slot_pos[None, :] < lens[:, None]                        # (B, kept): a real token of b
    cache.set_slots(slot_pos[None].expand(B, -1).to(dev), visible.to(dev), bool(visible.all()))
    keep_dev = None if len(keep) == len(pos) else keep.to(dev)
    logits = prefill(model, ids, group=group, layout=layout, kernel=kernel, attention=attention, lengths=L,
                     kv_sink=lambda i, k, v: cache.fill(i, k, v, keep_dev), chunk=chunk).logits
    gen = sampling.generator()
    if on_logits and rank == 0:
        on_logits(0, logits)
    tok = _choose(logits, B, sampling, gen, rank, world, group, dev)
    sync()
    t_prefill = time.perf_counter() - t_start

    # --- decode ------------------------------------------------------------------------------
    eos = set(sampling.eos)
    out = [[t] for t in tok.tolist()]
    done = [t in eos for t in tok.tolist()]
    history = [list(cache.lengths)]
    if on_tokens:
        on_tokens(0, tok.tolist(), list(done))
    step = DecodeStep(model, cache, B, group, rank, tensor_parallel=sliced)
    step_s, capture_s = [], 0.0
    # greedy decoding keeps the host out of the loop: a step's tokens are chosen and broadcast on
    # the device and fed to the next step there; the host reads them one step late, while the GPU
    # runs the step they feed, so the GPU never waits for the host (a step in flight when every
    # sequence has stopped is dropped unseen).  Sampling draws on the host: its step waits.
    reader = _TokenReader(B, dev) if sampling.greedy else None
    fed = tok                                  # the tokens the next step feeds (host, or the device's)
    t_last = time.perf_counter()               # when the last step's tokens reached the host

    def accept(i, new, lengths, seen=None):
        nonlocal t_last
        if all(done):  # a step launched before the host saw that every sequence had stopped
            return
        if seen is not None:  # its logits too are seen only when its tokens are
            on_logits(i, seen)
        for b, t in enumerate(new):
            if not done[b]:
                out[b].append(t)
                done[b] = t in eos
        history.append(lengths)
        now = time.perf_counter()
        step_s.append(now - t_last)
        t_last = now
        if on_tokens:
            on_tokens(i, list(new), list(done))

    pending = None  # (step, its tokens' read, the shard lengths after it): read one step late
    for i in range(1, max_new_tokens):
        if all(done):
            break
        owner = next_owner(cache.lengths)
        step.load(fed, [L[b] + i - 1 for b in range(B)], owner)  # the token we feed, at its position
        if graphed and step.graph is None:  # the first step: capture it (not counted as a step's time)
            t0 = time.perf_counter()
            graphed = _capture(step, graphs, world, group, dev)
            sync()
            capture_s = time.perf_counter() - t0
            t_last += capture_s
        with torch.profiler.record_function(STEP_LABEL):  # what bench decode --profile reads
            logits = step.launch()
        # on_logits waits with the step's tokens (a dropped step's are not seen); greedy's wait a
        # step, past the next launch, which overwrites a graph's output buffer: they wait as a copy
        seen = None
        if on_logits and rank == 0:
            seen = logits if reader is None else logits.clone()
        cache.advance(owner)
        if reader is None:
            fed = _choose(logits, B, sampling, gen, rank, world, group, dev)
            sync()
            accept(i, fed.tolist(), list(cache.lengths), seen)
            continue
        fed = _choose_on_device(logits, B, rank, world, group, dev)
        read = reader.start(fed)
        if pending is not None:
            accept(pending[0], pending[1].tokens(), *pending[2:])
        pending = (i, read, list(cache.lengths), seen)
    if pending is not None:
        accept(pending[0], pending[1].tokens(), *pending[2:])
    del step  # the graph and its memory pool go now, before the cache they point into
    timings = dict(prefill_s=t_prefill, decode_step_s=step_s, total_s=time.perf_counter() - t_start,
                   prompt_lengths=L, padded_length=S, world=world, graphs=graphed, graph_capture_s=capture_s,
                   tensor_parallel=sliced, kv_dtype=kv_dtype)
    return GenerateOutput(tokens=out, timings=timings, shard_lengths=history)


def _capture(step: DecodeStep, graphs: str, world: int, group, dev, tries: int = 2) -> bool:
    """Capture the step's CUDA graph on every rank or on none (a graph with collectives is replayed
    by all ranks together): whether it was.  A capture that fails on any rank is tried again on
    every rank (the cause seen on GPUs, an error during capture that was not this thread's, came
    and went between runs); a failure of every try under "auto" warns once and the step runs op
    by op; under "on" it raises, on every rank.  Either names the first try's cause (a later
    try's failure may be its consequence) and, where it differs, the last's."""
    failures = []  # this rank's message for each try that failed on some rank
    for attempt in range(tries):
        err = None
        try:
            step.capture(strict=attempt > 0)  # a retry says what a recompile inside it would have hidden
        except Exception as e:  # of any kind: a rank that left here alone would hang the others' all_reduce
            err = _first_line(e)
            if not (isinstance(e, RuntimeError) and err):  # step.capture's own say which rank and why
                err = f"capturing the decode step in a CUDA graph failed on rank {step.rank}: {type(e).__name__}: {err}"
        failed = [err is not None]
        if world > 1:  # one host read per try: which ranks failed
            flags = torch.zeros(world, device=dev)
            flags[step.rank] = float(err is not None)
            dist.all_reduce(flags, group=group)
            failed = [bool(f) for f in flags.tolist()]
        if not any(failed):
            break
        step.graph = step.logits = None  # ranks whose capture worked drop it: all try again together
        failures.append(err or "capturing the decode step in a CUDA graph failed on rank(s) "
                        + ", ".join(str(r) for r, f in enumerate(failed) if f))
    else:
        why = failures[0] if failures[-1] == failures[0] else f"{failures[0]}; on try {tries}: {failures[-1]}"
        if graphs == "on":
            raise RuntimeError(why)
        # "auto" asked for speed, not for the graph: the same step, op by op, says why once
        warnings.warn(f"decode: {why}; decoding op by op (graphs='on' makes this an error)", RuntimeWarning,
                      stacklevel=3)
        return False
    if failures:
        warnings.warn(f"decode: {failures[0]}; captured on try {len(failures) + 1}", RuntimeWarning, stacklevel=3)
    return True


def _choose(logits, B, sampling, gen, rank, world, group, dev):
    """Rank 0 chooses (B,) tokens from its logits and every rank gets them (CPU int64)."""
    if rank == 0:
        tok = choose(logits, sampling, gen)
        if world == 1:
            return tok
        buf = tok.to(dev)
    else:
        buf = torch.empty(B, dtype=torch.int64, device=dev)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(buf, src=src, group=group)
    return buf.cpu()


def _choose_on_device(logits, B, rank, world, group, dev) -> torch.Tensor:
    """Greedy: rank 0's (B,) highest-logit tokens, on the device of every rank; no host read."""
    if rank == 0:
        buf = logits.detach().argmax(-1)
    else:
        buf = torch.empty(B, dtype=torch.int64, device=dev)
    if world > 1:
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast(buf, src=src, group=group)
    return buf


class _TokenReader:
    """Copies of a step's (B,) device tokens to the host, in stream order and without waiting:
    two pinned buffers, used in turn (a buffer is read before the step after next refills it)."""

    def __init__(self, B: int, dev):
        cuda = dev.type == "cuda"
        self.bufs = [torch.empty(B, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.turn = 0

    def start(self, tokens: torch.Tensor) -> "_Read":
        k, self.turn = self.turn, 1 - self.turn
        self.bufs[k].copy_(tokens, non_blocking=self.events[k] is not None)
        if self.events[k] is not None:  # on the stream the copy ran on: the tokens' device may not be the current one
            self.events[k].record(torch.cuda.current_stream(tokens.device))
        return _Read(self.bufs[k], self.events[k])


class _Read:
    def __init__(self, buf, event):
        self.buf, self.event = buf, event

    def tokens(self) -> list[int]:
        """The step's tokens, once the GPU has run it (the only wait in the greedy loop)."""
        if self.event is not None:
            self.event.synchronize()
        return self.buf.tolist()


def _sync_fn(dev):
    if dev.type == "cuda":
        return lambda: torch.cuda.synchronize(dev)
    return lambda: None
