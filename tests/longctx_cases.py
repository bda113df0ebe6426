"""Long-context training options run inside the gloo pool (tests/model/test_longctx.py): the tiled MLP,
FSDP2's CPU offload, the host-side gradient clip."""
import torch
import torch.distributed as dist

import train_cases as tc


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def steps_and_placement(group, steps, extra=()):
    """Losses of ``steps`` steps (each on its own batch), the parameters after them, where the
    optimizer keeps its state, and the FSDP2 offload policy of the first layer (rank 0)."""
    from burstengine.train import Trainer

    torch.manual_seed(0)
    t = Trainer(tc.small_config(list(extra) + ["grad_clip=0.5", "warmup_steps=0"]), group=group, echo=False,
                lock=False)
    losses = []
    for step in range(steps):
        loss_sum, count, norm = t.train_step(t.batch(step), step)
        total = loss_sum.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append((total / count).item())
    params = {n: _full(p).detach().clone() for n, p in t.model.named_parameters()}
    state = sorted({v.device.type for st in t.optimizer.state.values() for v in st.values() if torch.is_tensor(v)})
    policy = type(t.model.layers[0]._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
    return (losses, params, state, policy, t.model.states_on_host) if dist.get_rank(group) == 0 else None


def host_clip(group, max_norm):
    """clip_host_grads beside clip_grad_norm_ on the same sharded gradients: (norms, max |difference|
    of the clipped gradients) on rank 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from burstengine.train.loop import clip_host_grads

    mesh = init_device_mesh("cpu", (dist.get_world_size(group),)) if group is None else None
    from torch.distributed.device_mesh import DeviceMesh

    mesh = mesh or DeviceMesh.from_group(group, "cpu")
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=g) for s in ((6, 4), (5,), (3, 7))]
    runs = []
    for clip in ("host", "torch"):
        params = []
        for f in fulls:
            p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(f), mesh, [Shard(0)]))
            p.grad = distribute_tensor(f.clone(), mesh, [Shard(0)])
            params.append(p)
        if clip == "host":
            norm = clip_host_grads(params, max_norm, torch.device("cpu"), group)
        else:
            norm = _full(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True))
        runs.append((norm.item(), [_full(p.grad) for p in params]))
    diff = max((a - b).abs().max().item() for a, b in zip(runs[0][1], runs[1][1]))
    return (runs[0][0], runs[1][0], diff) if dist.get_rank(group) == 0 else None


def memory_line(group, extra=()):
    from burstengine.train import Trainer

    t = Trainer(tc.small_config(extra), group=group, echo=False, lock=False)
    return t.memory_line(), t.memory_needs(), [b.policy for b in t.model.layers]
