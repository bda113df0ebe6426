"""The attention methods users would otherwise pick, on the same SDPA kernels, as callables
``fn(q, k, v) -> out`` on this rank's (B, S/G, H, D) shards.  Each is differentiable.

* torch-native context parallel (torch.distributed.tensor.experimental.context_parallel):
  ring over the SDPA op it patches, head-tail load balancing for causal.
* DeepSpeed-Ulysses: all-to-all from sequence shards to head shards, full-sequence SDPA on
  H/G heads, all-to-all back.
* Megatron-style tensor parallel attention (sequence-parallel variant): the (B, S/G, hidden)
  activations are all-gathered, each rank attends over the whole sequence with H/G heads, and
  the (B, S, hidden) result is reduce-scattered back.  The QKV and output projections are
  left out (no method here times them); their collectives are kept, as Megatron runs them.
  It is a timing peer only (see megatron_tp).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...comm.alltoall import HeadsToSeq, SeqToHeads

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def sdpa(q, k, v, causal, backend):
    # (B, S, H, D) views in, SDPA wants (B, H, S, D)
    with sdpa_kernel(BACKENDS[backend]):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                           enable_gqa=k.shape[2] != q.shape[2])
    return o.transpose(1, 2)


# --- torch-native context parallel -------------------------------------------------------------

@contextlib.contextmanager
def torch_cp_context(group, seq_len: int, device, causal: bool):
    """Enter torch's CP for a global sequence of seq_len; SDPA calls inside run the CP ring.
    Its head-tail load balancer is on for causal (as users run it) and must be off for full
    attention, which it refuses to balance."""
    # torch's experimental CP API: only for these baselines
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options

    world = dist.get_world_size(group)
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type)
    # the buffer only tells CP the global length (for its load balancer); our inputs are
    # already this rank's shards
    dummy = torch.empty(1, 1, seq_len, 1, device=device)
    with context_parallel(mesh, buffers=[dummy], buffer_seq_dims=[2], no_restore_buffers={dummy}):
        assert dummy.shape[2] == seq_len // world
        balance = _cp_options.enable_load_balance
        _cp_options.enable_load_balance = causal
        try:
            yield
        finally:
            _cp_options.enable_load_balance = balance


def torch_cp(backend):
    def fn(q, k, v, causal):
        # torch CP's ring does not take GQA: expand K/V as a user of it must
        if k.shape[2] != q.shape[2]:
            g = q.shape[2] // k.shape[2]
            k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
        with sdpa_kernel(BACKENDS[backend]):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=causal)
        return o.transpose(1, 2)
    return fn


# --- Ulysses ---------------------------------------------------------------------------------

def ulysses(group, backend):
    def fn(q, k, v, causal):
        qh, kh, vh = (SeqToHeads.apply(t, group) for t in (q, k, v))
        return HeadsToSeq.apply(sdpa(qh, kh, vh, causal, backend), group)
    return fn


# --- Megatron-style TP ------------------------------------------------------------------------

class _AllGatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        G = dist.get_world_size(group)
        out = torch.empty((G * x.shape[0],) + x.shape[1:], dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        G = dist.get_world_size(ctx.group)
        out = torch.empty((g.shape[0] // G,) + g.shape[1:], dtype=g.dtype, device=g.device)
        dist.reduce_scatter_tensor(out, g.contiguous(), group=ctx.group)
        return out, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        G = dist.get_world_size(group)
        out = torch.empty((x.shape[0] // G,) + x.shape[1:], dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        return _AllGatherSeq.apply(g, ctx.group), None


def megatron_tp(group, backend):
    """Timing peer, not a numerical one: q's (B, S/G, hidden) shard stands for the layer input
    that Megatron-SP all-gathers before its QKV projection; each rank then attends with its
    H/G query heads (and Hkv/G kv heads, read from the same gathered activations) over the
    whole sequence, and the emulated out-projection's (B, S, hidden) partial sum is
    reduce-scattered.  Same collectives and attention FLOPs as Megatron, no projections."""
    G = dist.get_world_size(group)
    r = dist.get_rank(group)

    def fn(q, k, v, causal):
        B, n, H, D = q.shape
        Hkv = k.shape[2]
        full = _AllGatherSeq.apply(q.flatten(2).transpose(0, 1), group).transpose(0, 1)  # (B, S, H*D)
        heads = full.unflatten(-1, (H, D))
        qf = heads[:, :, r * H // G:(r + 1) * H // G]
        kf = heads[:, :, r * Hkv // G:(r + 1) * Hkv // G]
        vf = heads[:, :, H - (r + 1) * Hkv // G:H - r * Hkv // G]
        o = sdpa(qf, kf, vf, causal, backend)  # (B, S, H/G, D)
        y = F.pad(o.flatten(2), (r * H // G * D, (H - (r + 1) * H // G) * D))  # my heads in a hidden-size partial
        return _ReduceScatterSeq.apply(y.transpose(0, 1), group).transpose(0, 1).unflatten(-1, (H, D))

    return fn
