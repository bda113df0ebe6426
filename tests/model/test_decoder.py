"""The one decoder loop (burstengine/model/decoder.py): training's forward, prefill (whole and
chunked, a batch of prompts of different lengths) and every decode step of generation give the
same float64 logits on the same weights, with and without a sliding window, GQA, q/k norms and
q/k/v biases."""
import pytest
import torch

from burstengine.inference import generate, prefill
from burstengine.inference.models import OurLlama, random_llama
from burstengine.model import ModelArgs
from burstengine.model.layers import NO_HOOKS

TOL = 1e-6  # float64 weights; prefill and decode give their logits in float32


def _model(window: int) -> OurLlama:
    a = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=96, window=window,
                  qk_norm=True, qkv_bias=True)
    m = random_llama(a, "cpu", torch.float64, seed=3)
    with torch.no_grad():  # init_weights zeroes biases and sets norms to one: make them count
        g = torch.Generator().manual_seed(4)
        for n, p in m.named_parameters():
            if n.endswith(".bias") or n.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    return OurLlama(m, "decoder test")


def _train_logits(model: OurLlama, tokens: list[int]) -> torch.Tensor:
    """Training's forward (no hooks, autograd on) over one whole sequence: (n, vocab) logits."""
    m = model.model
    h = m(torch.tensor([tokens]), torch.arange(len(tokens)))
    return m.logits(h[0]).detach()


def _close(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("window", [0, 6])
def test_training_prefill_and_decode_run_one_loop(window):
    model = _model(window)
    g = torch.Generator().manual_seed(5)
    lengths = [23, 17]
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in lengths]
    ids = torch.zeros(2, max(lengths), dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p)

    # prefill, whole and chunked, of the padded batch: each sequence's logits at its own last token,
    # the same K/V to the sink as kept
    kv_sunk = {}
    whole = prefill(model, ids, layout="contiguous", keep_kv=True, lengths=lengths)
    chunked = prefill(model, ids, layout="contiguous", lengths=lengths, chunk=5,
                      kv_sink=lambda i, k, v: kv_sunk.__setitem__(i, (k.clone(), v.clone())))
    for b, p in enumerate(prompts):
        want = _train_logits(model, p)[-1]
        assert _close(whole.logits[b].double(), want) < TOL, (window, b)
        assert _close(chunked.logits[b].double(), want) < TOL, (window, b)
    for i, (k, v) in enumerate(whole.kv):
        assert _close(kv_sunk[i][0], k) < 1e-12 and _close(kv_sunk[i][1], v) < 1e-12  # float64

    # every decode step's logits: training's over the prompt and the tokens chosen so far
    seen = []
    out = generate(model, prompts, 5, on_logits=lambda i, x: seen.append(x.clone()))
    assert len(seen) == 5
    for b, p in enumerate(prompts):
        full = _train_logits(model, p + out.tokens[b][:-1])
        for i, logits in enumerate(seen):
            assert _close(logits[b].double(), full[len(p) - 1 + i]) < TOL, (window, b, i)
    assert all(blk.hooks is NO_HOOKS for blk in model.model.layers)  # a run's hooks end with it
