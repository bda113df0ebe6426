"""One decode step of a fixed batch, with static shapes: launched op by op, or replayed from a
CUDA graph.

Every value the step's kernels read that changes from one step to the next lives in a device
tensor that the host updates in place before the launch: the tokens fed (B,), their positions
(B,), the number of valid cache slots per sequence (B,) and the slot this rank writes (its next
free one when it owns the step's token, else the cache's scratch slot, which no query sees).
They are one int64 buffer, filled from pinned host memory by one copy per step.  Inside the
step the K/V append is an ``index_copy_`` at that device index, and attention reads the valid
counts, visibility and positions on the device (kernels/triton/decode.py on CUDA), so no
host value is baked into a kernel, and the step never reads a device value on the host (no
``.item()``, no ``int(tensor)``): it is a fixed sequence of kernels on fixed buffers.

CUDA graphs.  :meth:`DecodeStep.capture` follows torch's recipe: a few warm-up runs on a side
stream (they compile the fused element-wise kernels and the Triton kernels for these shapes and
let cuBLAS settle), then one capture into a graph with its own memory pool; each step then
costs one ``replay()``.  The cache is allocated before the capture and never moves.  The
warm-up runs are the first step itself, which is idempotent (the same K/V into the same slot,
the same logits from the same state), so running it more than once changes nothing.  A capture
that fails raises, naming the cause; nothing falls back silently.

With more than one rank the graph holds the step's NCCL collectives too (the all-gather merge of
:func:`.kvcache.merged_heads`, and tensor parallelism's): NCCL captures a collective once its
communicator exists and has run it, which the prefill and the warm-up runs see to, and a graph
with collectives must be replayed by every rank of the group in lockstep, as generation's loop
does (every rank captures at the same step and replays once per step).  On CPU (gloo) the same
step runs op by op.

Tensor parallelism (``tensor_parallel=True``, :mod:`burstengine.model.tensor_parallel`): the step
runs the model's slices over the group that holds the cache, each layer's q, k and v gathered to
all heads before attention and the partial sums after wo and w2 all-reduced; the new token's K/V
are written from the gathered heads, and the logits gathered from the vocabulary slices.

Sampling stays outside the step, on its logits, exactly as before (sampling.py).  Dynamic and
LongRoPE scaling's frequencies depend on the length (the step's position + 1, as transformers
reads it with a cache; keys cached before LongRoPE switches keep their short factors): they sit
in a device buffer, recomputed before each step (outside any graph); every other RoPE type
computes them once.  A model whose sliding layers have a RoPE of their own (Gemma 3) keeps those
frequencies in a second buffer; each layer's window is a host constant of the step, as is the
attention scale.
"""
from __future__ import annotations

import math

import torch

from ..kernels import acc_dtype
from ..model import Hooks, tensor_parallel
from ..model.rope import inv_freq, tables_from_inv
from .kvcache import ShardedKVCache, merged_heads
from .models import OurLlama

MODES = ("auto", "on", "off")


def use_graphs(mode: str, device: torch.device) -> bool:
    """Whether generation captures its decode step in a CUDA graph: ``"auto"`` on CUDA (any
    number of ranks), ``"on"`` (an error where it cannot), ``"off"``."""
    if mode not in MODES:
        raise ValueError(f"graphs must be one of {MODES}, got {mode!r}")
    if mode == "off":
        return False
    kind = torch.device(device).type
    if mode == "on" and kind != "cuda":
        raise ValueError(f"graphs='on' needs a CUDA device: the model is on {kind}; use graphs='auto' or 'off'")
    return kind == "cuda"


def use_tensor_parallel(mode, model: OurLlama, world: int) -> bool:
    """Whether the decode step runs the model's tensor-parallel slices over the ``world`` ranks
    that hold the cache: ``"auto"`` with more than one rank when the model's heads, kv heads, ffn
    width and vocabulary divide over them (always for a model that holds only its slices),
    ``True`` the same (an error where they do not divide), ``False`` every rank runs the whole
    model (an error for a model that holds only its slices)."""
    if not (mode is True or mode is False or mode == "auto"):
        raise ValueError(f"tensor_parallel must be True, False or 'auto', got {mode!r}")
    if model.sliced:
        if mode is False and world > 1:
            raise ValueError("tensor_parallel=False runs the whole model on every rank, and this one holds only its "
                             "tensor-parallel slices (load it without tp_group)")
        return world > 1
    if world == 1 or mode is False:
        return False
    why = tensor_parallel.refuses(model.model.args, world)
    if mode is True and why:
        raise ValueError(f"tensor_parallel=True: {why}")
    return why is None


