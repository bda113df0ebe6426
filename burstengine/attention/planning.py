"""Planning a call: the one module that resolves every "auto" and reads every BURST_* variable.

For each burst_attn_func / hybrid_attn_func call it decides, once: the ring (single or double,
the steps that run: ``topology``), the concrete backward scheme (``backward="auto"``: the cost
model's ``choose_call``, which without link figures is the byte count of
schedule.traffic.backward_by_bytes) and the local kernel (``kernel``).  Every input is the same on
every rank of the group (shapes, the group, the environment torchrun gives all ranks), so every
rank makes the same choice without communicating; bad values raise ValueError before any
communication.  The planned backward is what the ranks then agree on (attention/agreement.py).

The environment, read here and nowhere else in the library (the CLIs read their own flags):

=================  ================================================================================
BURST_KERNEL       kernel when ``kernel=None`` ("auto", "reference", "flash", "cudnn", "triton")
BURST_GLUON        "0": Triton's kernels never take their Gluon (Hopper) paths
BURST_CHECKS       argument-check level: "full" (default), "once", "agree", "local"
BURST_TIMEOUT      seconds a ring wait or the argument check may block (CPU backends) before
                   raising RankLost; also the default fault deadline of ``burstengine train``
BURST_CLUSTER      cluster figures (preset name, JSON file or inline JSON) for the cost model
BURST_TOPOLOGY     "NxM": the node grouping (else LOCAL_WORLD_SIZE, set by torchrun)
BURST_CE_IMPL      fused_linear_cross_entropy's implementation when ``impl=None``
=================  ================================================================================
"""
from __future__ import annotations

import math
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

from .. import costmodel
from ..comm import topology as topo
from ..comm.rings import RingComm
from ..kernels import Kernel, get_kernel
from ..masks import Pattern, as_pattern
from ..schedule import Topology, backward_by_bytes, run_steps
from .call import AttnCall

LEVELS = ("full", "once", "agree", "local")  # argument-check levels (attention/checks.py)


# --- the environment ------------------------------------------------------------------------------

def kernel_from_env() -> str | None:
    return os.environ.get("BURST_KERNEL") or None


def gluon_from_env() -> bool:
    return os.environ.get("BURST_GLUON", "1") != "0"


def checks_from_env() -> str:
    level = os.environ.get("BURST_CHECKS") or "full"
    if level not in LEVELS:
        raise ValueError(f"BURST_CHECKS must be one of {LEVELS}, got {level!r}")
    return level


def ce_impl_from_env() -> str | None:
    return os.environ.get("BURST_CE_IMPL") or None


PLAN_VARS = ("BURST_KERNEL", "BURST_GLUON", "BURST_CHECKS", "BURST_TIMEOUT", "BURST_CLUSTER", "BURST_TOPOLOGY",
             "BURST_CE_IMPL")


def environment() -> dict:
    """The planning variables this process sees ({name: value or None}): what the ranks of a job
    must agree on before they plan anything alike (the trainer compares them across ranks)."""
    return {k: os.environ.get(k) or None for k in PLAN_VARS}


_timeout_override: list[float | None] = []


def configured_timeout() -> float | None:
    """The deadline in seconds for ring waits and the argument check: the innermost
    :func:`call_timeout`, else env ``BURST_TIMEOUT``; None: the process group's own timeout."""
    if _timeout_override:
        return _timeout_override[-1]
    v = os.environ.get("BURST_TIMEOUT")
    if not v:
        return None
    try:
        t = float(v)
    except ValueError:
        raise ValueError(f"BURST_TIMEOUT must be a number of seconds, got {v!r}") from None
    if not (t > 0 and math.isfinite(t)):  # inf: no deadline is what leaving it unset means
        raise ValueError(f"BURST_TIMEOUT must be a finite number of seconds > 0 (unset: the process group's own "
                         f"timeout), got {v!r}")
    return t


@contextmanager
def call_timeout(seconds: float | None):
    """Run the block with ``seconds`` as the deadline of every ring wait and argument check,
    overriding env BURST_TIMEOUT (how ``burstengine train`` hands its fault deadline down)."""
    _timeout_override.append(seconds)
    try:
        yield
    finally:
        _timeout_override.pop()


_CLUSTERS: dict = {}


def cluster_from_env() -> costmodel.Cluster | None:
    """The cluster named by BURST_CLUSTER, or None (cached per value)."""
    spec = os.environ.get(costmodel.ENV)
    if not spec:
        return None
    if spec not in _CLUSTERS:
        try:
            _CLUSTERS[spec] = costmodel.load_cluster(spec)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{costmodel.ENV}={spec!r}: {e}") from None
    return _CLUSTERS[spec]


def cluster_name() -> str | None:
    """What the ranks agree on about BURST_CLUSTER: its value (None when unset).  Its figures
    shape the plan, so every rank must read the same."""
    return os.environ.get(costmodel.ENV) or None


def detect_topology(group=None) -> Topology:
    """The node grouping of ``group``: BURST_TOPOLOGY, else LOCAL_WORLD_SIZE, else one node."""
    return topo.detect(group, os.environ.get(topo.ENV), os.environ.get("LOCAL_WORLD_SIZE"))


