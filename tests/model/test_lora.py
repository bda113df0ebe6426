"""LoRA (burstengine/model/lora.py): training equals transformers + peft on the same weights,
adapters and batches (losses and adapter gradients of several steps, every family, CP 1/2/4);
the export round trip (a PEFT adapter directory that ``PeftModel.from_pretrained`` loads with the
merged export's logits); only adapters train, sit in the optimizer and in checkpoints; a resumed
run is bit-equal to one that never stopped, and refuses another init; every checkpoint policy,
the tiled MLP, packed documents and the instruction format run the adapters exactly; dropout is
replayed by the policies that recompute, and refused by the ones that cannot."""
import copy
import dataclasses
import json
from pathlib import Path
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import finetune_cases as fc  # noqa: E402
import lora_cases as lc  # noqa: E402
import train_cases as tc  # noqa: E402
from burstengine.model import PRESETS, Transformer, lora  # noqa: E402
from burstengine.model.recompute import POLICIES  # noqa: E402
from burstengine.testing import rel_err  # noqa: E402
from burstengine.train import load  # noqa: E402
from test_finetune import models, tokens  # noqa: E402,F401  (the fixtures: tiny pretrained models, a token file)
from test_train_data import corpus_dir, small_text  # noqa: E402,F401  (the fixture)


# --- against transformers + peft -----------------------------------------------------------------

@pytest.mark.parametrize("arch,world,layout", [
    ("llama", 1, "contiguous"), ("llama", 2, "zigzag"), ("llama", 4, "striped"), ("llama3-tied", 2, "zigzag"),
    ("qwen2", 2, "contiguous"), ("qwen3", 4, "zigzag"), ("mistral", 2, "striped")])
def test_training_equals_peft(pool, models, tokens, arch, world, layout):
    """Three AdamW steps from the same base, adapters and batches: the same losses and adapter
    gradients (B starts at zero, so the first step moves only B and the later ones A too); the
    base is frozen, only adapters have optimizer state."""
    out, start, batches, frozen, trained, state = pool.run(lc.trainer_steps, models[arch], tokens, 48, 3,
                                                           [f"cp={world}", f"layout={layout}"], world=world)[0]
    assert all(lora.is_adapter(n) for n in trained) and not any(lora.is_adapter(n) for n in frozen)
    assert len(trained) == 2 * 7 * fc.BASE["num_hidden_layers"] and state and set(state) == {"cpu"}
    assert all(start[n].abs().max() == 0 for n in start if ".lora_B." in n)
    ref = lc.peft_steps(models[arch], start, batches, "llama" if arch == "llama3-tied" else arch)
    for step, ((loss, grads), (want, wgrads)) in enumerate(zip(out, ref)):
        assert abs(loss - want) <= 2e-6 * want, (step, loss, want)
        assert grads.keys() == wgrads.keys() == start.keys()
        # float32 on both sides: each adapter's error against the step's largest gradient (A's are
        # ~1e-4 of B's once B has moved, and sums of tiny terms lose relative precision)
        scale = max(g.abs().max().item() for g in wgrads.values())
        for n in grads:
            assert (grads[n] - wgrads[n]).abs().max().item() <= 1e-5 * scale, (step, n)
        # B starts at zero: A's gradient is zero until B has moved
        moved = [n for n in grads if grads[n].abs().max() > 0]
        assert ({".lora_A." in n for n in moved} == {False}) if step == 0 else any(".lora_A." in n for n in moved)


