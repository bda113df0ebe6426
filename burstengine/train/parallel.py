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

LoRA (``lora.rank`` > 0, :mod:`burstengine.model.lora`): the frozen base is stored in the compute
dtype (bf16 on CUDA) and sharded as the adapters are, frozen and trainable parameters in the same
FSDP2 unit (one all-gather per layer; only the adapters' gradients are reduced).  ``cpu_offload``:
FSDP2's ``CPUOffloadPolicy`` on every unit (sharded parameters, gradients and so the optimizer
states in host memory, pinned on CUDA); the model is materialised on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..comm.dist import LOCAL
from ..model import ContextParallel, Transformer, fused, lora, recompute
from ..model.hf_dir import load_weights

_MESHES: dict = {}


@dataclass
class Mesh:
    """This rank's place in the ``dp_shard x cp`` mesh and the groups it talks over.
    ``cp_group`` is None when cp == 1 (attention is then local), ``dp_group`` when dp == 1."""

    mesh: DeviceMesh | None   # 2-D (dp_shard, cp) over the whole world
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
    """The mesh over the whole world (torchrun's ranks), consecutive ranks sharing a sequence so
    that a CP row stays inside a node when cp <= GPUs per node.

    ``group`` runs the job on a subgroup of the world instead (tests on a pool of processes);
    new groups cannot be made consistently on a subgroup, so there one of dp, cp must be 1 and
    the subgroup itself is the other dimension."""
    world = dist.get_world_size(group)
    if world != dp * cp:
        raise ValueError(f"dp x cp = {dp} x {cp} does not match the {world} ranks of the job")
    me = dist.get_rank(group)
    d, c = divmod(me, cp)
    kind = device.type
    if world == dist.get_world_size():
        key = (kind, dp, cp)
        if key not in _MESHES:  # every rank builds the same meshes in the same order: safe to cache
            mesh = init_device_mesh(kind, (dp, cp), mesh_dim_names=("dp_shard", "cp"))
            _MESHES[key] = (mesh, DeviceMesh.from_group(dist.group.WORLD, kind, mesh_dim_names=("dp_shard_cp",)))
        mesh, fsdp_mesh = _MESHES[key]
        return Mesh(mesh=mesh, fsdp_mesh=fsdp_mesh, group=dist.group.WORLD,
                    cp_group=mesh["cp"].get_group() if cp > 1 else None,
                    dp_group=mesh["dp_shard"].get_group() if dp > 1 else None,
                    dp=dp, cp=cp, dp_rank=d, cp_rank=c, device=device)
    if dp > 1 and cp > 1:
        raise ValueError(f"a {dp} x {cp} mesh needs the whole world; this job runs on a subgroup")
    fsdp_mesh = DeviceMesh.from_group(group, kind, mesh_dim_names=("dp_shard_cp",))
    return Mesh(mesh=None, fsdp_mesh=fsdp_mesh, group=group, cp_group=group if cp > 1 else None,
                dp_group=group if dp > 1 else None, dp=dp, cp=cp, dp_rank=d, cp_rank=c, device=device)


def param_dtype(precision: str, device: torch.device) -> torch.dtype:
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