def resolve_kernel(name: str | None, device) -> Kernel:
    """The kernel of a call: ``name``, else BURST_KERNEL, else "auto" (Gluon off when BURST_GLUON=0)."""
    return get_kernel(name or kernel_from_env(), device, gluon=gluon_from_env())


# --- one call's plan --------------------------------------------------------------------------------

@dataclass(frozen=True)
class CallPlan:
    """Everything decided about one call before its ring is built: the ring's ``shape`` (one
    node: the single ring), the node ``labels`` of its ranks (byte accounting), the DeviceMesh
    given as topology, the ``steps`` that run (None: all), the concrete ``backward`` scheme, the
    ``kernel``, the mask ``pattern``, the ``layout``, the softmax ``scale`` and the wait
    ``timeout``."""

    shape: Topology
    labels: Topology
    mesh: object
    steps: tuple | None
    backward: str
    kernel: Kernel
    pattern: Pattern
    layout: str
    scale: float
    timeout: float | None

    def ring(self, group, tag: int = 0) -> RingComm:
        """The rings the loops run on (the double ring's sub-groups are made once and cached:
        topology.block_group, bounded by the plan's timeout).  Call it on every rank, after the
        ranks agreed on the call; ``tag``: the call's P2P tag (attention/agreement.py)."""
        return RingComm(group, self.shape, self.labels, mesh=self.mesh, steps=self.steps, timeout=self.timeout,
                        tag=tag)


def softmax_scale_of(q, softmax_scale) -> float:
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def plan_call(q, k, call: AttnCall, world: int, pattern) -> CallPlan:
    """The plan of one burst_attn_func call of ``world`` ranks (LOCAL: 1); ``pattern`` is the
    call's checked masks.Pattern (attention/checks.py: check_mask) or its causal flag."""
    pattern = as_pattern(pattern)
    group, layout, backward, topology = call.group, call.layout, call.backward, call.topology
    B, n, H, D = q.shape
    shape_args = (B, n, H, k.shape[2], D, q.element_size(), pattern.causal, layout)
    cluster = cluster_from_env()
    mesh, steps = None, None
    run = run_steps(layout, pattern, world, n)
    if len(run) < world:
        # a sparse mask leaves steps with no work anywhere: the single ring skips them (the
        # double ring runs every step) and trims its messages, and the bytes it sends decide
        # the backward
        if topology not in (None, "auto", "single"):
            topo.resolve(topology, group)  # still reject a malformed topology
        labels = detect_topology(group) if world > 1 else topo.single(1)
        shape, steps = topo.single(world), run
        if backward == "auto":
            backward = backward_by_bytes(B, n, H, k.shape[2], D, q.element_size(), world, layout=layout,
                                         mask=pattern)
    elif topology is None or topology == "single":
        labels = detect_topology(group) if world > 1 else topo.single(1)
        shape = topo.single(world)
        backward = costmodel.choose_call(shape, *shape_args, backward, cluster)[1]
    elif isinstance(topology, str) and topology == "auto":
        labels = detect_topology(group) if world > 1 else topo.single(1)
        if labels.nodes > 1 and labels.gpus_per_node > 1 and not topo.spans_world(group):
            # the double ring's sub-groups can only be made by the whole job (pass a DeviceMesh)
            _warn_once(f"topology='auto': {labels} nodes detected but the group is not the whole job, so the "
                       "double ring's sub-groups cannot be made here; running the single ring (pass "
                       "topology=<2-D DeviceMesh> to get the double ring)")
            shape = topo.single(world)
            backward = costmodel.choose_call(shape, *shape_args, backward, cluster)[1]
        else:
            shape, backward = costmodel.choose_call(labels, *shape_args, backward, cluster)
    else:
        shape = labels = topo.resolve(topology, group)
        mesh = topology if topo.is_mesh(topology) else None
        backward = costmodel.choose_call(shape, *shape_args, backward, cluster)[1]
    return CallPlan(shape=shape, labels=labels, mesh=mesh, steps=steps, backward=backward,
                    kernel=resolve_kernel(call.kernel, q.device), pattern=pattern, layout=layout,
                    scale=softmax_scale_of(q, call.softmax_scale), timeout=configured_timeout())


def plan_hybrid(q, k, call: AttnCall, world: int, ulysses: int, hkv: int) -> CallPlan:
    """The plan of a hybrid_attn_func call's ring: ``world / ulysses`` ranks, each holding
    ``ulysses`` times the tokens of ``H / ulysses`` heads (``hkv``: the k/v heads after the split,
    costmodel.head_split)."""
    U, R = ulysses, world // ulysses
    B, n, H, D = q.shape
    shape = topo.single(R)
    causal = call.mask.causal
    backward = costmodel.choose_call(shape, B, U * n, H // U, hkv // U, D, q.element_size(), causal, call.layout,
                                     call.backward, cluster_from_env())[1]
    return CallPlan(shape=shape, labels=shape, mesh=None, steps=None, backward=backward,
                    kernel=resolve_kernel(call.kernel, q.device), pattern=Pattern(causal=bool(causal)),
                    layout=call.layout, scale=softmax_scale_of(q, call.softmax_scale), timeout=configured_timeout())


_warned: set = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, stacklevel=3)
