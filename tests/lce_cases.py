"""Float64 oracle for the fused LM head + cross-entropy, and the cases the gloo workers run."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import burstengine as be
from burstengine.testing import fro_err


def reference(h, w, labels, *, ignore_index=-100, reduction="mean", softcap=None, z_loss=0.0):
    """F.cross_entropy on float64 logits (plus softcap and z-loss); returns (loss, h64, w64) with
    h64 / w64 leaves whose .grad a backward fills."""
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    x = (h64 @ w64.T).reshape(-1, w.shape[0])
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    y = labels.reshape(-1)
    valid = y != ignore_index
    per = F.cross_entropy(x, y, ignore_index=ignore_index, reduction="none")
    per = per + z_loss * torch.where(valid, torch.logsumexp(x, -1) ** 2, 0.0)
    if reduction == "none":
        return per.view(labels.shape), h64, w64
    total = per.sum()
    return (total / valid.sum() if reduction == "mean" else total), h64, w64


def make_inputs(seed, N, d, V, dtype, ignored=0.2, batch=None):
    g = torch.Generator().manual_seed(seed)
    shape = (N,) if batch is None else (batch, N)
    h = torch.randn(*shape, d, generator=g).to(dtype)
    # logits of a few units, like a trained LM head's
    w = (torch.randn(V, d, generator=g) * (2.0 / d ** 0.5)).to(dtype)
    y = torch.randint(0, V, shape, generator=g)
    y[torch.rand(shape, generator=g) < ignored] = -100
    return h, w, y


def check_once(h, w, y, upstream, **kw):
    """Errors (loss, dh, dw) of fused_linear_cross_entropy against the oracle, both
    backpropagated with the same upstream gradient."""
    ref_kw = {k: kw[k] for k in ("reduction", "softcap", "z_loss", "ignore_index") if k in kw}
    ref, h64, w64 = reference(h, w, y, **ref_kw)
    (ref * upstream).sum().backward()
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = be.fused_linear_cross_entropy(hl, wl, y, **kw)
    (loss * upstream.to(loss.dtype)).sum().backward()
    return (fro_err(loss.detach(), ref.detach()), fro_err(hl.grad, h64.grad), fro_err(wl.grad, w64.grad))


def sharded(group, seed, reduction, layout, mode, dtype=torch.float32):
    """This rank's tokens of one global sequence; the loss over the group against the unsharded
    float64 oracle.  mode 'group' normalises through the group, 'total' passes the global token
    count and sums the per-rank losses itself.  Returns (loss err, dh err, dw err): dh of this
    rank's tokens, dw summed over the ranks."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    # the pool's full world is group None, which for the loss means "no group": name it
    group = group or dist.group.WORLD
    S, d, V = 24 * world, 16, 203
    h, w, y = make_inputs(seed, S, d, V, dtype, batch=1)
    upstream = torch.tensor(1.7, dtype=torch.float64)
    ref, h64, w64 = reference(h, w, y, reduction=reduction)
    (ref * upstream).backward()

    hl = be.shard(h, layout, rank, world).clone().requires_grad_()
    yl = be.shard(y, layout, rank, world)
    wl = w.clone().requires_grad_()
    if mode == "group":
        loss = be.fused_linear_cross_entropy(hl, wl, yl, reduction=reduction, group=group, chunk_size=7)
        (loss * upstream.float()).backward()
        value = loss.detach()
    else:
        total = int((y != -100).sum())
        loss = be.fused_linear_cross_entropy(hl, wl, yl, reduction="mean", total_tokens=total, chunk_size=7)
        (loss * upstream.float()).backward()
        value = loss.detach().clone()
        dist.all_reduce(value, group=group)
    dw = wl.grad.clone()
    dist.all_reduce(dw, group=group)
    return (fro_err(value, ref.detach()), fro_err(hl.grad, be.shard(h64.grad, layout, rank, world)),
            fro_err(dw, w64.grad))


def bad_label_on_one_rank(group):
    """Rank 0 holds an out-of-range label: every rank must raise the same ValueError."""
    rank = dist.get_rank(group)
    group = group or dist.group.WORLD
    h, w, y = make_inputs(3, 8, 4, 10, torch.float32)
    if rank == 0:
        y[2] = 10
    try:
        be.fused_linear_cross_entropy(h, w, y, group=group)
    except ValueError as e:
        return str(e)
    return None
