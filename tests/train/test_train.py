"""The training stack on CPU/gloo: exact loss and gradients under every dp x cp split and layout
against a float64 single-process model, checkpoint policies and chunked loss, resume equality,
a save killed mid-way, data labels at shard edges, config errors, the CLI and the plot."""
import json
import os

import numpy as np
import pytest
import torch

import cli_cases
import train_cases as tc
from burstengine.layout import LAYOUTS, position_ids, shard, unshard
from burstengine.model import Transformer
from burstengine.testing import rel_err
from burstengine.train import data as D
from burstengine.train import load

TOL = 1e-5


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tokens.bin"
    np.random.default_rng(0).integers(0, 64, size=4000, dtype=np.uint16).tofile(path)
    return str(path)


def reference(data, dp, extra=()):
    """float64 loss and gradients of the same model on the whole batch, one process, no CP."""
    cfg = tc.small_config(extra, data)
    model = Transformer(cfg.model, loss=cfg.loss).double()
    model.init_weights(cfg.seed)
    toks, labs, _ = D.global_sequences(D.make_source(cfg), range(cfg.batch_size * dp))
    loss_sum = model(toks, torch.arange(cfg.seq_len), labs)
    loss = loss_sum / (labs != D.IGNORE).sum()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def check_same(got, ref):
    loss, grads = got
    rloss, rgrads = ref
    assert abs(loss - rloss) <= TOL * abs(rloss), (loss, rloss)
    assert grads.keys() == rgrads.keys()
    worst = max((rel_err(grads[n], rgrads[n]), n) for n in grads)
    assert worst[0] <= TOL, worst
    # a test that cannot fail is a defect: the gradients are not trivially zero
    assert all(rgrads[n].abs().max() > 0 for n in rgrads)


MESHES = [(1, 1, "contiguous"), (2, 1, "contiguous")] + [(dp, cp, lay) for dp, cp in ((1, 2), (1, 4), (2, 2))
                                                        for lay in LAYOUTS]


@pytest.mark.parametrize("dp,cp,layout", MESHES)
def test_loss_and_grads_match_single_process(pool, token_file, dp, cp, layout):
    extra = [f"cp={cp}", f"layout={layout}"]
    got = pool.run(tc.loss_and_grads, token_file, extra, world=dp * cp)[0]
    check_same(got, reference(token_file, dp))


@pytest.mark.parametrize("dp,cp", [(2, 1), (1, 2)])
def test_gradients_from_the_compute_pool_are_fsdps_own(pool, token_file, dp, cp):
    """grads_on_compute (the default) swaps FSDP2's reduce-scatter for ours on every unit: the same
    loss, gradients and parameters after an accumulated step, bit for bit, as FSDP's own."""
    extra = [f"cp={cp}", "grad_accum=2", "grad_clip=0"]
    ours = pool.run(tc.grad_comm_step, token_file, extra, world=dp * cp)[0]
    theirs = pool.run(tc.grad_comm_step, token_file, extra + ["grads_on_compute=false"], world=dp * cp)[0]
    assert ours[3] == ["ComputePoolReduceScatter"] and theirs[3] == ["DefaultReduceScatter"]
    # two layers and the root, each reduced once per micro-batch in both the gradients' pass and the step
    assert ours[4] >= 2 * 3 and theirs[4] == 0
    assert ours[0] == theirs[0]
    for n in theirs[1]:
        assert torch.equal(ours[1][n], theirs[1][n]), n
        assert torch.equal(ours[2][n], theirs[2][n]), n
    assert all(g.abs().max() > 0 for g in theirs[1].values())


@pytest.mark.parametrize("world,extra,want", [(2, ["cp=1"], "local"), (2, ["cp=1", "attention=sdpa"], "sdpa"),
                                              (2, ["cp=2"], "ring")])
def test_every_layer_runs_the_configured_attention(pool, world, extra, want):
    # attention=burst without a CP group (pure data parallel, or one GPU) runs BurstAttention's
    # kernels on a one-rank ring in every layer, whatever the layer's checkpointing policy:
    # before, a layer that kept everything fell back to SDPA
    got = pool.run(tc.attention_groups, extra + ["activation_checkpoint=none"], world=world)[0]
    assert got == [want] * len(got) and got


