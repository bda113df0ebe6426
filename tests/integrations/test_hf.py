"""transformers drop-in: a tiny LlamaForCausalLM loaded with attn_implementation="burst" inside a
gloo context-parallel group gives the eager model's logits and parameter gradients (fp32),
for worlds 1, 2, 4 and every layout; bad uses raise the same ValueError on every rank."""
import pytest

pytest.importorskip("transformers")

import hf_cases  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    path = hf_cases.save_tiny_llama(root / "llama")
    hf_cases.save_tiny_mistral(root / "mistral")
    return path


CASES = [(1, "contiguous", "context")] + [(w, layout, "context") for w in (2, 4)
                                          for layout in ("contiguous", "zigzag", "striped")] + [(2, "zigzag", "configure")]


@pytest.mark.parametrize("world,layout,setup", CASES)
def test_burst_model_matches_eager(pool, tiny_llama, world, layout, setup):
    for rank, (errs, fwd_bytes, want) in enumerate(pool.run(hf_cases.hf_vs_eager, tiny_llama, layout, 7 + world,
                                                            setup=setup, world=world)):
        worst = max(errs, key=errs.get)
        assert errs[worst] < 2e-5, (rank, worst, errs[worst], errs["logits"])
        assert len(errs) == 1 + 3 + 2 * 9  # logits; embed, lm_head, final norm; 9 tensors per layer, 2 layers
        assert fwd_bytes == want, (rank, fwd_bytes, want)  # K/V travel with 2 kv heads: no GQA expansion


MASKED = [("mistral", 1, "contiguous", None), ("mistral", 2, "zigzag", None), ("mistral", 2, "striped", (0, 5, 24)),
          ("llama", 1, "contiguous", (0, 5, 6, 24)), ("llama", 2, "zigzag", (0, 5, 6, 24)),
          ("llama", 2, "contiguous", (0, 13, 24))]


@pytest.mark.parametrize("model,world,layout,docs", MASKED)
def test_window_and_packed_documents_match_eager(pool, tiny_llama, model, world, layout, docs):
    """Mistral's sliding window (4 keys) and packed documents (position_ids restarting per
    document; transformers' eager model masks across them itself) give the eager model's logits
    and gradients; the boundaries cross shards, one document is one token."""
    path = tiny_llama.replace("llama", model)
    seq = 24 // world
    for rank, (errs, _, _) in enumerate(pool.run(hf_cases.hf_vs_eager, path, layout, 3 + world, seq_per_rank=seq,
                                                 docs=docs, world=world)):
        worst = max(errs, key=errs.get)
        assert errs[worst] < 2e-5, (rank, worst, errs[worst], errs["logits"])


BAD = {
    "padding_on_last_rank": "does not support padding: the attention_mask has zeros on rank(s) [{last}]",
    "local_positions": "are not the global positions of layout 'zigzag'",
    "no_positions": "are not the global positions of layout 'zigzag'",
    "wrong_layout": "are not the global positions of layout 'striped'",
    "uneven_shards": "ranks hold shards of different shapes",
    "no_context": "wrap the forward in burstengine.integrations.hf.burst_context",
    "rows_differ": "the rows of the batch pack documents at different boundaries",
    "positions_jump": "position_ids on rank(s) [1] are not the global positions of layout 'zigzag'",
    "decode_step": "decodes against a cache in one process only",
    "bad_layout_name": "unknown layout 'diagonal'",
    "plain_labels": "labels= would be shifted inside this rank's shard",
    "output_attentions": "does not support output_attentions=True",
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_use_raises_on_every_rank(pool, tiny_llama, case):
    world = 4 if case in ("padding_on_last_rank", "uneven_shards") else 2
    msgs = pool.run(hf_cases.bad_hf_call, tiny_llama, case, world=world)
    want = BAD[case].format(last=world - 1)
    for rank, m in enumerate(msgs):
        assert want in m, (rank, m)
    assert len(set(msgs)) == 1, msgs  # the same message everywhere
    # and the pool is still in step: a good call right after works on the same ranks
    for errs, _, _ in pool.run(hf_cases.hf_vs_eager, tiny_llama, "zigzag", 1, world=world):
        assert errs["logits"] < 2e-5


def test_loss_from_shift_labels_is_exact(pool, tiny_llama):
    """Pre-shifted labels (the call the plain-labels refusal shows) give the eager model's loss."""
    for rank, err in enumerate(pool.run(hf_cases.hf_loss_exact, tiny_llama, world=2)):
        assert err < 1e-6, (rank, err)


@pytest.mark.parametrize("model", ["llama", "mistral"])
def test_generate_in_one_process_equals_eager(tiny_llama, model):
    """model.generate() under "burst": the prefill through the ring's kernels, each decoding
    step plain attention over transformers' cache; greedy tokens and the steps' scores equal
    the eager model's, past Mistral's 4-key window too."""
    import torch

    path = tiny_llama.replace("llama", model)
    ids = torch.randint(0, hf_cases.VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=7, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    want = hf_cases.load(path, "eager").generate(ids, **kw)
    got = hf_cases.load(path, "burst").generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        assert (a - b).abs().max() < 2e-5


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_the_refusals_recipe_runs_as_printed(pool, tiny_llama, layout):
    """The shift_labels call the plain-labels refusal prints, run as printed, with batch > 1 in
    every layout, gives the eager model's loss (it crashed in transformers for contiguous shards,
    which are views, without .contiguous())."""
    for rank, err in enumerate(pool.run(hf_cases.shift_recipe_loss, tiny_llama, layout, world=2)):
        assert err < 1e-6, (rank, err)


def test_eager_loss_after_a_burst_forward_is_not_refused(pool, tiny_llama):
    for rank, (eager, burst) in enumerate(pool.run(hf_cases.eager_loss_after_burst, tiny_llama, world=2)):
        assert not isinstance(eager, str) and eager < 1e-6, (rank, eager)
        assert "labels= would be shifted inside this rank's shard" in burst, (rank, burst)
