"""The training loop: AdamW, gradient clipping, learning-rate schedule, the step, evaluation.

One step on every rank, over its ``grad_accum`` micro-batches::

    count = labelled tokens of every micro-batch on all ranks   (one all-reduce, on the device)
    for each micro-batch:
        loss = model(tokens, positions, labels) / count         (this rank's sum / the step's count)
        (loss * world).backward()                               (FSDP averages gradients over ranks;
                                                                 micro-batches' gradients add up)
    clip, set lr, AdamW step

so the gradient is that of the global mean loss over every labelled token of the step,
whatever the dp x cp split and however the step is cut into micro-batches (a token-weighted
mean: micro-batches with more labelled tokens weigh more, exactly as in one big batch).
(FSDP's average is undone by scaling the loss rather than by a gradient divide factor of 1,
which needs PREMUL_SUM reductions that gloo lacks.)  Nothing in the step waits on the host;
the loss is read back only on logged steps.
"""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import time
import weakref

import torch
import torch.distributed as dist

from ..attention import planning
from ..attention.agreement import ranks_by_value, ranks_text
from ..model import recompute
from . import checkpoint as ckpt
from . import runlock
from .data import IGNORE, Batch, Loader, global_sequences, make_source, packed_sequences, shard_batch
from .metrics import (MetricsLog, Progress, open_sinks, peak_flops, peak_memory_gib, read_jsonl, repair_jsonl,
                      summarize)
from .parallel import build_mesh, build_model, param_dtype

def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def lr_at(cfg, step: int) -> float:
    """Learning rate for step ``step`` (0-based): linear warm-up, then cosine / linear decay to
    lr x min_lr_ratio at the last step, or constant."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, cfg.steps - cfg.warmup_steps - 1)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    decay = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1 - frac
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay)


def build_optimizer(model, cfg) -> torch.optim.Optimizer:
    # no weight decay on norms (1-D parameters); frozen parameters (LoRA's base) have no state.
    # Under CPU offload the parameters are host tensors, and so AdamW's states and step are there
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.dim() >= 2]
    rest = [p for p in trained if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, foreach=True)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def clip_host_grads(params, max_norm: float, device, group) -> torch.Tensor:
    """clip_grad_norm_ for gradients that FSDP2's CPU offload keeps on the host while the job's
    collectives run on ``device`` (NCCL takes no host tensors): the squared norm of this rank's
    shards, summed over ``group`` (the shards of every parameter are spread over all its ranks,
    disjoint) on the device, then every shard scaled on the host.  Returns the global norm (on
    ``device``)."""
    grads = [_local(p.grad) for p in params]
    sq = torch.zeros((), dtype=torch.float32)
    if grads:
        sq = torch.stack([n.float() for n in torch._foreach_norm(grads)]).pow(2).sum()
    total = sq.to(device)
    dist.all_reduce(total, group=group)
    norm = total.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0).cpu()
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return norm


# settings that change the data stream or the model: a resume must not change them (the
# checkpoint's weights and data position would belong to another run); the rest (lr, steps,
# schedule, checkpoint and logging knobs, parallelism) only changes how the run goes on
FIXED_ON_RESUME = ("model", "data", "tokenizer", "token_dtype", "seq_len", "batch_size", "seed", "passkey_len",
                   "passkey_symbols", "precision", "lora")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resume_changes(saved: dict, now: dict) -> list[str]:
    """Lines to log for the settings a resume changes; ValueError naming the first fixed one
    (FIXED_ON_RESUME) that differs from the checkpoint's."""
    a, b = _flat(saved), _flat(now)
    if a.get("lora.rank") and a.get("init", "") != b.get("init", ""):
        # a LoRA checkpoint holds the adapters only: the base comes from init again
        raise ValueError(f"--resume of a LoRA run needs the init it started from (init={a.get('init', '')!r}; this "
                         f"run has init={b.get('init', '')!r}): its checkpoint holds only the adapters")
    changed = [k for k in sorted(set(a) | set(b)) if k in a and k in b and a[k] != b[k]]
    fixed = [k for k in changed if k.split(".")[0] in FIXED_ON_RESUME]
    if fixed:
        raise ValueError("--resume with changed " + ", ".join(f"{k} ({a[k]!r} -> {b[k]!r})" for k in fixed)
                         + ": these change the data stream or the model, so the checkpoint belongs to another "
                         "run; restore them, or start a new run (another name / out_dir, or --overwrite)")
    return [f"resume changes {k}: {a[k]!r} -> {b[k]!r}" for k in changed]