@pytest.mark.parametrize("extra", [["activation_checkpoint=full"], ["activation_checkpoint=selective"],
                                   ["activation_checkpoint=pointwise"], ["loss=chunked"]], ids=lambda e: e[0])
def test_checkpoint_policies_and_chunked_loss_are_exact(pool, token_file, extra):
    got = pool.run(tc.loss_and_grads, token_file, ["cp=2", "layout=striped"] + extra, chunk=5, world=2)[0]
    check_same(got, reference(token_file, 1))


@pytest.mark.parametrize("cp", [1, 2])
def test_offload_is_exact(pool, token_file, cp):
    # every saved tensor of every layer through host buffers (CPU: plain copies), FSDP over the
    # ranks, the ring (cp=2) or a one-rank ring per data-parallel rank (cp=1)
    got = pool.run(tc.loss_and_grads_offloading_all, token_file, [f"cp={cp}", "activation_checkpoint=offload"],
                   chunk=5, world=2)[0]
    check_same(got, reference(token_file, 2 // cp))


def test_passkey_labels_only_answer_and_global_mean(pool):
    # ignored labels everywhere but the answer, which zigzag puts on rank 0 and contiguous on
    # the last rank: the global mean must still be exact
    for layout in ("zigzag", "contiguous"):
        got = pool.run(tc.loss_and_grads, None, ["cp=4", f"layout={layout}"], world=4)[0]
        check_same(got, reference(None, 1))


def test_resume_continues_exactly(pool, tmp_path):
    extra = ["cp=2", "save_every=2", "layout=zigzag"]
    full = pool.run(tc.run_steps, str(tmp_path / "a"), 4, extra, world=4)[0]
    pool.run(tc.run_steps, str(tmp_path / "b"), 4, extra, stop_after=2, world=4)
    resumed = pool.run(tc.run_steps, str(tmp_path / "b"), 4, extra, resume=True, world=4)[0]
    a = {r["step"]: r["loss"] for r in full}
    b = {r["step"]: r["loss"] for r in resumed[2:]}  # records after the resume
    assert sorted(b) == [3, 4]
    for s in (3, 4):
        assert b[s] == pytest.approx(a[s], rel=1e-6, abs=0), (s, a, b)
    assert a[4] != a[3]


# --- data ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_labels_at_shard_edges(layout, cp):
    S = 16
    src = D.TokenStream(np.arange(1000) % 997, S, seed=3)
    toks, labs, _ = D.global_sequences(src, range(3))
    full = torch.stack([torch.from_numpy(src.sample(i)[0]) for i in range(3)])
    for r in range(cp):
        b = D.shard_batch(toks, labs, [0.0] * 3, layout, r, cp, "cpu")
        pos = position_ids(S, layout, r, cp)
        assert torch.equal(b.positions, pos)
        # every position's label is the global next token, wherever that token lives
        assert torch.equal(b.labels, full[:, pos + 1])
        assert torch.equal(b.tokens, full[:, pos])
    parts = [shard(labs, layout, r, cp) for r in range(cp)]
    assert torch.equal(unshard(parts, layout), full[:, 1:])


def test_token_stream_packs_windows_once_per_epoch():
    S = 10
    src = D.TokenStream(np.arange(101), S, seed=1)
    assert src.windows == 10
    starts = sorted(int(src.sample(i)[0][0]) for i in range(10))
    assert starts == list(range(0, 100, S))          # each window once per epoch
    t, lab, _ = src.sample(0)
    assert len(t) == S + 1 and np.array_equal(lab, t[1:])
    order0 = [int(src.sample(i)[0][0]) for i in range(10)]
    order1 = [int(src.sample(10 + i)[0][0]) for i in range(10)]
    assert order0 != order1                          # reshuffled per epoch
    assert order0 == [int(D.TokenStream(np.arange(101), S, seed=1).sample(i)[0][0]) for i in range(10)]


def test_passkey_sample_structure():
    S, L, K = 96, 3, 8
    p = D.Passkey(seq_len=S, vocab=40, key_len=L, symbols=K, seed=0)
    sentence = p.sentence.tolist()
    depths = []
    for i in range(50):
        t, lab, depth = p.sample(i)
        depths.append(depth)
        at = int(np.where(t == D.KEY)[0][0])
        key = t[at + 1:at + 1 + L]
        q = S - L - 1
        assert t[0] == D.BOS and len(set(key.tolist())) == L
        assert ((key >= D.FIRST_SYMBOL) & (key < D.FIRST_SYMBOL + K)).all()
        assert t[q] == D.QUERY and t[q + 1] == D.KEY and np.array_equal(t[-L:], key)
        # the filler is the fixed sentence, repeated from some phase: no information in it
        filler = t[1:at].tolist()
        if len(filler) > len(sentence):
            assert any(filler == (sentence[ph:] + sentence * 10)[:len(filler)] for ph in range(len(sentence)))
        assert (np.delete(t, [0, at, *range(at + 1, at + 1 + L), *range(q, S + 1)]) >= D.FIRST_SYMBOL + K).all()
        # only the answer is labelled, with the next token
        have = np.where(lab != D.IGNORE)[0]
        assert have.tolist() == list(range(q + 1, S)) and np.array_equal(lab[have], key)
    assert min(depths) < 0.2 and max(depths) > 0.8
    assert not np.array_equal(p.sample(0)[0], p.sample(0, stream=1)[0])  # held-out stream differs


def test_jsonl_with_local_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    from burstengine.train import corpus

    docs = ["the cat sat on the mat", "a dog ran far away", "the end of the story"]
    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.WordLevelTrainer(special_tokens=["<unk>", "<|endoftext|>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    with open(tmp_path / "d.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    over = [f"data={tmp_path / 'd.jsonl'}", f"tokenizer={tmp_path / 'tokenizer.json'}", "seq_len=8",
            f"data_cache={tmp_path / 'cache'}"]
    ids = np.asarray(corpus.prepare(load("tiny", over)).tokens)
    # no config file beside it: EOS is the tokenizer's special end-of-text token
    eos = tok.token_to_id("<|endoftext|>")
    assert ids.tolist().count(eos) == 3 and ids[-1] == eos
    assert ids[:6].tolist() == tok.encode(docs[0]).ids
    assert D.make_source(load("tiny", over)).windows == (len(ids) - 1) // 8
    with open(tmp_path / "bad.jsonl", "w") as f:
        f.write('{"txt": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        corpus.prepare(load("tiny", over + [f"data={tmp_path / 'bad.jsonl'}"]))


# --- config -------------------------------------------------------------------------------------

@pytest.mark.parametrize("over,msg", [
    (["stepz=3"], "did you mean 'steps'"),
    (["model.n_headz=2"], "did you mean 'model.n_heads'"),
    (["steps=ten"], "'steps' expects int"),
    (["progress=maybe"], "'progress' expects bool"),
    (["model=3"], "is a table"),
    (["steps"], "key=value"),
    (["layout=spiral"], "layout must be one of"),
    (["activation_checkpoint=some"], "activation_checkpoint must be one of"),
    (["loss=fancy"], "loss must be one of"),
    (["lr=-1"], r"lr must be in \[0, 1\]"),
    (["lr=1e30"], r"lr must be in \[0, 1\]"),
    (["model.n_kv_heads=3"], "multiple of model.n_kv_heads"),
    (["data=/no/such.bin"], "no such file"),
    (["grad_accum=0"], "grad_accum must be >= 1"),
    (["eos_id=-2"], "eos_id must be >= 0"),
    (["model.vocab_size=16"], "vocab_size >= 38"),
])
def test_config_errors(over, msg):
    with pytest.raises(ValueError, match=msg):
        load("tiny", over)


def test_config_toml_and_world(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('base = "tiny"\nsteps = 7\nlr = 1\n[model]\nn_layers = 3\n')
    cfg = load(str(p), ["model.dim=64"])
    assert (cfg.steps, cfg.lr, cfg.model.n_layers, cfg.model.dim) == (7, 1.0, 3, 64)
    assert load("llama-8b").model.n_kv_heads == 8 and load("llama-14b").model.n_layers == 40
    for text, msg in [('steps = "7"\n', "'steps' expects int"), ("[optim]\nlr = 1\n", "unknown config table"),
                      ('base = "huge"\n', "unknown preset"), ("steps = \n", "c.toml")]:
        p.write_text(text)
        with pytest.raises(ValueError, match=msg):
            load(str(p))
    with pytest.raises(ValueError, match="unknown preset"):
        load("llama-70b")
    cfg = load("tiny", ["seq_len=36", "cp=0"])
    with pytest.raises(ValueError, match="not divisible by 8"):
        cfg.check_world(4)
    with pytest.raises(ValueError, match="does not divide"):
        load("tiny", ["cp=3"]).check_world(4)
    assert load("tiny", ["cp=2"]).check_world(4) == (2, 2)


# --- CLI ----------------------------------------------------------------------------------------

def _cli(*argv, env_extra=None):
    """``burstengine ARGV`` (in this process: tests/cli_cases.py); exit code, stdout + stderr."""
    rc, out, err = cli_cases.run(argv, env=env_extra)
    return rc, out + err


def test_cli_train_killed_in_save_then_resume_and_plot(tmp_path):
    """A rank killed while saving step 4 leaves step 2 as the latest checkpoint; --resume from it
    reproduces the losses the killed run logged for steps 3 and 4; then the plot."""
    run = tmp_path / "run"
    args = ["train", "--config", "tiny", "--world", "2"] + [a for s in tc.SMALL + [
        "passkey_symbols=8", "passkey_len=3", "steps=4", "save_every=2", "eval_every=2", "eval_samples=4",
        f"out_dir={run}"] for a in ("--set", s)]
    rc, out = _cli(*args, env_extra={"BURST_FAULT_KILL_IN_SAVE": "4"})
    assert rc == 1, out
    assert "rank 0 was killed by SIGKILL" in out and "last complete checkpoint is" in out, out
    ck = sorted(os.listdir(run / "checkpoints"))
    assert ck == ["step_00000002", "step_00000004.tmp"], ck
    rc, out = _cli(*args)
    assert rc == 2 and "--resume" in out, out               # refuses to clobber the run
    killed = [json.loads(line) for line in open(run / "metrics.jsonl")]
    killed = {r["step"]: r["loss"] for r in killed if r["kind"] == "step"}
    assert sorted(killed) == [1, 2, 3, 4]
    rc, out = _cli(*args, "--resume", "--record", "rec", env_extra={"BURST_RESULTS": str(tmp_path)})
    assert rc == 0, out
    assert "resumed from" in out and "step_00000002" in out
    # on CPU the log says what its figures are: per rank (a process), the peak resident set
    assert "tok/s/rank" in out and "peak rss" in out and "peak_rss_gib=" in out and "per_s_per_gpu" not in out, out
    assert "tok/s/gpu" not in out, out
    rec = json.loads((tmp_path / "rec.json").read_text())
    assert rec["summary"]["steps"] == 4 and rec["config"]["steps"] == 4 and "--resume" in rec["command"]
    recs = [json.loads(line) for line in open(run / "metrics.jsonl")]
    steps = [r for r in recs if r["kind"] == "step"]
    # the lines the killed run logged past its checkpoint were dropped on resume: each step once
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["loss"] for r in steps] == pytest.approx([killed[s] for s in (1, 2, 3, 4)], rel=1e-6)
    assert [r["step"] for r in recs if r["kind"] == "eval"] == [2, 4]
    summary = recs[-1]
    assert summary["kind"] == "summary" and summary["cp"] == 2 and "eval" in summary
    assert sorted(os.listdir(run / "checkpoints")) == ["step_00000002", "step_00000004"]
    for r in steps:
        assert r["tokens_per_s_per_gpu"] > 0 and r["peak_mem_gib"] > 0 and r["mfu"] is None

    pytest.importorskip("matplotlib")
    rc, out = _cli("plot", str(run / "metrics.jsonl"))
    assert rc == 0, out
    png = run / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_bad_config_before_spawning():
    rc, out = _cli("train", "--set", "model.dimm=3")
    assert rc == 2 and "did you mean 'model.dim'" in out
    rc, out = _cli("train", "--world", "3")
    assert rc == 2 and "does not divide" in out