class DecodeStep:
    """The decode step of ``batch`` sequences against ``cache`` (this rank's shard).
    ``step(tokens (B,) CPU int64, positions list of B ints, owner rank)`` returns the (B, vocab)
    float32 logits (float64 for a float64 model) on rank 0 (None elsewhere); with a captured graph
    they are the graph's output buffer, overwritten by the next step.  ``tensor_parallel``: run
    the model's slices over ``group`` (:func:`use_tensor_parallel`)."""

    def __init__(self, model: OurLlama, cache: ShardedKVCache, batch: int, group=None, rank: int = 0,
                 tensor_parallel: bool = False):
        self.model, self.cache, self.group, self.rank = model, cache, group, rank
        # the Transformer the step runs: the model, or its slices over the group (tensor parallelism)
        self.decoder = model.decoder(group) if tensor_parallel else model.model
        self.split = self.decoder.tp if tensor_parallel else None
        # one sequence's q and k reach the tensor-parallel gather raw, normed and roped as it unpacks
        # them (Hooks.raw_qkv).  A batch's are roped by the layer: on 2 x H200 at 713227f, with raw
        # q/k for batches too, a batch's graph capture failed (the batch-2 warm-up's or batch 8's:
        # the log cannot tell; cause not known), so batches keep the path the earlier checks ran
        self.raw_qkv = tensor_parallel and batch == 1
        a = model.model.args
        self.args = a
        self.B = batch
        self.device = torch.device(model.device)
        self.acc = acc_dtype(torch.empty((), dtype=model.dtype))
        self.scale = a.softmax_scale or 1.0 / math.sqrt(a.head_dim)
        self.windows = [a.layer_window(i) or None for i in range(a.n_layers)]
        cuda = self.device.type == "cuda"
        B = batch
        self.state = torch.zeros(3 * B + 1, dtype=torch.int64, device=self.device)
        self.host = torch.zeros(3 * B + 1, dtype=torch.int64, pin_memory=cuda)
        self.tok, self.qpos = self.state[:B], self.state[B:2 * B]
        self.valid, self.slot = self.state[2 * B:3 * B], self.state[3 * B:]
        self.follows_length = a.rope_scaling.follows_length
        self.inv, self.rope_attn = self._inv(0)
        # the sliding layers' own RoPE (unscaled: never recomputed), the model's second table
        self.local_inv = inv_freq(a.head_dim, a.local_rope_theta, device=self.device)[0] if a.local_rope_theta \
            else None
        self._copied = torch.cuda.Event() if cuda else None
        self.graph = None
        self._tables = None  # the step's RoPE tables while forward runs (the tensor-parallel gather ropes q, k)
        self.logits = None

    def _inv(self, seq_len: int):
        a = self.args
        return inv_freq(a.head_dim, a.rope_theta, a.rope_scaling, a.max_position_embeddings, seq_len,
                        device=self.device)

    def load(self, tokens: torch.Tensor, positions: list[int], owner: int) -> None:
        """The step's state into the device buffers (outside any graph).  ``tokens`` (B,) int64
        on the host, or on the step's device (the last step's choice, which then never visits
        the host: one device copy after the state's, in stream order)."""
        B, c = self.B, self.cache
        on_device = tokens.device.type != "cpu"
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has left the pinned buffer
        h = self.host.numpy()
        h[:B] = 0 if on_device else tokens.numpy()
        h[B:2 * B] = positions
        h[2 * B:3 * B] = c.valid(owner)
        h[3 * B] = c.slot(owner)
        self.state.copy_(self.host, non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
        if on_device:
            self.tok.copy_(tokens)
        if self.follows_length:  # the frequencies follow the length (what the eager rope reads)
            self.inv.copy_(self._inv(max(positions) + 1)[0])

    def forward(self):
        """The step's kernels on the current state: the model's decoder loop on the step's B
        tokens (one sequence of B tokens to the token-wise work) with each layer's attention
        replaced by the cache's: the K/V append at the device slot, attention over the valid
        slots, the merge over ranks; then the LM head (rank 0).  What a graph captures."""
        c = self.cache
        tables = (tuple(t.to(self.acc) for t in tables_from_inv(self.qpos, self.inv, self.rope_attn)),)
        if self.local_inv is not None:
            tables += (tuple(t.to(self.acc) for t in tables_from_inv(self.qpos, self.local_inv)),)
        c.write_slot(self.slot, self.qpos, any(w is not None for w in self.windows))
        # hooks made per call: kept on self, they would tie the step to itself in a cycle, and
        # `del step` would no longer free the graph before the cache it points into
        if self.split is None:
            hooks = Hooks(kv_sink=self._write, attend=self._attend)
        else:  # the K/V are written once gathered to all heads (_attend_sliced)
            hooks = Hooks(attend=self._attend_sliced, reduce=self._reduce, raw_qkv=self.raw_qkv)
        self._tables = tables
        h = self.decoder.hidden(self.tok[None], self.qpos, hooks=hooks, tables=tables)  # (1, B, dim)
        if self.split is not None:  # every rank joins the vocabulary slices' gather
            logits = tensor_parallel.logits(self.decoder, h[0], self.group)
            return logits if self.rank == 0 else None
        if self.rank != 0:
            return None
        return self.model.logits(h[0])

    def _write(self, layer: int, k, v) -> None:
        self.cache.write(layer, self.slot, k[0], v[0])

    def _attend(self, layer: int, q, k, v, heads: tuple[int, int] | None = None):
        """Attention of the step's q (1, B, H, D) over the cache's shards, merged over the ranks:
        heads [lo, hi) of it (all without ``heads``), (1, B, hi - lo, D) in q's dtype."""
        o, lse = self.cache.attend(layer, q[0], self.valid, self.qpos, self.windows[layer], self.scale)
        lo, hi = heads or (0, q.shape[2])
        return merged_heads(o, lse, self.group, lo, hi, q.dtype)[None]

    def _attend_sliced(self, layer: int, q, k, v):
        """Tensor parallelism: this rank's heads of q, k, v -> all heads (raw ones normed and roped
        as they are unpacked: ``raw_qkv``), the new K/V into the cache (on GPUs one kernel does
        both: ``ShardedKVCache.write_heads``), attention over this rank's shard of the cache with
        all of them, the merge of this rank's heads."""
        rope = norms = None
        if self.raw_qkv:
            b = self.decoder.layers[layer]
            rope, norms = self._tables[b.rope_index], (b.attention.q_norm, b.attention.k_norm)
        heads = (q.shape[2], k.shape[2], v.shape[2])
        every = tensor_parallel.gather_qkv(q, k, v, self.split.world, self.group)
        if self.cache.writes_heads(every, q.shape[3], rope):
            q = self.cache.write_heads(layer, every, heads, self.slot, rope, norms)
        else:
            q, k, v = tensor_parallel.unpack_heads(every, heads, rope, norms)
            self._write(layer, k, v)
        return self._attend(layer, q, None, None, tensor_parallel.my_heads(q.shape[2], self.split))

    def _reduce(self, x):
        return tensor_parallel.all_reduce(x, self.group)

    def capture(self, warmup: int = 2, strict: bool = False) -> None:
        """Capture :meth:`forward` on the state loaded now in a CUDA graph (after ``warmup`` runs
        of it on a side stream); later steps :meth:`launch` replay it.  ``strict``: a torch.compile
        recompile inside the capture is an error."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the decode step runs on {self.device}")
        if self.graph is not None:
            raise RuntimeError("the decode step is already captured")
        cur = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(cur)
        try:
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    self.forward()
            cur.wait_stream(side)
        except Exception as e:
            raise RuntimeError(f"the decode step failed in its warm-up before CUDA graph capture on rank {self.rank}: "
                               f"{type(e).__name__}: {_first_line(e)}") from e
        # a pool of our own: its id is what undoing a failed capture needs (_abandon)
        graph, pool, logits, why = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle(), None, None
        try:
            # thread_local: an unsafe call of another thread (torch's NCCL watchdog querying an event
            # of a collective enqueued before the capture, pytorch#104487) must not invalidate this
            # capture; calls of this thread are checked as strictly as in the default mode.
            # strict (a second try): the warm-up compiled every fused op for these shapes; a compile
            # inside the capture (a guard that failed only there) loads kernels mid-capture and may
            # leave only "a previous error during capture" to see: a recompile raises instead,
            # naming the guard
            with torch._dynamo.config.patch(error_on_recompile=strict), \
                    torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                logits = self.forward()
        except Exception as e:
            why = f"{type(e).__name__}: {_first_line(e)}"
        if why is not None:
            _abandon(graph, pool, cur)
            # no chained exception, and nothing of the capture left in this frame: the traceback would
            # keep the failed graph, and the logits allocated in its pool, alive while the step goes on
            # op by op
            graph = logits = self._tables = None
            raise RuntimeError(f"capturing the decode step in a CUDA graph failed on rank {self.rank}: {why} "
                               f"(generate(graphs='off') / --graphs off decodes without a graph)")
        self.graph, self.logits = graph, logits

    def launch(self):
        """Run the step on the loaded state: replay the graph, or launch its kernels."""
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        return self.forward()

    def __call__(self, tokens: torch.Tensor, positions: list[int], owner: int):
        self.load(tokens, positions, owner)
        return self.launch()


# graphs whose failed capture torch < 2.12 left half-undone (_abandon): kept alive
_ABANDONED = []


def _abandon(graph, pool, stream) -> None:
    """Undo what a capture that raised leaves behind, so that the step can run op by op or be
    captured again.  torch.cuda.graph's exit does not restore the stream when capture_end raises
    (an invalidated capture: "operation failed due to a previous error during capture"): ``stream``,
    current before the capture, is made current again.  Before torch 2.12 (pytorch#180395; the
    GPU runs had 2.11) capture_end raises before it stops the caching allocator serving this
    thread's allocations from ``pool``.  Left so, the allocator believes a capture is under way for
    good: empty_cache and an allocation's out-of-memory retry no longer free its cache, memory
    freed after a use on another stream is never reused, the graph's destructor does not release
    the pool, and the allocator's filter points at the destroyed graph.  So that routing is ended
    and the pool released here, and the graph kept alive for any other hook of torch's on it."""
    torch.cuda.set_stream(stream)
    device = torch.cuda.current_device()  # the allocator capture_begin chose
    try:
        torch._C._cuda_endAllocateToPool(device, pool)
    except RuntimeError:  # not routing: capture_end ended it (torch >= 2.12) or the capture never began
        return
    torch._C._cuda_releasePool(device, pool)
    _ABANDONED.append(graph)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]