def agree(cfg, group=None, refusal: str | None = None) -> tuple[int, int]:
    """Validate ``cfg`` on every rank of ``group`` and check that every rank runs the same
    settings and the same BURST_* planning environment; raise one ValueError on every rank
    otherwise, naming the ranks and values at fault.  One all_gather of small objects, and the
    job's first collective: a rank with another config (a per-rank ``--set``, another file, an
    exported variable) would otherwise build other process groups or another checkpointing
    plan, and the ranks would wait on each other's collectives until the timeout.
    ``refusal``: why this rank cannot run the job (rank 0's lock on the run directory is held
    by another run), raised on every rank once the settings agree.  Returns (dp, cp) of
    :meth:`TrainConfig.check_world`."""
    world = dist.get_world_size(group)
    try:
        cfg.validate()
        dp_cp, err = cfg.check_world(world), None
    except ValueError as e:
        dp_cp, err = None, str(e)
    mine = (err, _flat(cfg.to_dict()), planning.environment(), refusal)
    rows = [mine] if world == 1 else [None] * world
    if world > 1:
        dist.all_gather_object(rows, mine, group=group)
    ranks = range(world)
    failed = {m: rs for m, rs in ranks_by_value((row[0] for row in rows), ranks).items() if m is not None}
    if failed:
        if len(failed) == 1 and len(next(iter(failed.values()))) == world:
            raise ValueError(next(iter(failed)))  # every rank alike: its own message
        raise ValueError("invalid training settings " + "; ".join(f"on {ranks_text(rs)}: {m}"
                                                                   for m, rs in failed.items()))
    diffs = []
    for part in (1, 2):  # the settings, then the environment
        for k in sorted(set().union(*(row[part] for row in rows))):
            groups = ranks_by_value((repr(row[part].get(k)) for row in rows), ranks)
            if len(groups) > 1:
                diffs.append(f"{k}: " + ", ".join(f"{v} on {ranks_text(rs)}" for v, rs in groups.items()))
    if diffs:
        raise ValueError("the ranks disagree on " + "; ".join(diffs) + ": every rank must run the same training "
                         "settings and BURST_* environment")
    refused = [row[3] for row in rows if row[3] is not None]
    if refused:
        raise ValueError(refused[0])
    return dp_cp


def lock_run_dir(cfg) -> tuple[runlock.RunLock | None, str | None]:
    """(the lock on ``cfg.run_dir``, None), or (None, why it cannot be had: another run holds
    it, or the directory cannot be written).  None, None for an out_dir that does not resolve:
    :func:`agree` names that."""
    try:
        run_dir = cfg.run_dir
    except (KeyError, IndexError, ValueError):
        return None, None
    try:
        return runlock.acquire(run_dir), None
    except runlock.Held as e:
        return None, str(e)
    except OSError as e:
        return None, f"out_dir {run_dir}: cannot write its lock file ({e.strerror or e}: {e.filename})"


# the summary's names said on CPU (its record keeps the keys): there a rank is a process, and the
# memory figure is its peak resident set (train/metrics.py, peak_memory_gib)
CPU_NAMES = {"mean_tokens_per_s_per_gpu": "mean_tokens_per_s_per_rank", "peak_mem_gib": "peak_rss_gib"}


