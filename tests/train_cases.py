"""Training code run inside the gloo pool (module level, so the workers can import it)."""
import torch
import torch.distributed as dist

from burstengine.loss import model_loss
from burstengine.train import Trainer, load
from burstengine.train.metrics import read_jsonl

SMALL = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=64",
         "model.ffn_dim=48", "seq_len=32", "batch_size=2", "progress=false", "cp=0"]


def small_config(extra=(), data=None):
    over = list(SMALL) + list(extra)
    if data:
        over.append(f"data={data}")
    else:
        over += ["passkey_symbols=8", "passkey_len=3"]
    return load("tiny", over)


def loss_and_grads(group, data, extra=(), chunk=None):
    """Global loss and full gradients of step 0's batch on this dp x cp mesh (rank 0 returns them)."""
    torch.manual_seed(0)
    cfg = small_config(extra, data)
    old = model_loss.CHUNK_TOKENS
    if chunk:
        model_loss.CHUNK_TOKENS = chunk
    try:
        t = Trainer(cfg, group=group, echo=False, lock=False)
        loss, grads = t.loss_and_grads(t.batch(0))
    finally:
        model_loss.CHUNK_TOKENS = old
    return (loss, grads) if dist.get_rank(group) == 0 else None


def loss_and_grads_offloading_all(group, data, extra=(), chunk=None):
    """loss_and_grads with every saved tensor of an "offload" layer going to the host, however small."""
    from burstengine.model import offload

    old, offload.MIN_BYTES = offload.MIN_BYTES, 0
    try:
        return loss_and_grads(group, data, extra, chunk)
    finally:
        offload.MIN_BYTES = old


def run_steps(group, out_dir, steps, extra=(), resume=False, stop_after=None):
    """Train (or resume) in out_dir; rank 0 returns the step records of metrics.jsonl."""
    cfg = small_config(list(extra) + [f"out_dir={out_dir}", f"steps={steps}", "eval_every=0", "log_every=1"])
    t = Trainer(cfg, group=group, echo=False)
    t.fit(resume=resume, overwrite=not resume, stop_after=stop_after)
    if dist.get_rank(group) == 0:
        return [r for r in read_jsonl(t.log.path) if r["kind"] == "step"]
    return None


def variants(group, data, extra, variants, fused_chunk=None):
    """Global loss and full gradients of step 0's batch for each (loss, checkpoint policy, split)
    of ``variants``, one model and one batch on this mesh (rank 0 returns them)."""
    torch.manual_seed(0)
    t = Trainer(small_config(extra, data), group=group, echo=False, lock=False)
    batch = t.batch(0)
    old = model_loss.FUSED_CHUNK_TOKENS
    model_loss.FUSED_CHUNK_TOKENS = fused_chunk
    out = []
    try:
        for loss, policy, split in variants:
            t.model.loss_name = loss
            for b in t.model.layers:
                b.policy, b.checkpoint_split = policy, split
            out.append(t.loss_and_grads(batch))
    finally:
        model_loss.FUSED_CHUNK_TOKENS = old
    return out if dist.get_rank(group) == 0 else None


def resume_outcome(group, out_dir, steps, extra=()):
    """Resume in out_dir; rank 0 returns ("ok", step records, log lines) or ("error", message)."""
    cfg = small_config(list(extra) + [f"out_dir={out_dir}", f"steps={steps}", "eval_every=0", "log_every=1"])
    t = Trainer(cfg, group=group, echo=False)
    said = []
    t.log.say = said.append
    try:
        t.fit(resume=True)
    except ValueError as e:
        return ("error", str(e)) if dist.get_rank(group) == 0 else None
    if dist.get_rank(group) == 0:
        return "ok", [r for r in read_jsonl(t.log.path) if r["kind"] == "step"], said
    return None


def auto_plan(group, budget_gib, extra=()):
    """activation_checkpoint=auto under an activation budget: (the per-layer plan, global loss, full grads)."""
    torch.manual_seed(0)
    cfg = small_config(["activation_checkpoint=auto", f"activation_memory_gib={budget_gib}", *extra])
    t = Trainer(cfg, group=group, echo=False, lock=False)
    loss, grads = t.loss_and_grads(t.batch(0))
    return (t.model.checkpoint_plan, loss, grads) if dist.get_rank(group) == 0 else None


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def accum_step(group, data, extra=()):
    """Loss and gradients of step 0 (all its micro-batches), then the parameters after one
    optimizer step on them (rank 0 returns full tensors)."""
    torch.manual_seed(0)
    t = Trainer(small_config(extra, data), group=group, echo=False, lock=False)
    loss, grads = t.loss_and_grads(t.batches(0))
    t.train_step(t.batches(0), 0)
    params = {n: _full(p).detach().clone() for n, p in t.model.named_parameters()}
    return (loss, grads, params) if dist.get_rank(group) == 0 else None


