"""LoRA runs inside the gloo pool (tests/model/test_lora.py): our trainer beside transformers + peft on
the same weights and batches, resume, CPU offload, export."""
import os

import torch
import torch.distributed as dist

import finetune_cases as fc

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = ["lora.rank=4", "lora.alpha=8", "warmup_steps=0", "schedule=constant", "weight_decay=0.1"]


def lora_overrides(init, data, seq_len, extra=()):
    return fc.overrides(init, data, seq_len, [*LORA, "lr=1e-2", *extra])


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def trainer_steps(group, init, data, seq_len, steps, extra=()):
    """Our trainer's (loss, {adapter name: full gradient}) of ``steps`` steps (each measured on the
    step's batch before the step is taken), the adapters' initial values, and the batches'
    token / label tensors (rank 0 returns them)."""
    from burstengine.model import lora
    from burstengine.train import Trainer, load
    from burstengine.train import data as D

    cfg = load("tiny", lora_overrides(init, data, seq_len, ["grad_clip=0", *extra]))
    t = Trainer(cfg, group=group, echo=False, lock=False)
    start = {n: _full(p).detach().clone() for n, p in lora.adapters(t.model).items()}
    out, batches = [], []
    for step in range(steps):
        b = t.batch(step)
        loss, grads = t.loss_and_grads(b)
        out.append((loss, grads))
        t.train_step(b, step)
        batches.append(D.global_sequences(t.loader.source, t.loader.indices(step))[:2])
    frozen = [n for n, p in t.model.named_parameters() if not p.requires_grad]
    trained = [n for n, p in t.model.named_parameters() if p.requires_grad]
    state = [_full(v).device.type for st in t.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    if dist.get_rank(group) != 0:
        return None
    return out, start, batches, frozen, trained, state


def peft_steps(init, start, batches, arch="llama", lr=1e-2, weight_decay=0.1):
    """transformers + peft on the same weights, adapters and batches: per step (loss, {our adapter
    name: gradient}) before the step, then AdamW as our trainer takes it."""
    from peft import LoraConfig, get_peft_model

    from burstengine.model import lora

    model = fc.hf_model(init)
    model.train()
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS,
                                          task_type="CAUSAL_LM"))
    params = dict(pm.named_parameters())
    ours = {n: params[lora.peft_name(arch, n).replace(".weight", ".default.weight")] for n in start}
    with torch.no_grad():
        for n, p in ours.items():
            p.copy_(start[n])
    opt = torch.optim.AdamW([ours[n] for n in sorted(ours)], lr=lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=weight_decay, foreach=True)
    out = []
    for toks, labs in batches:
        logits = pm(input_ids=toks).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labs.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        out.append((loss.item(), {n: p.grad.detach().clone() for n, p in ours.items()}))
        opt.step()
    return out


def train_and_save(group, init, data, seq_len, run_dir, steps, stop_after=None, resume=False, extra=()):
    """A LoRA run of ``steps`` steps saving every step (stopped after ``stop_after``, as a preempted
    job), or resumed; returns rank 0's {adapter: full value}, and the checkpoint's DCP keys."""
    import torch.distributed.checkpoint as dcp

    from burstengine.model import lora
    from burstengine.train import Trainer, load
    from burstengine.train import checkpoint as ckpt

    cfg = load("tiny", lora_overrides(init, data, seq_len, [f"steps={steps}", "save_every=1", f"out_dir={run_dir}",
                                                            *extra]))
    t = Trainer(cfg, group=group, echo=False)
    t.fit(resume=resume, overwrite=not resume, stop_after=stop_after)
    weights = {n: _full(p).detach().clone() for n, p in lora.adapters(t.model).items()}
    if dist.get_rank(group) != 0:
        return None
    path = ckpt.latest(os.path.join(run_dir, "checkpoints"))
    return weights, sorted(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)