class Trainer:
    """A training job on the ranks of ``group`` (default: the world).

    Fault-injection hooks for the tests (burstengine/cli/train.py reads them from the environment):
    ``kill_in_step`` = STEP makes this rank SIGKILL itself in the middle of step STEP (1-based),
    after its forward, while the other ranks go on into the backward's ring and FSDP
    collectives; ``kill_in_save`` = STEP kills rank 0 inside the checkpoint save of that step.

    ``lock`` (default): rank 0 locks the run directory (:mod:`burstengine.train.runlock`) before
    the job's first collective, and a run already there makes every rank raise ValueError naming
    it; the lock is released when :meth:`fit` ends (or by :meth:`close`, or when the trainer is
    garbage-collected), so one trainer runs one fit.  ``lock=False``: a trainer that never writes
    its run directory (benchmarks timing steps)."""

    def __init__(self, cfg, group=None, device=None, echo: bool = True, kill_in_step: int | None = None,
                 kill_in_save: int | None = None, lock: bool = True):
        self.rank = dist.get_rank(group)
        self._locking, self._lock, self._run_over = lock, None, False
        refusal = None
        if lock and self.rank == 0:
            self._lock, refusal = lock_run_dir(cfg)
        self._unlock = weakref.finalize(self, self._lock.release) if self._lock is not None else None
        try:
            self._start(cfg, group, device, echo, kill_in_step, kill_in_save, refusal)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the run directory's lock (idempotent; :meth:`fit` does it when it ends)."""
        if self._unlock is not None:
            self._unlock()

    def _start(self, cfg, group, device, echo, kill_in_step, kill_in_save, refusal) -> None:
        world = dist.get_world_size(group)
        # the job's first collective: every rank valid and alike, and the run directory ours, or all raise
        dp, cp = agree(cfg, group, refusal)
        if cfg.attention == "sdpa" and cp > 1:
            raise ValueError("attention='sdpa' has no context parallelism: use cp=1, or attention='burst' "
                             "or 'torch-cp'")
        if cfg.attention == "torch-cp" and cp > 1 and (group is not None and world != dist.get_world_size()):
            raise ValueError("attention='torch-cp' needs the whole world (its device mesh)")
        self.cfg = cfg
        self.device = device or default_device()
        self.mesh = build_mesh(dp, cp, self.device, group)
        self.group = self.mesh.group
        self.activity = "reading the data"
        # before the model: rank 0 may tokenize a corpus while the others wait
        self.loader = Loader(make_source(cfg, self.group), cfg.batch_size, dp, self.mesh.dp_rank, cfg.grad_accum)
        self.model = build_model(cfg, self.mesh, self.offload_budget(), self.host_policies())
        self.optimizer = build_optimizer(self.model, cfg)
        self.step = 0
        self.activity = "start-up"  # what the job is doing, for the message when a rank is lost
        self._kill_at = kill_in_step
        self._kill_in_save = kill_in_save
        self.run_dir = cfg.run_dir
        self.ckpt_dir = os.path.join(self.run_dir, "checkpoints")
        self.log = MetricsLog(os.path.join(self.run_dir, "metrics.jsonl"), self.rank, echo=echo)
        if self._lock is not None and self._lock.note:
            self.log.say(f"note: {self._lock.note}")
        if self.model.load_stats:  # init: how long the pretrained weights took, and rank 0's peak host memory
            st = self.model.load_stats
            self.log.say(f"loaded {cfg.init} in {st['load_s']:.1f}s (rank 0 read {st['read_gib']:.2f} GiB, peak host "
                         f"RSS {st['peak_rss_gib']:.2f} GiB)")
        # documents as long as the sequence; a LoRA run's frozen base takes no weight gradients
        trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad) if cfg.lora.enabled else 0
        self.flops_per_token = cfg.model.flops_per_token(cfg.seq_len, frozen=cfg.lora.enabled, trained=trained)
        self.peak = peak_flops(self.device, cfg.peak_tflops)

    def host_policies(self) -> tuple:
        """The host policies checkpoint="auto" may plan: ``full-offload`` (when every layer
        recomputing from a device-held input does not fit: for length) always, ``offload`` (for
        speed) with ``activation_offload``, but not under torch-native CP, whose attention saves
        DTensors: they stay on the device (model/offload.py), which the plan would not count; nor
        with ``cpu_offload``, whose parameters and states already fill the host budget's memory
        and the link (the budget does not count them)."""
        cfg = self.cfg
        speed = cfg.activation_offload and cfg.attention != "torch-cp" and not cfg.cpu_offload
        return ("full-offload",) + (("offload",) if speed else ())

    def offload_budget(self) -> int:
        """Host bytes checkpoint="auto" may offload per rank: ``offload_memory_gib``, else this
        host's default (:func:`~burstengine.model.recompute.default_host_budget`), the smallest
        over the ranks: every rank must plan the same layers (a CP ring recomputes alike)."""
        cfg = self.cfg
        if cfg.activation_checkpoint != "auto":
            return 0
        if cfg.offload_memory_gib:
            return int(cfg.offload_memory_gib * 2**30)
        mine = torch.tensor([recompute.default_host_budget(self.device)], dtype=torch.int64, device=self.device)
        if self.mesh.world > 1:
            dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=self.group)
        return int(mine.item())

    def memory_needs(self) -> dict:
        """What one step needs on each rank, from the planner's byte counts (planned now under
        checkpoint="auto", as the first forward will plan it): :meth:`Transformer.memory_needs`,
        plus the host budget and the host bytes of CPU-offloaded parameters and states."""
        cfg, model = self.cfg, self.model
        tokens = cfg.batch_size * cfg.seq_len // self.mesh.cp
        elem = param_dtype(cfg.precision, self.device).itemsize
        if model.auto_checkpoint:
            model.plan_checkpointing(tokens, elem, self.device, sparse=cfg.doc_mask)
        need = model.memory_needs(tokens, elem, self.device, sparse=cfg.doc_mask)
        need["host_budget"] = model.offload_budget if model.auto_checkpoint else None
        need["host_states"] = recompute.state_bytes(model.parameters()) if cfg.cpu_offload else 0
        return need

    def memory_line(self) -> str:
        """One line: whether a step fits the device, and what it needs (parameters and states,
        workspace, kept activations under the plan, the backward's transient; host memory)."""
        n = self.memory_needs()
        gib = 2 ** 30
        total = n["state"] + n["workspace"] + n["activations"] + n["transient"]
        plan = ", ".join(f"{c} {p}" for p, c in n["plan"].items())
        parts = (f"{n['state'] / gib:.1f} GiB parameters and states + {n['workspace'] / gib:.1f} GiB workspace + "
                 f"{n['activations'] / gib:.1f} GiB kept activations ({plan}"
                 f"{'; tiled MLP' if n['tiled_mlp'] else ''}) + {n['transient'] / gib:.1f} GiB backward transient "
                 f"= {total / gib:.1f} GiB")
        if n["usable"] is None:
            verdict, of = "not checked (the device's memory is unknown here)", ""
        else:
            verdict = "fits" if total <= n["usable"] else "does NOT fit"
            of = f" of {n['usable'] / gib:.1f} GiB usable"
        host = ""
        if n["host"] or n["host_states"]:
            budget = f" of {n['host_budget'] / gib:.1f} GiB allowed" if n["host_budget"] else ""
            host = (f"; host: {n['host'] / gib:.1f} GiB offloaded activations{budget}"
                    + (f" + {n['host_states'] / gib:.1f} GiB CPU-offloaded parameters and states"
                       if n["host_states"] else ""))
        return (f"memory at {n['tokens']:,} tokens per rank: {verdict}: {parts}{of}{host} "
                f"(planner's counts, docs/training.md)")

    # --- batches ----------------------------------------------------------------------------

    @property
    def torch_cp(self) -> bool:
        return self.cfg.attention == "torch-cp" and self.mesh.cp > 1

    def make_batch(self, indices, stream: int = 0, pack: bool | None = None):
        """This rank's batch of the given sequences: its shard under our layout, or, for
        torch-cp, the whole sequences (torch's context_parallel shards them in the step).
        ``pack`` (default: the config's doc_mask): one row of packed documents with their
        boundaries."""
        m = self.mesh
        if self.cfg.doc_mask if pack is None else pack:
            toks, labs, depths, cu, pos = packed_sequences(self.loader.source, indices, stream)
            return shard_batch(toks, labs, depths, self.cfg.layout, m.cp_rank, m.cp, self.device, positions=pos,
                               cu_seqlens=cu)
        toks, labs, depths = global_sequences(self.loader.source, indices, stream)
        if self.torch_cp:
            S = toks.shape[1]
            return Batch(tokens=toks.to(self.device), labels=labs.to(self.device),
                         positions=torch.arange(S, device=self.device), depth=depths)
        return shard_batch(toks, labs, depths, self.cfg.layout, m.cp_rank, m.cp, self.device)

    def batch(self, step: int, micro: int = 0):
        """One micro-batch of step ``step`` (the whole step when grad_accum = 1)."""
        return self.make_batch(self.loader.indices(step, micro))

    def batches(self, step: int) -> list:
        """The ``grad_accum`` micro-batches of step ``step``."""
        return [self.batch(step, micro) for micro in range(self.cfg.grad_accum)]

    def cp_context(self, batch):
        """torch-cp: shard the batch in place and patch SDPA into torch's ring for the step."""
        if not self.torch_cp:
            return contextlib.nullcontext()
        # torch's experimental CP API: only for the torch-native baseline
        from torch.distributed.tensor.experimental import context_parallel

        bufs = [batch.tokens, batch.labels, batch.positions]
        return context_parallel(self.mesh.mesh["cp"], buffers=bufs, buffer_seq_dims=[1, 1, 0],
                                no_restore_buffers=set(bufs))

    # --- one step ---------------------------------------------------------------------------

    def loss_sum(self, batch, **kw):
        """The model's loss sum over this rank's labelled tokens of ``batch`` (its document
        boundaries passed on when it has them)."""
        if batch.cu_seqlens is not None:
            kw["cu_seqlens"] = batch.cu_seqlens
        return self.model(batch.tokens, batch.positions, batch.labels, ignore_index=IGNORE, **kw)

    def forward_backward(self, batches, step: int | None = None):
        """Gradients of the step's global mean loss over ``batches`` (its micro-batches), summed
        into the parameters' .grad.  Returns device tensors (this rank's loss sum, the step's
        global labelled-token count)."""
        # every micro-batch's count first: each backward needs the whole step's
        count = sum((b.labels != IGNORE).sum() for b in batches).to(torch.float32)
        if self.torch_cp:
            count = count / self.mesh.cp  # whole sequences on every CP rank until the context shards them
        dist.all_reduce(count, group=self.group)
        scale = self.mesh.world / count.clamp_min(1.0)
        total = None
        for i, b in enumerate(batches):
            with self.cp_context(b):
                loss_sum = self.loss_sum(b)
                if i == 0 and step is not None and self._kill_at == step + 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                (loss_sum * scale).backward()
            total = loss_sum.detach() if total is None else total + loss_sum.detach()
        return total, count

    def train_step(self, batch, step: int):
        """Forward, backward, clip, AdamW over one batch or a list of micro-batches (gradient
        accumulation).  Returns device tensors (this rank's loss sum, global labelled-token
        count, global grad norm) without waiting for them."""
        cfg = self.cfg
        loss_sum, count = self.forward_backward([batch] if isinstance(batch, Batch) else list(batch), step)
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        if cfg.cpu_offload and self.device.type != "cpu":
            norm = clip_host_grads(params, max_norm, self.device, self.group)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        lr = lr_at(cfg, step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, count, _full(norm)

    def loss_and_grads(self, batch):
        """(global mean loss, {name: full gradient}) of one batch or list of micro-batches, no
        optimizer step (tests)."""
        loss_sum, count = self.forward_backward([batch] if isinstance(batch, Batch) else list(batch))
        total = loss_sum.clone()
        dist.all_reduce(total, group=self.group)
        grads = {n: _full(p.grad).detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        self.optimizer.zero_grad(set_to_none=True)
        return (total / count).item(), grads

    # --- evaluation -------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict | None:
        """Passkey accuracy on held-out sequences: per answer token and per sequence (all of its
        tokens right), overall and by the depth at which the key was hidden (quartiles)."""
        cfg, m = self.cfg, self.mesh
        if cfg.data != "passkey":
            return None
        self.model.eval()
        n = cfg.eval_samples
        # token right, token total, sequence right, sequence total; x (overall + 4 quartiles)
        tally = torch.zeros(5, 4, dtype=torch.float64)
        for start in range(0, n, cfg.batch_size * m.dp):
            idx = [i for i in range(start + m.dp_rank * cfg.batch_size, start + (m.dp_rank + 1) * cfg.batch_size)
                   if i < n]
            if not idx:
                # this data-parallel row has no sequence left, but must still take part in the
                # collectives of the forward: run a throwaway sequence and count nothing
                idx, count_it = [0], False
            else:
                count_it = True
            b = self.make_batch(idx, stream=1, pack=False)  # a passkey sequence is one document
            depths = b.depth
            with self.cp_context(b):
                preds = self.loss_sum(b, predict=True)
                keep = b.labels != IGNORE
                per_seq = torch.stack([((preds == b.labels) & keep).sum(1), keep.sum(1)], 1).to(torch.float64)
            if m.cp_group is not None:  # an answer may be split over the cp ranks
                dist.all_reduce(per_seq, group=m.cp_group)
            if not count_it:
                continue
            per_seq = per_seq.cpu()
            for s, dep in enumerate(depths):
                right, total = per_seq[s].tolist()
                row = torch.tensor([right, total, float(right == total), 1.0], dtype=torch.float64)
                tally[0] += row
                tally[1 + min(3, int(dep * 4))] += row
        if m.dp_group is not None:
            tally = tally.to(self.device)
            dist.all_reduce(tally, group=m.dp_group)
            tally = tally.cpu()
        self.model.train()

        def frac(a, b):
            return a / b if b else None

        res = {"kind": "eval", "step": self.step, "samples": int(tally[0, 3]),
               "token_acc": frac(tally[0, 0].item(), tally[0, 1].item()),
               "passkey_acc": frac(tally[0, 2].item(), tally[0, 3].item()),
               "chance_token_acc": 1.0 / cfg.passkey_symbols,
               "chance_passkey_acc": math.prod(1.0 / (cfg.passkey_symbols - i) for i in range(cfg.passkey_len)),
               "token_acc_by_depth": [frac(tally[q, 0].item(), tally[q, 1].item()) for q in range(1, 5)],
               "passkey_acc_by_depth": [frac(tally[q, 2].item(), tally[q, 3].item()) for q in range(1, 5)]}
        return res

    # --- the run ----------------------------------------------------------------------------

    def prepare_run_dir(self, resume: bool, overwrite: bool) -> None:
        """Resume from the latest checkpoint, or start a fresh run (refusing to mix with an old
        one unless ``overwrite``)."""
        found = ckpt.latest(self.ckpt_dir)
        self.activity = "loading the checkpoint" if resume and found else "start-up"
        if resume and found:
            changes = []

            def accept(meta):
                changes.extend(resume_changes(meta.get("config") or {}, self.cfg.to_dict()))

            found, meta = ckpt.load_intact(self.ckpt_dir, self.model, self.optimizer, self.group,
                                           say=self.log.say, accept=accept)
            for line in changes:
                self.log.say(line)
            self.step = meta["step"]
            if "data" in meta:
                self.loader.load_state_dict(meta["data"])
            if self.rank == 0:
                # what a killed run logged past this checkpoint is logged again from here on
                dropped = repair_jsonl(self.log.path, self.step)
                if dropped:
                    self.log.say(f"{self.log.path}: dropped {dropped} line(s) logged after step {self.step} "
                                 f"(or cut off mid-write)")
            self.log.say(f"resumed from {found} (step {self.step})")
            return
        if resume:
            self.log.say(f"--resume: no checkpoint in {self.ckpt_dir}; starting from step 0")
        elif found and not overwrite:
            raise ValueError(f"{self.run_dir} holds a run (checkpoint {os.path.basename(found)}): pass --resume to "
                             f"continue it, --overwrite to start again, or another name / out_dir")
        dist.barrier(self.group)
        if self.rank == 0:
            shutil.rmtree(self.ckpt_dir, ignore_errors=True)
            path = self.log.path
            if os.path.exists(path):
                os.remove(path)
        dist.barrier(self.group)

    def fit(self, resume: bool = False, overwrite: bool = False, stop_after: int | None = None,
            on_step=None) -> dict:
        """Train to ``cfg.steps`` (or stop, as a preempted job would, once ``stop_after`` steps are
        done); returns the summary on rank 0 ({} elsewhere).  ``on_step(trainer)`` is called after
        each step and its logging, evaluation and checkpoint (e.g. to sample memory).  The run
        directory's lock is released when it ends, however it ends."""
        if self._run_over:  # the same on every rank
            raise ValueError(f"this trainer's run in {self.run_dir} is over (its lock was released when fit "
                             f"ended): build a new Trainer to train again")
        self._run_over = self._locking
        try:
            self.prepare_run_dir(resume, overwrite)
            progress = Progress(self.cfg.steps, self.cfg.progress and self.rank == 0, initial=self.step)
            self.log.progress = progress
            try:
                self._open_sinks()
                return self._fit(progress, stop_after, on_step)
            finally:
                progress.close()
                self.log.progress = None
                self.log.close()
        finally:
            self.close()

    def _open_sinks(self) -> None:
        """Rank 0 opens the TensorBoard / W&B sinks; a failure (say, W&B online without a network)
        ends the job on every rank alike rather than leaving the others in the first step."""
        if not (self.cfg.tensorboard or self.cfg.wandb):
            return
        err = [None]
        if self.rank == 0:
            try:
                self.log.sinks = open_sinks(self.cfg, self.run_dir, self.step)
            except Exception as e:  # whatever the packages raise
                err = [f"opening the metrics sinks: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"]
        dist.broadcast_object_list(err, group=self.group, group_src=0)
        if err[0] is not None:
            raise ValueError(err[0])

    def _attention_pairs(self, batch) -> float:
        """Sum over this rank's sequences (documents, when masked) of length^2: what the causal
        attention FLOPs of a batch scale with, counted once per CP row."""
        if batch.cu_seqlens is not None:
            cu = batch.cu_seqlens
            pairs = float(sum((b - a) ** 2 for a, b in zip(cu[:-1], cu[1:])))
        else:
            pairs = float(batch.tokens.shape[0] * self.cfg.seq_len ** 2)
        return pairs / self.mesh.cp

    def _fit(self, progress, stop_after, on_step) -> dict:
        cfg, m = self.cfg, self.mesh
        tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len * m.dp
        accum = f" ({cfg.grad_accum} micro-batches)" if cfg.grad_accum > 1 else ""
        self.log.say(f"training {cfg.name}: {cfg.model.num_params() / 1e6:.1f}M params, {m.world} ranks "
                     f"(dp {m.dp} x cp {m.cp}, {cfg.layout}), seq {cfg.seq_len}, {tokens_per_step} tokens/step{accum}, "
                     f"{self.device.type} ({str(param_dtype(cfg.precision, self.device))[6:]} compute)"
                     f"{', documents masked' if cfg.doc_mask else ''}")
        # training FLOPs = tokens x (6 x dense params) + (6 x layers x dim) x sum of causal length^2
        dense_flops = self.flops_per_token - cfg.model.flops_per_token(cfg.seq_len) + cfg.model.flops_per_token(0)
        attn_flops = cfg.model.flops_per_token(1) - cfg.model.flops_per_token(0)
        say_every = max(1, cfg.steps // 20)
        # what the numbers are: per GPU and allocated device memory, or per rank and the peak RSS on CPU
        per, mem_label = ("gpu", "mem") if self.device.type == "cuda" else ("rank", "peak rss")
        t_run = time.perf_counter()
        window_t, window_steps, window_pairs = time.perf_counter(), 0, 0.0
        self.log.say(self.memory_line())
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        acc_loss, acc_count = None, None
        end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
        while self.step < end:
            self.activity = f"step {self.step + 1}"
            batches = self.batches(self.step)
            window_pairs += sum(self._attention_pairs(b) for b in batches)
            loss_sum, count, norm = self.train_step(batches, self.step)
            self.step += 1
            window_steps += 1
            acc_loss = loss_sum if acc_loss is None else acc_loss + loss_sum
            acc_count = count if acc_count is None else acc_count + count
            last = self.step == cfg.steps
            if self.step % cfg.log_every == 0 or last:
                stats = torch.stack([acc_loss.float(), torch.tensor(window_pairs, device=acc_loss.device),
                                     torch.tensor(peak_memory_gib(self.device), device=acc_loss.device)])
                dist.all_reduce(stats[:2], group=self.group)
                mem = stats[2:].clone()
                dist.all_reduce(mem, op=dist.ReduceOp.MAX, group=self.group)
                loss = (stats[0] / acc_count).item()  # the one host sync of a logged step
                dt = (time.perf_counter() - window_t) / window_steps
                tgs = tokens_per_step / m.world / dt
                flops = window_steps * tokens_per_step * dense_flops + attn_flops * stats[1].item()
                mfu = flops / (dt * window_steps * m.world) / self.peak if self.peak else None
                rec = {"kind": "step", "step": self.step, "loss": loss, "lr": lr_at(cfg, self.step - 1),
                       "grad_norm": norm.item(), "step_time_s": dt, "tokens_per_s_per_gpu": tgs, "mfu": mfu,
                       "peak_mem_gib": mem.item(), "tokens": self.step * tokens_per_step,
                       "target_tokens": int(acc_count.item()), "elapsed_s": time.perf_counter() - t_run}
                self.log.write(rec)
                progress.update(self.step, f"loss {loss:.4f} {tgs:,.0f} tok/s/{per}")
                if self.step % say_every == 0 or last or self.step == 1:
                    mfu = f" mfu {rec['mfu']:.1%}" if rec["mfu"] is not None else ""
                    self.log.say(f"step {self.step:>6}/{cfg.steps}  loss {loss:.4f}  lr {rec['lr']:.2e}  "
                                 f"|g| {rec['grad_norm']:.3f}  {dt:.3f}s/step  {tgs:,.0f} tok/s/{per}{mfu}  "
                                 f"{mem_label} {rec['peak_mem_gib']:.2f} GiB")
                acc_loss, acc_count, window_steps, window_pairs = None, None, 0, 0.0
                window_t = time.perf_counter()
            paused = False
            if cfg.data == "passkey" and ((cfg.eval_every and self.step % cfg.eval_every == 0) or last):
                self.activity = f"the evaluation after step {self.step}"
                ev = self.evaluate()
                self.log.write(ev)
                progress.update(self.step, f"passkey acc {ev['passkey_acc']:.2f}")
                self.log.say(f"eval at step {self.step}: passkey {ev['passkey_acc']:.3f} "
                             f"(chance {ev['chance_passkey_acc']:.1e}), answer tokens {ev['token_acc']:.3f} "
                             f"(chance {ev['chance_token_acc']:.3f}) over {ev['samples']} held-out sequences")
                paused = True
            if cfg.save_every and (self.step % cfg.save_every == 0 or last):
                self.activity = f"the checkpoint save of step {self.step}"
                path = ckpt.save(self.ckpt_dir, self.step, self.model, self.optimizer,
                                 {"data": self.loader.state_dict(self.step), "config": cfg.to_dict()},
                                 group=self.group, keep=cfg.save_keep, kill_in_save=self._kill_in_save)
                self.log.say(f"saved {path}")
                paused = True
            if on_step is not None:
                on_step(self)
            if paused:  # keep evaluation and saving out of the step times
                window_t = time.perf_counter()
        self.activity = "the end of the run"
        dist.barrier(self.group)
        summary = {"kind": "summary", **summarize(read_jsonl(self.log.path))} if self.rank == 0 else {}
        if self.rank == 0:
            summary.update(name=cfg.name, world=m.world, dp=m.dp, cp=m.cp, layout=cfg.layout, seq_len=cfg.seq_len,
                           device=self.device.type, wall_s=time.perf_counter() - t_run)
            self.log.write(summary)
            named = {k: CPU_NAMES.get(k, k) if self.device.type == "cpu" else k for k in summary}
            self.log.say("summary: " + ", ".join(f"{named[k]}={v:.4g}" if isinstance(v, float) else f"{named[k]}={v}"
                                                 for k, v in summary.items() if k not in ("kind", "eval")))
        return summary