def tokenize_calls(group, data, extra=()):
    """How often this rank tokenized while two trainers on ``data`` were built: (first, second)."""
    from burstengine.train import corpus

    calls = []
    orig = corpus._tokenize
    corpus._tokenize = lambda *a: (calls.append(1), orig(*a))[1]
    try:
        cfg = small_config(extra, data)
        Trainer(cfg, group=group, echo=False, lock=False)
        first = len(calls)
        Trainer(cfg, group=group, echo=False, lock=False)
    finally:
        corpus._tokenize = orig
    return first, len(calls) - first


def fit_error(group, out_dir, extra=()):
    """The ValueError a fit raises on this rank (None if it does not)."""
    cfg = small_config(list(extra) + [f"out_dir={out_dir}", "steps=1", "eval_every=0"])
    try:
        Trainer(cfg, group=group, echo=False).fit(overwrite=True)
    except ValueError as e:
        return str(e)
    return None


def attention_groups(group, extra=()):
    """What each block's attention runs on (rank 0): 'local' (BurstAttention on a one-rank ring),
    'sdpa' (no group) or 'ring' (a process group)."""
    from burstengine.comm.dist import LOCAL

    t = Trainer(small_config(extra), group=group, echo=False, lock=False)
    kinds = ["local" if b.cp.group is LOCAL else "sdpa" if b.cp.group is None else "ring" for b in t.model.layers]
    return kinds if dist.get_rank(group) == 0 else None


def save_stopped(group, ckpt_dir):
    """A checkpoint save in which rank 0 is told to stop while DCP writes its files (SystemExit
    143, what the launcher's SIGTERM on Ctrl-C raises in a rank): (type, text) of what each rank
    raises, None if nothing."""
    from torch.distributed.checkpoint import FileSystemWriter

    from burstengine.train import checkpoint as ckpt

    t = Trainer(small_config(), group=group, echo=False, lock=False)
    write = FileSystemWriter.write_data

    def stopped(self, *args, **kwargs):
        if dist.get_rank(group) == 0:
            raise SystemExit(143)
        return write(self, *args, **kwargs)

    FileSystemWriter.write_data = stopped
    try:
        ckpt.save(ckpt_dir, 1, t.model, t.optimizer, {}, group=group)
    except BaseException as e:  # noqa: BLE001 (SystemExit is the point)
        return type(e).__name__, str(e)
    finally:
        FileSystemWriter.write_data = write
    return None


def planned_state(group):
    """The parameter/state bytes checkpoint="auto" plans with, counted in the first step's forward,
    beside the count made while FSDP2 keeps its shards: (before, [in the forward, ...])."""
    from burstengine.model import recompute

    torch.manual_seed(0)
    t = Trainer(small_config(["activation_checkpoint=auto"]), group=group, echo=False, lock=False)
    before = recompute.state_bytes(t.model.parameters())
    seen, budget = [], recompute.default_budget

    def spy(state, device):
        seen.append(state)
        return budget(state, device)

    recompute.default_budget = spy
    try:
        t.train_step(t.batch(0), 0)
    finally:
        recompute.default_budget = budget
    return before, seen


def grad_comm_step(group, data, extra=()):
    """accum_step, and which reduce-scatter each FSDP unit runs with how many calls of ours
    (rank 0 returns (loss, grads, params, comm class names, calls))."""
    from burstengine.train import parallel

    calls = [0]
    real = parallel.ComputePoolReduceScatter.__call__

    def counted(self, *a, **k):
        calls[0] += 1
        return real(self, *a, **k)

    parallel.ComputePoolReduceScatter.__call__ = counted
    try:
        torch.manual_seed(0)
        t = Trainer(small_config(extra, data), group=group, echo=False, lock=False)
        # _fsdp_param_group: torch 2.11's attribute, a property over _fsdp_param_groups since 2.12/2.13
        names = sorted({type(unit._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm).__name__
                        for unit in (*t.model.layers, t.model)})
        loss, grads = t.loss_and_grads(t.batches(0))
        t.train_step(t.batches(0), 0)
        params = {n: _full(p).detach().clone() for n, p in t.model.named_parameters()}
    finally:
        parallel.ComputePoolReduceScatter.__call__ = real
    return (loss, grads, params, names, calls[0]) if dist.get_rank(group) == 0 else None
