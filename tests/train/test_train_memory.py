"""The memory features in the trainer: loss="fused" (fused LM head + cross-entropy) and
checkpoint="sequence" (sequence-level selective checkpointing) give the loss and gradients of
loss="naive" / checkpoint="none" on every dp x cp mesh and layout, and store what they say."""
import pytest
import torch

import train_cases as tc
from burstengine.layout import LAYOUTS
from burstengine.model import Transformer
from burstengine.model import PRESETS
from burstengine.testing import rel_err
from burstengine.train import load

# fp32 against fp32: only the order of the sums differs
TIGHT = 2e-6
BASE = ("naive", "none", 0.5)
VARIANTS = [BASE, ("fused", "none", 0.5)] + [("naive", "sequence", s) for s in (0.0, 0.25, 0.5, 1.0)] + [
    ("fused", "sequence", 0.75)]
MESHES = [(1, 1, "contiguous"), (2, 1, "contiguous"), (2, 2, "zigzag")] + [
    (1, cp, lay) for cp in (2, 4) for lay in LAYOUTS]


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    import numpy as np

    path = tmp_path_factory.mktemp("data") / "tokens.bin"
    np.random.default_rng(1).integers(0, 64, size=4000, dtype=np.uint16).tofile(path)
    return str(path)


@pytest.mark.parametrize("dp,cp,layout", MESHES)
def test_fused_loss_and_sequence_checkpointing_match(pool, token_file, dp, cp, layout):
    # chunks of 5 tokens: the fused loss runs several chunks and a ragged last one on each rank
    res = pool.run(tc.variants, token_file, [f"cp={cp}", f"layout={layout}"], VARIANTS, 5, world=dp * cp)[0]
    (ref_loss, ref_grads) = res[0]
    assert all(g.abs().max() > 0 for g in ref_grads.values())
    for v, (loss, grads) in zip(VARIANTS[1:], res[1:]):
        assert abs(loss - ref_loss) <= TIGHT * abs(ref_loss), (v, loss, ref_loss)
        worst = max((rel_err(grads[n], ref_grads[n]), n) for n in ref_grads)
        assert worst[0] <= TIGHT, (v, worst)


def test_passkey_answer_on_one_rank(pool):
    # only the answer is labelled, so under contiguous the other ranks have no token to count:
    # their fused loss is an empty sum with zero gradients, and the global mean stays exact
    res = pool.run(tc.variants, None, ["cp=4", "layout=contiguous"], [BASE, ("fused", "sequence", 0.5)], world=4)[0]
    (ref_loss, ref_grads), (loss, grads) = res
    assert abs(loss - ref_loss) <= TIGHT * abs(ref_loss)
    assert max(rel_err(grads[n], ref_grads[n]) for n in ref_grads) <= TIGHT


def test_config_path_against_float64(pool, token_file):
    # the same knobs through the config: against a float64 single-process model (no CP)
    from test_train import check_same, reference

    extra = ["cp=2", "layout=striped", "loss=fused", "activation_checkpoint=sequence", "activation_checkpoint_split=0.25"]
    got = pool.run(tc.loss_and_grads, token_file, extra, world=2)[0]
    check_same(got, reference(token_file, 1))


@pytest.mark.parametrize("split", [0.0, 0.5, 1.0])
def test_sequence_policy_stores_input_and_back_of_attention(split):
    """Per block: the input (B, n, dim) and the attention output (B, kept, H, D) and lse (B, H,
    kept) of the last round(split * n) tokens; nothing else is saved by the blocks."""
    a = PRESETS["tiny"]
    B, n = 2, 24
    model = Transformer(a, checkpoint="sequence", checkpoint_split=split)
    model.init_weights(0)
    x = torch.randn(B, n, a.dim, requires_grad=True)
    cos, sin = (torch.zeros(n, a.head_dim), torch.zeros(n, a.head_dim))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model.layers[0](x, cos, sin)
    y.sum().backward()
    kept = round(split * n)
    assert sum(saved) == 4 * (B * n * a.dim + B * kept * a.n_heads * a.head_dim + B * a.n_heads * kept)
    assert x.grad.abs().max() > 0


@pytest.mark.parametrize("over,msg", [
    (["activation_checkpoint_split=1.5"], "activation_checkpoint_split must be in"),
    (["activation_checkpoint_split=-0.1"], "activation_checkpoint_split must be in"),
    (["activation_checkpoint=sequence", "attention=torch-cp"], "attention='torch-cp' use"),
])
def test_config_errors(over, msg):
    with pytest.raises(ValueError, match=msg):
        load("tiny", over)


def test_model_rejects_bad_split():
    with pytest.raises(ValueError, match="checkpoint_split must be a number"):
        Transformer(PRESETS["tiny"], checkpoint="sequence", checkpoint_split=2)


@pytest.mark.parametrize("attention, offload, cpu_offload, want", [
    ("burst", True, False, ("full-offload", "offload")), ("burst", False, False, ("full-offload",)),
    ("torch-cp", True, False, ("full-offload",)), ("burst", True, True, ("full-offload",))])
def test_host_policies_follow_activation_offload_and_the_attention(attention, offload, cpu_offload, want):
    # on by default; torch-native CP's attention saves DTensors that stay on the device, so its
    # layers are never planned "offload" (the plan would count memory it does not free); nor with
    # the parameters and states on the host (cpu_offload), which the host budget does not count
    from types import SimpleNamespace

    from burstengine.train.loop import Trainer

    assert load("tiny", []).activation_offload is True
    cfg = load("tiny", [f"attention={attention}", f"activation_offload={str(offload).lower()}",
                        f"cpu_offload={str(cpu_offload).lower()}"])
    assert Trainer.host_policies(SimpleNamespace(cfg=cfg)) == want
