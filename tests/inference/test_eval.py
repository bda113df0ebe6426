"""`burstengine eval`: perplexity over windows equals transformers' loss on the same windows (one
process and two gloo ranks, non-overlapping and sliding); the command writes a record and a figure
that never replace earlier ones; needle prompts in the passkey task's own format."""
import json
import math
import os

import pytest
import torch

pytest.importorskip("transformers")

import cli_cases  # noqa: E402
import generate_cases as gc  # noqa: E402

TOL = 1e-6  # float32 prefill of a tiny model against float64 sums of transformers' float32 logits


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = gc.save_tiny(tmp_path_factory.mktemp("eval") / "llama", "llama", seed=3)
    gc.save_tokenizer(path)
    return path


def stream(n, seed=0):
    return torch.randint(0, gc.VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def hf_nll(path, tokens, length, stride):
    """transformers' summed loss and count over the windows of inputs tokens[a : a + length],
    each scoring its last `scored` next-token predictions."""
    from transformers import AutoModelForCausalLM

    from burstengine.inference.perplexity import windows

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for a, scored in windows(len(tokens), length, stride):
            logits = hf(input_ids=tokens[None, a:a + length]).logits[0, length - scored:].double()
            target = tokens[a + length - scored + 1:a + length + 1]
            nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
            count += scored
    return nll, count


def ours_nll(group, path, tokens, length, stride, batch, layout):
    from burstengine.inference.models import load_model
    from burstengine.inference.perplexity import perplexity

    r = perplexity(load_model(path, "ours"), tokens, length, stride, batch, group=group, layout=layout)
    return r["nll"], r["tokens"], r["ppl"]


def test_windows():
    from burstengine.inference.perplexity import windows

    assert windows(10, 4) == [(0, 4), (4, 4)]  # inputs 0-3 predict 1-4, inputs 4-7 predict 5-8
    assert windows(10, 4, 2) == [(0, 4), (2, 2), (4, 2)]  # then 5-6, then 7-8: each token once
    assert windows(10, 4, 2, limit=2) == [(0, 4), (2, 2)]
    with pytest.raises(ValueError, match="fewer than one window"):
        windows(4, 4)
    with pytest.raises(ValueError, match="stride"):
        windows(10, 4, 5)


@pytest.mark.parametrize("length,stride,batch", [(48, None, 1), (40, 12, 3)])
def test_perplexity_equals_transformers_loss(llama_dir, length, stride, batch):
    tokens = stream(200)
    want, count = hf_nll(llama_dir, tokens, length, stride)
    got, n, ppl = ours_nll(None, llama_dir, tokens, length, stride, batch, "zigzag")
    assert n == count and abs(got - want) <= TOL * want, (got, want)
    assert ppl == pytest.approx(math.exp(want / count), rel=TOL)


def test_perplexity_over_ranks_equals_one_process(pool, llama_dir):
    """Two ranks, a window length the zigzag layout pads (42 -> 44): the sum over the ranks is
    transformers' loss of the same windows."""
    tokens = stream(170, seed=1)
    want, count = hf_nll(llama_dir, tokens, 42, 10)
    for got, n, _ in pool.run(ours_nll, llama_dir, tokens, 42, 10, 2, "zigzag", world=2):
        assert n == count and abs(got - want) <= TOL * want, (got, want)


def _cli(*argv, cwd):
    """``burstengine ARGV`` run in ``cwd`` (in this process: tests/cli_cases.py); exit code, stdout, stderr."""
    return cli_cases.run(argv, cwd=cwd)


def test_perplexity_command(llama_dir, tmp_path):
    """Text through the model's tokenizer, 2 spawned ranks: one record per length with the
    loss transformers gives the same windows, a figure beside it, and a second run's files
    under new names in ./burst-results/perplexity."""
    from transformers import AutoTokenizer

    text = " ".join(f"The pass key is {i}. Remember it." for i in range(60))
    (tmp_path / "book.txt").write_text(text)
    argv = ["eval", "perplexity", "--model", llama_dir, "--data", "book.txt", "--lengths", "64,128", "--world", "2"]
    rc, out, err = _cli(*argv, cwd=tmp_path)
    assert rc == 0, err
    where = tmp_path / "burst-results" / "perplexity"
    rec = json.loads((where / "perplexity.json").read_text())
    assert rec["world"] == 2 and rec["windows"] == "non-overlapping windows" and rec["commit"]
    tokens = torch.tensor(AutoTokenizer.from_pretrained(llama_dir)(text).input_ids)
    for r, n in zip(rec["results"], (64, 128)):
        want, count = hf_nll(llama_dir, tokens, n, None)
        assert r["length"] == n and r["tokens"] == count and abs(r["nll"] - want) <= TOL * want
    assert (where / "perplexity.png").stat().st_size > 1000 and "perplexity: 64:" in out
    rc, out, err = _cli(*argv[:-1], "1", "--stride", "32", cwd=tmp_path)  # one rank, sliding windows
    assert rc == 0, err
    assert sorted(os.listdir(where)) == ["perplexity-2.json", "perplexity-2.png", "perplexity.json", "perplexity.png"]
    assert json.loads((where / "perplexity-2.json").read_text())["stride"] == 32


def test_records_and_figures_never_replace_each_other(tmp_path, monkeypatch):
    """eval's default folder is ./burst-results/<task> ($BURST_RESULTS/<task>); a record that
    reserves its figure's name takes a new number when either file exists."""
    from burstengine import cli
    from burstengine.bench.records import write_record
    from burstengine.cli.eval import out_dir

    monkeypatch.delenv("BURST_RESULTS", raising=False)
    assert out_dir(cli.build_parser().parse_args(["eval", "needle", "--model", "tiny"])) == "burst-results/needle"
    assert out_dir(cli.build_parser().parse_args(["eval", "needle", "--model", "tiny", "--out", "x"])) == "x"
    (tmp_path / "needle.png").write_bytes(b"a figure of an earlier run, its record deleted")
    a = write_record("needle", {}, str(tmp_path), also=(".png",))
    b = write_record("needle", {}, str(tmp_path), also=(".png",))
    assert [os.path.basename(p) for p in (a, b)] == ["needle-2.json", "needle-3.json"]


def test_passkey_format_is_the_training_task():
    """--format passkey prompts: BOS, the task's filler sentence in its cyclic order, KEY and the
    passkey at the depth asked for (in the range the task draws from), QUERY KEY at the end;
    the answer is the passkey's symbols, which the task's labels hold."""
    from burstengine.inference.needle import correct, passkey_case
    from burstengine.train import data as D

    task = D.Passkey(256, 128, key_len=4, symbols=16, seed=3)
    sentence = [int(x) for x in task.sentence]
    P = len(sentence)
    for depth in (0.0, 0.5, 1.0):
        c = passkey_case(task, 120, depth, 0, 0)
        ids, L, q = c.ids, 4, 118
        assert len(ids) == 120 and ids[0] == D.BOS and ids[-2:] == [D.QUERY, D.KEY]
        at = ids.index(D.KEY)
        assert ids[at + 1:at + 1 + L] == c.answer and len(set(c.answer)) == L
        assert all(D.FIRST_SYMBOL <= k < D.FIRST_SYMBOL + 16 for k in c.answer)
        assert 1 <= at <= q - L - 2 and abs((at - 1) / (q - L - 3) - depth) < 0.01  # the task draws at in [1, q-L-2]
        filler = [j for j in range(1, q) if not at <= j <= at + L]
        first = sentence.index(ids[filler[0]]) - filler[0]
        assert all(ids[j] == sentence[(first + j) % P] for j in filler)  # the sentence, in its order
        assert correct(c, list(c.answer), None)[0] and not correct(c, list(reversed(c.answer)), None)[0]
    # the task's own sequences end the same way: QUERY KEY, then the passkey as the labels
    t, labels, _ = task.sample(0)
    q = 256 - 4 - 1
    assert [int(x) for x in t[q:q + 2]] == [D.QUERY, D.KEY]
    assert [int(x) for x in labels[q + 1:]] == [int(x) for x in t[q + 2:]]
