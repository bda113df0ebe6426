"""A synthetic family with Phi-3's fused tensors (its table: q/k/v in one ``qkv_proj``, gate and up
in one ``gate_up_proj``) on the Llama-like model, an HF directory of it, and the sharded load run inside
the gloo pool (tests/model/test_families.py)."""
import torch
import torch.distributed as dist

from burstengine.model import ModelArgs, Transformer
from burstengine.model.families import registry
from burstengine.model.families.llama import Llama
from burstengine.model.families.phi3 import FUSED
from burstengine.model.families.table import Table

# a shape whose fused parts do not split evenly over 3 ranks, with GQA (q rows != k rows)
ARGS = dict(dim=96, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=200, vocab_size=80)


class FusedLlama(Llama):
    """Llama's config with Phi-3's weight table (written as LlamaForCausalLM: only ours reads it)."""

    table = Table(FUSED)


def args() -> ModelArgs:
    return ModelArgs(**ARGS)


def model(seed=0) -> Transformer:
    m = Transformer(args())
    m.init_weights(seed)
    return m


def use_fused(monkeypatch=None):
    """Put the fused family in the registry under "llama" (the test's monkeypatch, or for the
    rest of a pool worker's life: the caller restores it with the returned function)."""
    if monkeypatch is not None:
        monkeypatch.setitem(registry.FAMILIES, "llama", FusedLlama())
        return None
    old = registry.FAMILIES["llama"]
    registry.FAMILIES["llama"] = FusedLlama()
    return lambda: registry.FAMILIES.__setitem__("llama", old)


class _Counted:
    """A safetensors file whose slices log the bytes each read returns."""

    def __init__(self, f, log: list):
        self.f, self.log = f, log

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_slice(self, name):
        sl, log = self.f.get_slice(name), self.log

        class Slice:
            def get_shape(self):
                return sl.get_shape()

            def __getitem__(self, index):
                t = sl[index]
                log.append(t.numel() * t.element_size())
                return t

        return Slice()


def sharded_load(group, path, seed):
    """Load ``path`` into an FSDP2-sharded model on this group: (whether every rank's shard equals
    those rows of the unsharded reference, bytes this rank's reads returned, read_gib it reported)."""
    import safetensors

    from burstengine.model.hf_dir import load_weights, local_rows
    from burstengine.train.parallel import build_mesh, parallelize

    restore, opened, log = use_fused(), safetensors.safe_open, []
    safetensors.safe_open = lambda *a, **k: _Counted(opened(*a, **k), log)
    try:
        world = dist.get_world_size(group)
        m = build_mesh(world, 1, torch.device("cpu"), group)
        with torch.device("meta"):
            ours = Transformer(args())
        parallelize(ours, m, precision="fp32")
        ours.to_empty(device="cpu")
        stats = load_weights(ours, path)
        ref = dict(model(seed).named_parameters())
        same = True
        for name, p in ours.named_parameters():
            local, lo, hi = local_rows(p)
            same &= torch.equal(local, ref[name].detach()[lo:hi])
        return same, sum(log), stats["read_gib"] * 2 ** 30
    finally:
        safetensors.safe_open = opened
        restore()


def phi3_style(m: Transformer) -> dict:
    """``m``'s weights under the fused names, concatenated by hand (the oracle the table must match)."""
    sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"],
           "lm_head.weight": sd["output.weight"]}
    for i in range(m.args.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        out[hf + "input_layernorm.weight"] = sd[ours + "attention_norm.weight"]
        out[hf + "self_attn.qkv_proj.weight"] = torch.cat([sd[ours + f"attention.{w}.weight"] for w in ("wq", "wk", "wv")])
        out[hf + "self_attn.o_proj.weight"] = sd[ours + "attention.wo.weight"]
        out[hf + "post_attention_layernorm.weight"] = sd[ours + "ffn_norm.weight"]
        out[hf + "mlp.gate_up_proj.weight"] = torch.cat([sd[ours + "feed_forward.w1.weight"],
                                                         sd[ours + "feed_forward.w3.weight"]])
        out[hf + "mlp.down_proj.weight"] = sd[ours + "feed_forward.w2.weight"]
    return out


def write_phi3_style(path, seed=3) -> dict:
    """An HF directory of ``model(seed)`` with fused tensors, in two files with an index; returns its tensors."""
    from burstengine.model.hf_dir import hf_config_from_args, write_hf_dir

    tensors = phi3_style(model(seed))
    names = sorted(tensors)
    halves = [{k: tensors[k] for k in names[:len(names) // 2]}, {k: tensors[k] for k in names[len(names) // 2:]}]
    write_hf_dir(str(path), hf_config_from_args(args(), seq_len=0), halves, 2)
    return tensors