@pytest.mark.parametrize("arch", sorted(fc.ARCHS))
def test_export_round_trip(pool, models, tokens, tmp_path, arch):
    """A LoRA run -> its merged HF export (the trainer's loss in transformers) and its PEFT adapter
    directory: PeftModel.from_pretrained(base, adapter) gives the merged model's logits, which
    differ from the base's."""
    from peft import PeftModel

    from burstengine.train.export import export_adapter

    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    m, loss, hf = pool.run(fc.train_and_export, models[arch], tokens, 48, str(tmp_path / "run"), str(merged),
                           ["cp=2", *lc.LORA, "steps=2", "save_every=2", "lr=1e-2"], world=2)[0]
    assert m["lora"] and abs(hf - loss) <= 2e-6 * loss  # the merged export in transformers: the trainer's loss
    if arch == "phi3":  # q/k/v and gate/up are fused HF tensors: one PEFT adapter cannot stand for three
        with pytest.raises(ValueError, match="fused HF tensor"):
            export_adapter(str(tmp_path / "run"), str(adapter))
        assert not adapter.exists()
        return
    a = export_adapter(str(tmp_path / "run"), str(adapter))
    layers = json.loads((Path(models[arch]) / "config.json").read_text())["num_hidden_layers"]  # Gemma's: 3
    assert m["lora"] and a["adapter"] and a["tensors"] == 2 * 7 * layers
    assert abs(hf - loss) <= 2e-6 * loss  # the merged export in transformers: the trainer's loss
    toks = torch.randint(0, fc.VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    assert cfg["target_modules"] == sorted(lc.TARGETS) and cfg["base_model_name_or_path"] == models[arch]
    from safetensors.torch import load_file
    names = sorted(load_file(adapter / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in names
    with torch.no_grad():
        peft = PeftModel.from_pretrained(fc.hf_model(models[arch]), str(adapter)).eval()(input_ids=toks).logits
        want = fc.hf_model(str(merged))(input_ids=toks).logits
        base = fc.hf_model(models[arch])(input_ids=toks).logits
    assert (peft - want).abs().max() <= 1e-5 * want.abs().max()
    assert (base - want).abs().max() > 1e-3 * want.abs().max()
    # the command writes what the library does
    from burstengine.cli import main

    assert main(["export", str(tmp_path / "run"), str(tmp_path / "cli"), "--adapter"]) == 0
    cli = load_file(tmp_path / "cli" / "adapter_model.safetensors")
    assert cli.keys() == load_file(adapter / "adapter_model.safetensors").keys()
    assert all(torch.equal(t, load_file(adapter / "adapter_model.safetensors")[k]) for k, t in cli.items())


def test_adapter_export_refusals(pool, models, tokens, tmp_path, monkeypatch, capsys):
    from burstengine.model.families import registry
    from burstengine.model.families.base import LLAMA_LIKE, Family, layer
    from burstengine.model.families.table import Table
    from burstengine.train.export import export_adapter

    pool.run(fc.train_and_export, models["llama"], tokens, 48, str(tmp_path / "run"), str(tmp_path / "out"),
             world=1)  # a run without LoRA
    with pytest.raises(ValueError, match="is not a LoRA run's"):
        export_adapter(str(tmp_path / "run"), str(tmp_path / "adapter"))
    from burstengine.cli import main

    assert main(["export", str(tmp_path / "run"), str(tmp_path / "adapter"), "--adapter"]) == 2
    err = capsys.readouterr().err
    assert "is not a LoRA run's" in err and len(err.strip().splitlines()) == 1

    class Fused(Family):  # Phi-3's way: q, k and v in one HF tensor
        name = model_type = "fusedqkv"
        architectures = ("FusedForCausalLM",)
        table = Table([e for e in LLAMA_LIKE if "_proj" not in e.hf or "mlp" in e.hf or "o_proj" in e.hf]
                      + [layer("self_attn.qkv_proj.weight", "attention.wq.weight", "attention.wk.weight",
                               "attention.wv.weight", rows=lambda a: (a.dim, a.dim, a.dim))])

    monkeypatch.setitem(registry.FAMILIES, "fusedqkv", Fused())
    assert lora.peft_name("fusedqkv", "layers.0.attention.wo.lora_A.weight").endswith("self_attn.o_proj.lora_A.weight")
    with pytest.raises(ValueError, match="part of the fused HF tensor 'model.layers.0.self_attn.qkv_proj.weight'"):
        lora.peft_name("fusedqkv", "layers.0.attention.wq.lora_B.weight")


# --- checkpoints --------------------------------------------------------------------------------

def test_resume_is_bit_equal_and_keeps_only_adapters(pool, models, tokens, tmp_path):
    extra = ["cp=2"]
    full, keys = pool.run(lc.train_and_save, models["qwen3"], tokens, 48, str(tmp_path / "a"), 3, extra=extra,
                          world=2)[0]
    pool.run(lc.train_and_save, models["qwen3"], tokens, 48, str(tmp_path / "b"), 3, stop_after=2, extra=extra,
             world=2)
    resumed, _ = pool.run(lc.train_and_save, models["qwen3"], tokens, 48, str(tmp_path / "b"), 3, resume=True,
                          extra=extra, world=2)[0]
    assert full.keys() == resumed.keys() and all(torch.equal(full[n], resumed[n]) for n in full)
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(lora.is_adapter(k) for k in model_keys)
    assert all(lora.is_adapter(k) for k in keys if k.startswith("optim.state."))
    meta = json.loads((tmp_path / "a" / "checkpoints" / "step_00000003" / "meta.json").read_text())
    assert meta["frozen_dtype"] == "float32"  # CPU: the base trains in float32


def test_resume_refuses_another_init(pool, models, tokens, tmp_path):
    pool.run(lc.train_and_save, models["llama"], tokens, 48, str(tmp_path / "a"), 2, stop_after=1, world=1)
    from burstengine.train.loop import resume_changes

    saved = json.loads((tmp_path / "a" / "checkpoints" / "step_00000001" / "meta.json").read_text())["config"]
    now = load("tiny", lc.lora_overrides(models["qwen2"], tokens, 48, ["steps=2"])).to_dict()
    with pytest.raises(ValueError, match="--resume of a LoRA run needs the init it started from"):
        resume_changes(saved, now)
    with pytest.raises(ValueError, match="lora.rank"):
        resume_changes(saved, dict(saved, lora=dict(saved["lora"], rank=8)))


# --- the model: every policy, the tiled MLP, dropout ---------------------------------------------

def _lora_model(dropout=0.0, **over):
    a = dataclasses.replace(PRESETS["tiny"], **over)
    torch.manual_seed(0)
    m = Transformer(a).double()
    m.init_weights(0)
    lora.apply(m, lora.LoraArgs(rank=4, alpha=8, dropout=dropout))
    m.double()
    with torch.no_grad():  # B at zero would hide A's part of the forward
        for p in lora.adapters(m).values():
            p.normal_(0, 0.1)
    return a, m


def _loss_grads(model, a, seed=0, n=37):
    g = torch.Generator().manual_seed(7)
    ids, labs = torch.randint(0, a.vocab_size, (2, n), generator=g), torch.randint(0, a.vocab_size, (2, n), generator=g)
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss = model(ids, torch.arange(n), labs)
    loss.backward()
    return loss.item(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("over", [{}, {"qkv_bias": True, "qk_norm": True}], ids=["plain", "bias-qknorm"])
def test_every_policy_and_the_tiled_mlp_run_the_adapters(over):
    """float64: each checkpoint policy, tiled or not, gives none's loss and adapter gradients; the
    frozen base gets none."""
    a, m = _lora_model(**over)
    want, wgrads = _loss_grads(m, a)
    assert wgrads and all(lora.is_adapter(n) for n in wgrads)
    for policy in POLICIES:
        for chunk in (0, 8):
            mm = copy.deepcopy(m)
            for b in mm.layers:
                b.policy, b.mlp_chunk = policy, chunk
            got, grads = _loss_grads(mm, a)
            assert abs(got - want) <= 1e-12 * abs(want), (policy, chunk)
            assert grads.keys() == wgrads.keys()
            for n in grads:
                assert rel_err(grads[n], wgrads[n]) <= 1e-10, (policy, chunk, n)


def test_dropout_is_replayed_by_recomputing_policies():
    """With dropout the loss depends on the masks: full, selective and full-offload (torch's
    checkpoint) and the tiled MLP (its own) replay them in backward, so the gradients are those of
    the forward that ran; pointwise refuses."""
    a, m = _lora_model(dropout=0.3)
    m.train()
    want, wgrads = _loss_grads(m, a, seed=3)
    nodrop = copy.deepcopy(m)
    for b in nodrop.modules():
        if isinstance(b, lora.LoraLinear):
            b.p = 0.0
    assert abs(_loss_grads(nodrop, a)[0] - want) > 1e-6  # the masks count
    assert abs(_loss_grads(m, a, seed=4)[0] - want) > 1e-6
    for policy in ("full", "selective", "full-offload"):
        mm = copy.deepcopy(m)
        for b in mm.layers:
            b.policy = policy
        got, grads = _loss_grads(mm, a, seed=3)
        assert abs(got - want) <= 1e-12 * abs(want), policy
        assert all(rel_err(grads[n], wgrads[n]) <= 1e-10 for n in grads), policy
    tiled = {}
    for policy in ("none", "full"):
        mm = copy.deepcopy(m)
        for b in mm.layers:
            b.policy, b.mlp_chunk = policy, 8
        tiled[policy] = _loss_grads(mm, a, seed=3)
    assert abs(tiled["full"][0] - tiled["none"][0]) <= 1e-12 * abs(tiled["none"][0])
    assert all(rel_err(tiled["full"][1][n], tiled["none"][1][n]) <= 1e-10 for n in wgrads)
    mm = copy.deepcopy(m)
    for b in mm.layers:
        b.policy = "pointwise"
    with pytest.raises(ValueError, match="pointwise checkpointing policy cannot run LoRA dropout"):
        _loss_grads(mm, a)


def test_auto_plan_with_dropout_avoids_policies_that_do_not_replay():
    a = PRESETS["tiny"]
    from burstengine.model import recompute as C

    per = {k: v * 64 for k, v in C.activation_bytes(a, 8).items()}
    for dropout, banned in ((0.0, set()), (0.1, {"sequence", "pointwise", "offload"})):
        m = Transformer(a, checkpoint="auto", offload_budget=1 << 40)
        lora.apply(m, lora.LoraArgs(rank=2, dropout=dropout))
        for budget in range(0, 2 * per["none"] + 1, max(1, per["none"] // 16)):
            m.activation_budget = budget
            plan = m.plan_checkpointing(64, 8, torch.device("cpu"))
            assert not set(plan) & banned, (dropout, budget, plan)


# --- the trainer: packed documents, instruction data, the CPU offload option ---------------------

@pytest.mark.parametrize("world", [1, 2])
def test_packed_documents_and_first_loss(pool, models, tokens, world):
    """A fresh adapter (B = 0) leaves the model unchanged: the first loss with packed documents
    equals the base's, and only adapters get gradients (B's only)."""
    extra = ["doc_mask=true", "eos_id=3", f"cp={world}", "layout=zigzag"]
    base = pool.run(fc.first_loss, models["mistral"], tokens, 56, extra, world=world)[0]
    got = pool.run(fc.first_loss, models["mistral"], tokens, 56, extra + ["lora.rank=4"], world=world)[0]
    assert got[0] == base[0] and got[2] > 0


def test_instruction_format(pool, corpus_dir):  # noqa: F811
    data = str(corpus_dir / "inst.jsonl")
    base = small_text(corpus_dir, "data_format=instruct", "prompt_field=q", "completion_field=a", "cp=2",
                      "warmup_steps=0", "lr=1e-2")
    want = pool.run(tc.accum_step, data, base, world=2)[0]
    loss, grads, after = pool.run(tc.accum_step, data, base + ["lora.rank=2", "lora.targets=q_proj,down_proj"],
                                  world=2)[0]
    assert loss == want[0]
    assert sorted({n.split(".")[-3] for n in grads}) == ["w2", "wq"] and all(lora.is_adapter(n) for n in grads)
    assert any(g.abs().max() > 0 for n, g in grads.items() if ".lora_B." in n)
    cfg = tc.small_config(base + ["lora.rank=2", "lora.targets=q_proj,down_proj"], data)
    start = lora.apply(Transformer(cfg.model), cfg.lora)
    start.init_weights(cfg.seed)
    moved = {n for n, p in start.named_parameters() if not torch.equal(after[n], p.detach())}
    assert moved and all(".lora_B." in n for n in moved)  # the step moved B only (A's gradient was zero)


def test_cpu_offload_trains_equal(pool, models, tokens):
    """cpu_offload=true on CPU ranks: the same losses and adapter gradients step after step (FSDP2
    keeps the shards where they are), the optimizer's states on the host."""
    plain = pool.run(lc.trainer_steps, models["llama"], tokens, 48, 2, ["cp=2"], world=2)[0]
    off = pool.run(lc.trainer_steps, models["llama"], tokens, 48, 2, ["cp=2", "cpu_offload=true"], world=2)[0]
    for (l0, g0), (l1, g1) in zip(plain[0], off[0]):
        assert l0 == l1 and all(torch.equal(g0[n], g1[n]) for n in g0)
    assert set(off[5]) == {"cpu"}


# --- configuration ------------------------------------------------------------------------------

@pytest.mark.parametrize("over,msg", [
    (["lora.rank=-1"], "lora.rank must be >= 0"),
    (["lora.rank=4", "lora.alpha=0"], "lora.alpha must be a finite number > 0"),
    (["lora.rank=4", "lora.dropout=1"], r"lora.dropout must be in \[0, 1\)"),
    (["lora.rank=4", "lora.targets=wq,embed"], "lora.targets must name some of"),
    (["lora.rank=4", "lora.targets="], "lora.targets must name some of"),
    (["lora.rank=4", "lora.dropout=0.1", "activation_checkpoint=pointwise"], "lora.dropout=0.1 needs a checkpoint"),
    (["lora.rank=4", "lora.dropout=0.1", "activation_checkpoint=sequence"], "does not: use none, full, selective"),
    (["tiled_mlp=yes"], "tiled_mlp must be one of"),
    (["tiled_mlp_chunk=0"], "tiled_mlp_chunk must be >= 1"),
])
def test_config_refusals(over, msg):
    with pytest.raises(ValueError, match=msg) as e:
        load("tiny", over)
    assert "\n" not in str(e.value)


def test_lora_table_in_toml(tmp_path):
    from burstengine.train.config import to_toml

    cfg = load("tiny", ["lora.rank=8", "lora.alpha=32", "lora.targets=q_proj,v_proj", "tiled_mlp=on"])
    assert cfg.lora.target_list() == ["wq", "wv"]
    f = tmp_path / "c.toml"
    f.write_text(to_toml(cfg))
    assert "[lora]" in f.read_text() and load(str(f)) == cfg
    f.write_text('base = "tiny"\n[lora]\nrank = 2\nalpha = 4\n')
    assert load(str(f)).lora.scale == 2.0
    with pytest.raises(ValueError, match="did you mean 'lora.rank'"):
        load("tiny", ["lora.rnak=2"])


@pytest.mark.parametrize("policy", ["sequence", "full-offload", "pointwise"])
def test_trainer_policies_with_lora_across_cp_ranks(pool, policy):
    """Across a CP ring of 2 (sequence checkpointing's own ring included), adapters under each
    policy get none's gradients."""
    extra = ["cp=2", "lora.rank=2", "tiled_mlp=off"]
    want = pool.run(tc.loss_and_grads, None, extra + ["activation_checkpoint=none"], world=2)[0]
    got = pool.run(tc.loss_and_grads, None, extra + [f"activation_checkpoint={policy}"], world=2)[0]
    assert abs(got[0] - want[0]) <= 1e-6 * abs(want[0])
    assert got[1].keys() == want[1].keys() and all(lora.is_adapter(n) for n in got[1])
    assert all(rel_err(got[1][n], want[1][n]) <= 1e-5 for n in want[1])


def test_lora_flops_count_no_weight_gradients_of_the_base():
    """MFU of a LoRA run: its frozen base costs forward + input gradients (4 x params), the
    adapters 6 x theirs; attention is unchanged."""
    from burstengine.model import PRESETS

    a = PRESETS["llama-8b"]
    dense = a.flops_per_token(0)
    assert a.flops_per_token(0, frozen=True, trained=1000) == dense * 4 / 6 + 6000
    assert a.flops_per_token(4096, frozen=True) - a.flops_per_token(0, frozen=True) == \
        a.flops_per_token(4096) - dense
