"""The device mesh and how the model is spread over it.

Ranks form a 2-D mesh ``dp_shard x cp``: the ranks of one ``cp`` row share a sequence (each
holds its shard under the layout, and attention runs the BurstAttention ring over the row); the
rows read different sequences.  FSDP2 shards every parameter, gradient and optimizer state over
*all* ranks, rows and columns together (as BurstEngine does with ZeRO-3), so context
parallelism costs no extra parameter memory.

Precision: on CUDA, parameters are all-gathered in bf16 and gradients reduced in fp32 while
FSDP keeps fp32 master weights and optimizer state; on CPU everything is fp32.  FSDP averages
gradients over the ranks; the loop scales each rank's loss so that this average is the gradient
of the global mean loss (see loop.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..model.llama import ContextParallel, Transformer

_GROUPS: dict[tuple[int, ...], object] = {}


def _group(ranks: list[int]):
    """A process group over ``ranks``, made by those ranks alone (others need not take part, so
    a job may run on a subgroup of the world) and cached: new groups are not free."""
    key = tuple(ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _GROUPS[key]


@dataclass
class Mesh:
    """This rank's place in the ``dp_shard x cp`` mesh and the groups it talks over."""

    mesh: DeviceMesh          # 2-D (dp_shard, cp)
    fsdp_mesh: DeviceMesh     # 1-D over all ranks of the job (dp_shard x cp flattened)
    group: object             # all ranks of the job
    cp_group: object
    dp_group: object
    dp: int
    cp: int
    dp_rank: int
    cp_rank: int
    device: torch.device

    @property
    def world(self) -> int:
        return self.dp * self.cp

    @property
    def rank(self) -> int:
        return self.dp_rank * self.cp + self.cp_rank


def build_mesh(dp: int, cp: int, device: torch.device, group=None) -> Mesh:
    """The mesh over the ranks of ``group`` (default: the world); consecutive ranks share a
    sequence (so a CP row stays inside a node when cp <= GPUs per node)."""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    if len(ranks) != dp * cp:
        raise ValueError(f"dp x cp = {dp} x {cp} does not match the {len(ranks)} ranks of the job")
    me = ranks.index(dist.get_rank())
    d, c = divmod(me, cp)
    grid = torch.tensor(ranks).view(dp, cp)
    dp_group, cp_group = _group(grid[:, c].tolist()), _group(grid[d].tolist())
    all_group = group or dist.group.WORLD
    kind = device.type
    mesh = DeviceMesh.from_group([dp_group, cp_group], kind, mesh=grid, mesh_dim_names=("dp_shard", "cp"))
    fsdp_mesh = DeviceMesh.from_group(all_group, kind, mesh_dim_names=("dp_shard_cp",))
    return Mesh(mesh=mesh, fsdp_mesh=fsdp_mesh, group=all_group, cp_group=cp_group, dp_group=dp_group, dp=dp, cp=cp,
                dp_rank=d, cp_rank=c, device=device)


def param_dtype(precision: str, device: torch.device) -> torch.dtype:
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def parallelize(model: Transformer, m: Mesh, precision: str = "auto", layout: str = "zigzag",
                attn_backward: str = "auto", kernel: str | None = None, attention: str = "burst") -> Transformer:
    """Shard ``model`` (on any device, meta included) with FSDP2 over all ranks of ``m`` and
    point its attention at the CP group.  Returns the same module."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model.set_context_parallel(ContextParallel(group=m.cp_group, layout=layout, backward=attn_backward,
                                               kernel=None if kernel == "auto" else kernel, attention=attention))
    pdt = param_dtype(precision, m.device)
    mp = MixedPrecisionPolicy(param_dtype=pdt, reduce_dtype=torch.float32)
    for i, block in enumerate(model.layers):
        # the last block's parameters are needed again at once by backward: keep them gathered
        fully_shard(block, mesh=m.fsdp_mesh, mp_policy=mp, reshard_after_forward=i < len(model.layers) - 1)
    fully_shard(model, mesh=m.fsdp_mesh, mp_policy=mp, reshard_after_forward=False)
    return model


def build_model(cfg, m: Mesh) -> Transformer:
    """The config's model, created on the meta device, sharded, then materialised on this
    rank's device and initialised identically whatever the mesh."""
    with torch.device("meta"):
        model = Transformer(cfg.model, checkpoint=cfg.checkpoint, loss=cfg.loss)
    parallelize(model, m, cfg.precision, cfg.layout, cfg.attn_backward, cfg.kernel, cfg.attention)
    model.to_empty(device=m.device)
    model.init_weights(cfg.seed)
    return model