class ComputePoolReduceScatter:
    """FSDP2's reduce-scatter (its custom-comm protocol: ``allocate`` and the call) with its
    outputs, the sharded gradients, taken from the compute stream's memory.

    Why: FSDP2 allocates them on its reduce-scatter stream, so after the optimizer frees them
    the allocator keeps ~a model's float32 shard cached for that stream alone, which the next
    forward cannot use; at the backward's peak the card is then "full", and the allocator frees
    every cache and synchronises the device (two such retries a step, ~0.4 s of idle GPU on the
    2-GPU 7B step at 128K: docs/training.md, "memory-streams").  Here the block belongs to the
    compute stream; the side stream first waits for the compute stream (the block may have been
    freed by compute work still queued) and is recorded as a user of the block (so it is not
    handed out again before that stream is done with it, accumulation included).

    Not covered: FSDP2's ``set_all_reduce_hook`` (its hook stream works on the block after the
    reduce-scatter stream, unrecorded). Training never sets one; code that does should turn
    ``grads_on_compute`` off.  Training runs on the stream current at ``parallelize`` (the default
    stream); the trainer switches to no other."""

    def __init__(self, compute: torch.cuda.Stream | None):
        self.compute = compute  # None off CUDA: one stream, nothing to choose

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        here = torch.cuda.current_stream(device) if self.compute is not None else None
        if here == self.compute:
            return torch.empty(*size, dtype=dtype, device=device)
        with torch.cuda.stream(self.compute):
            out = torch.empty(*size, dtype=dtype, device=device)
        here.wait_stream(self.compute)
        out.record_stream(here)
        return out

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        # torch >= 2.13 names it reduce_scatter_single (reduce_scatter_tensor warns there)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def parallelize(model: Transformer, m: Mesh, precision: str = "auto", layout: str = "zigzag",
                attn_backward: str = "auto", kernel: str | None = None, attention: str = "burst",
                cpu_offload: bool = False, grads_on_compute: bool = True) -> Transformer:
    """Shard ``model`` (on any device, meta included) with FSDP2 over all ranks of ``m`` and
    point its attention at the CP group; ``cpu_offload``: its shards (and their gradients and
    optimizer states) in host memory; ``grads_on_compute``: the sharded gradients from the
    compute stream's memory on CUDA (:class:`ComputePoolReduceScatter`).  Returns the same module."""
    # only when the model is sharded
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # torch-cp: the model calls plain SDPA, which torch's context_parallel patches into its ring;
    # burst with no CP (one rank, or pure data parallel): every layer runs BurstAttention's kernels
    # on a one-rank ring, whatever its checkpointing policy (SDPA would differ per layer)
    group = (m.cp_group if m.cp_group is not None else LOCAL) if attention == "burst" else None
    model.set_context_parallel(ContextParallel(group=group, layout=layout,
                                               backward=attn_backward,
                                               kernel=None if kernel == "auto" else kernel,
                                               attention="torch-cp" if attention == "torch-cp" and m.cp > 1 else None))
    pdt = param_dtype(precision, m.device)
    mp = MixedPrecisionPolicy(param_dtype=pdt, reduce_dtype=torch.float32)
    off = CPUOffloadPolicy(pin_memory=m.device.type == "cuda") if cpu_offload else OffloadPolicy()
    for i, block in enumerate(model.layers):
        # the last block's parameters are needed again at once by backward: keep them gathered
        fully_shard(block, mesh=m.fsdp_mesh, mp_policy=mp, offload_policy=off,
                    reshard_after_forward=i < len(model.layers) - 1)
    fully_shard(model, mesh=m.fsdp_mesh, mp_policy=mp, offload_policy=off, reshard_after_forward=False)
    # under CPU offload the gradients leave the device as soon as they are reduced: nothing to keep.
    # Off CUDA (one stream) it allocates as FSDP's own does, installed so that CPU runs take this path
    # too.  FSDP2's custom comms are torch >= 2.8's; without them its own reduce-scatter runs
    units = (*model.layers, model)
    if grads_on_compute and not cpu_offload and all(hasattr(u, "set_custom_reduce_scatter") for u in units):
        comm = ComputePoolReduceScatter(torch.cuda.current_stream(m.device) if m.device.type == "cuda" else None)
        for unit in units:
            unit.set_custom_reduce_scatter(comm)
    model.states_on_host = cpu_offload
    return model


def build_model(cfg, m: Mesh, offload_budget: int = 0, host_policies: tuple = ("full-offload",)) -> Transformer:
    """The config's model, created on the meta device, with LoRA adapters when ``cfg.lora`` asks,
    sharded, then materialised on this rank's device (the host under ``cpu_offload``) and
    initialised identically whatever the mesh: from ``cfg.init`` (an HF model directory, each rank
    reading only the rows it keeps; ``model.load_stats`` says how long it took and this process's
    peak host memory) or randomly from ``cfg.seed``, adapters as PEFT starts them.
    ``offload_budget``: host bytes for checkpoint="auto"'s host layers (0: none), of the
    ``host_policies`` it may plan."""
    with torch.device("meta"):
        model = Transformer(cfg.model, checkpoint=cfg.activation_checkpoint, loss=cfg.loss,
                            checkpoint_split=cfg.activation_checkpoint_split,
                            activation_budget=int(cfg.activation_memory_gib * 2**30) or None,
                            offload_budget=offload_budget, host_policies=host_policies, tiled_mlp=cfg.tiled_mlp,
                            mlp_chunk=cfg.tiled_mlp_chunk)
        if cfg.lora.enabled:
            lora.apply(model, cfg.lora, frozen_dtype=param_dtype(cfg.precision, m.device))
    fused.set_compiled(cfg.fused_ops)
    parallelize(model, m, cfg.precision, cfg.layout, cfg.attn_backward, cfg.kernel, cfg.attention, cfg.cpu_offload,
                cfg.grads_on_compute)
    # under CPU offload FSDP2 keeps the shards on the host: made there, never on the device
    model.to_empty(device="cpu" if cfg.cpu_offload else m.device)
    model.load_stats = None
    if getattr(cfg, "init", ""):
        model.load_stats = load_weights(model, cfg.init)
        # each rank read only its rows: a NaN in one rank's rows is told to every rank, so all
        # refuse alike (before the first step, naming the tensor) rather than one of them
        found = [None] * m.world
        dist.all_gather_object(found, model.load_stats["nonfinite"], group=m.group)
        if any(found):
            raise ValueError(f"init={cfg.init}: {next(f for f in found if f)}")
        if cfg.lora.enabled:
            model.init_weights(cfg.seed, only=lora.is_adapter)
    else:
        model.init_weights(cfg.seed)
    model.state_nbytes = recompute.state_bytes(model.parameters(), model.states_on_host)  # sharded now
    return model
