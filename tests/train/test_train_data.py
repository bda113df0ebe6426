"""Training data for real corpora and the loop around it: text corpora (jsonl / parquet / plain text,
directories) tokenized once into a cache, EOS from the tokenizer's config, clear one-line errors,
packed documents with boundaries and per-document positions, the instruct format's labels,
gradient accumulation equal to one big batch, the metrics file repaired on resume, the
TensorBoard / W&B sinks and the progress bar."""
import inspect
import io
import json
import os

import numpy as np
import pytest
import torch

import burstengine as be
import train_cases as tc
from burstengine.model import Transformer
from burstengine.testing import rel_err
from burstengine.train import corpus, load
from burstengine.train import data as D
from burstengine.train import metrics as M

tokenizers = pytest.importorskip("tokenizers")

WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["<unk>", "<s>", "</s>"]
BOS, EOS = 1, 2


def make_tokenizer(folder, post=True, config=True):
    """A Llama-like word-level tokenizer.json (BOS added by its post-processor) and, with
    ``config``, a tokenizer_config.json naming EOS, in ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL)
    if post:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    if config:
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}, f)
    return os.path.join(folder, "tokenizer.json")


def ids_of(text):
    return [3 + int(w[1:]) for w in text.split()]


def docs(n, seed=0, lo=2, hi=30):
    g = np.random.default_rng(seed)
    return [" ".join(g.choice(WORDS, size=int(g.integers(lo, hi)))) for _ in range(n)]


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """A tokenizer, a text corpus (a directory of jsonl + txt) and an instruct jsonl."""
    root = tmp_path_factory.mktemp("corpus")
    make_tokenizer(str(root / "tok"))
    os.makedirs(root / "text" / "sub")
    texts = docs(60, seed=1)
    write_jsonl(root / "text" / "b.jsonl", [{"text": t} for t in texts[:40]])
    for i, t in enumerate(texts[40:]):
        (root / "text" / "sub" / f"a{i:02d}.txt").write_text(t)
    (root / "text" / "notes.md").write_text("not data")
    prompts, comps = docs(80, seed=2, hi=12), docs(80, seed=3, lo=1, hi=20)
    write_jsonl(root / "inst.jsonl", [{"q": p, "a": c} for p, c in zip(prompts, comps)])
    return root


def text_cfg(root, *extra):
    return load("tiny", [f"data={root / 'text'}", f"tokenizer={root / 'tok'}", f"data_cache={root / 'cache'}",
                         "seq_len=32", "model.vocab_size=64", *extra])


def small_text(root, *extra):
    """train_cases.small_config overrides for a corpus in ``root``."""
    return [f"tokenizer={root / 'tok'}", f"data_cache={root / 'cache'}", *extra]


# --- corpora and the cache ----------------------------------------------------------------------

def test_directory_corpus_tokenized_once(corpus_dir, monkeypatch):
    cfg = text_cfg(corpus_dir)
    files = corpus.list_files(cfg.data)
    # sorted by relative path, usable suffixes only
    assert [os.path.relpath(f, cfg.data) for f in files] == ["b.jsonl"] + [f"sub/a{i:02d}.txt" for i in range(20)]
    calls = []
    orig = corpus._tokenize
    monkeypatch.setattr(corpus, "_tokenize", lambda *a: (calls.append(1), orig(*a))[1])
    c = corpus.prepare(cfg)
    texts = [json.loads(line)["text"] for line in open(files[0])] + [open(f).read() for f in files[1:]]
    want = [i for t in texts for i in [BOS] + ids_of(t) + [EOS]]
    assert np.asarray(c.tokens).tolist() == want
    assert c.doc_ends.tolist() == np.cumsum([len(ids_of(t)) + 2 for t in texts]).tolist()
    assert c.meta["eos_id"] == EOS and c.mask is None and calls == [1]
    stamp = os.stat(os.path.join(c.path, "tokens.bin")).st_mtime_ns
    # a second launch maps the cache: no tokenization, the same files
    c2 = corpus.prepare(text_cfg(corpus_dir))
    assert calls == [1] and c2.path == c.path
    assert os.stat(os.path.join(c.path, "tokens.bin")).st_mtime_ns == stamp
    # another field name, another entry; an edited source, another entry
    assert corpus.spec(text_cfg(corpus_dir, "text_field=body")).cache != c.path
    f = corpus_dir / "text" / "sub" / "a00.txt"
    old = f.read_text()
    try:
        f.write_text(old + " w1")
        c3 = corpus.prepare(text_cfg(corpus_dir))
        assert calls == [1, 1] and c3.path != c.path and len(c3.tokens) == len(c.tokens) + 1
    finally:
        f.write_text(old)
    assert not [d for d in os.listdir(corpus_dir / "cache") if d.startswith(".")]  # no temporary left


def test_parquet_corpus(corpus_dir, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = docs(10, seed=5)
    pq.write_table(pa.table({"body": texts, "n": list(range(10))}), tmp_path / "d.parquet")
    cfg = load("tiny", [f"data={tmp_path / 'd.parquet'}", f"tokenizer={corpus_dir / 'tok'}", "text_field=body",
                        f"data_cache={tmp_path / 'cache'}", "seq_len=8", "model.vocab_size=64"])
    c = corpus.prepare(cfg)
    assert np.asarray(c.tokens).tolist() == [i for t in texts for i in [BOS] + ids_of(t) + [EOS]]
    cfg.text_field = "text"
    with pytest.raises(ValueError, match=r"d\.parquet: no column\(s\) \['text'\]"):
        corpus.prepare(cfg)


def test_parquet_without_pyarrow_names_the_extra(corpus_dir, tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    real = __import__("importlib").util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "pyarrow" else real(name, *a))
    with pytest.raises(ValueError, match=r"needs the pyarrow package: pip install 'burstengine\[data\]'"):
        load("tiny", [f"data={tmp_path}", f"tokenizer={corpus_dir / 'tok'}"])


def test_eos_from_the_tokenizer_config(tmp_path):
    path = make_tokenizer(str(tmp_path), config=False)
    tok = corpus.load_tokenizer(path)
    # no config file: the tokenizer's special end-of-text token
    assert corpus.eos_id(path, tok) == EOS
    for name, conf, want in [("config.json", {"eos_token_id": 5}, 5),
                             ("generation_config.json", {"eos_token_id": [7, 8]}, 7),
                             ("tokenizer_config.json", {"eos_token": "w10"}, 13)]:
        (tmp_path / name).write_text(json.dumps(conf))
        assert corpus.eos_id(path, tok) == want, name  # each file outranks the ones before
    assert corpus.eos_id(path, tok, override=4) == 4
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: eos_token '<nope>' is not a token"):
        corpus.eos_id(path, tok)
    (tmp_path / "tokenizer_config.json").write_text("{garbage")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: not a readable JSON file"):
        corpus.eos_id(path, tok)
    # nothing names an EOS: an error, not a guess
    bare = make_tokenizer(str(tmp_path / "bare"), config=False)
    data = json.loads(open(bare).read())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "</s>"]
    open(bare, "w").write(json.dumps(data))
    with pytest.raises(ValueError, match="no EOS token for .*set eos_id=N"):
        corpus.eos_id(bare, corpus.load_tokenizer(bare))


@pytest.mark.parametrize("what,msg", [
    ("tokenizer", r"tokenizer '.*tokenizer\.json' is not a valid tokenizer\.json"),
    ("meta", r"meta\.json: not a readable JSON file"),
    ("tokens", r"tokens\.bin: \d+ bytes, but .*meta\.json says"),
    ("empty_dir", r"is a directory with no \.jsonl, \.parquet, \.txt files"),
    ("jsonl", r"b\.jsonl:2: expected a JSON object with string field\(s\) \['text'\]"),
    ("no_tokenizer", "needs a tokenizer: set tokenizer="),
])
def test_data_errors_are_one_line_naming_the_file(corpus_dir, tmp_path, what, msg):
    root = tmp_path
    make_tokenizer(str(root / "tok"))
    os.makedirs(root / "text")
    write_jsonl(root / "text" / "b.jsonl", [{"text": t} for t in docs(5)])
    over = []
    if what == "tokenizer":
        (root / "tok" / "tokenizer.json").write_text('{"version": "1.0", "model": 3')
    elif what in ("meta", "tokens"):
        entry = corpus.prepare(text_cfg(root)).path
        if what == "meta":
            (root / "cache" / entry / "meta.json").write_text("\x00\x01garbage")
        else:
            with open(os.path.join(entry, "tokens.bin"), "r+b") as f:
                f.truncate(6)
    elif what == "empty_dir":
        os.remove(root / "text" / "b.jsonl")
        (root / "text" / "x.csv").write_text("a,b")
    elif what == "jsonl":
        with open(root / "text" / "b.jsonl", "a") as f:
            f.write('{"txt": "w1"}\n')
        with open(root / "text" / "b.jsonl") as f:
            lines = f.readlines()
        lines.insert(1, lines.pop())
        (root / "text" / "b.jsonl").write_text("".join(lines))
    elif what == "no_tokenizer":
        over = ["tokenizer="]
    with pytest.raises(ValueError, match=msg) as e:
        corpus.prepare(text_cfg(root, *over))
    assert "\n" not in str(e.value)


def _small_corpus(root):
    make_tokenizer(str(root / "tok"))
    os.makedirs(root / "text")
    write_jsonl(root / "text" / "b.jsonl", [{"text": t} for t in docs(30)])
    return root


def _overwrite_keeping_stat(path, data):
    """Rewrite ``path`` with ``data`` of the same size and put its mtime back (as cp -p or touch -r would)."""
    st = os.stat(path)
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_cache_same_size_overwrite_is_refused(tmp_path, monkeypatch):
    """A tokens.bin (or mask.bin, docs.npy) rewritten with other bytes of the same size, its mtime
    put back, is refused naming the file and the fix; an unchanged entry is not hashed again on
    the next launch, a touched one once."""
    root = _small_corpus(tmp_path)
    entry = corpus.prepare(text_cfg(root)).path
    hashed = []
    orig = corpus.file_sha256
    monkeypatch.setattr(corpus, "file_sha256", lambda p: (hashed.append(os.path.basename(p)), orig(p))[1])
    corpus.prepare(text_cfg(root))
    assert hashed == ["tokenizer.json", "b.jsonl"]  # the identity only: the entry's files are known unchanged
    tokens = os.path.join(entry, "tokens.bin")
    os.utime(tokens)  # touched, same bytes: hashed once, then known again
    hashed.clear()
    corpus.prepare(text_cfg(root))
    corpus.prepare(text_cfg(root))
    assert hashed.count("tokens.bin") == 1
    good = open(tokens, "rb").read()
    ids = np.frombuffer(good, dtype=np.uint32).copy()
    ids[[1, 2]] = ids[[2, 1]]  # two tokens swapped: same size, same token set, same max id
    assert ids.tobytes() != good
    _overwrite_keeping_stat(tokens, ids.tobytes())
    with pytest.raises(ValueError, match=r"tokens\.bin: its content does not match the SHA-256 recorded when it "
                                         r"was built.*delete .* and rerun") as e:
        corpus.prepare(text_cfg(root))
    assert "\n" not in str(e.value) and entry in str(e.value)
    _overwrite_keeping_stat(tokens, good)  # the same bytes back: accepted again
    assert np.asarray(corpus.prepare(text_cfg(root)).tokens).tobytes() == good


def test_cache_entry_of_another_tokenizer_is_refused(tmp_path):
    """Another tokenizer (another file, or other contents at the same path) gets another entry;
    another tokenizer's entry found under this key (a cache copied or moved by hand) is refused,
    naming both tokenizers."""
    root = _small_corpus(tmp_path)
    mine = corpus.prepare(text_cfg(root))
    other_tok = make_tokenizer(str(root / "tok2"), post=False)  # no BOS: other tokens for the same text
    theirs = corpus.prepare(text_cfg(root, f"tokenizer={other_tok}"))
    assert theirs.path != mine.path and len(theirs.tokens) < len(mine.tokens)
    # the same path, other contents: another entry too
    os.replace(root / "tok" / "tokenizer.json", root / "tok" / "tokenizer.json.bak")
    os.link(other_tok, root / "tok" / "tokenizer.json")
    assert corpus.spec(text_cfg(root)).cache == theirs.path
    os.replace(root / "tok" / "tokenizer.json.bak", root / "tok" / "tokenizer.json")
    # their entry in place of mine
    import shutil
    shutil.rmtree(mine.path)
    shutil.copytree(theirs.path, mine.path)
    with pytest.raises(ValueError, match=r"meta\.json: not this run's corpus: it was built with the tokenizer "
                                         r".*tok2/tokenizer\.json \(sha256 [0-9a-f]{12}\), this run's "
                                         r".*tok/tokenizer\.json is sha256 [0-9a-f]{12}; delete .* and rerun") as e:
        corpus.prepare(text_cfg(root))
    assert "\n" not in str(e.value)
    # without this run's settings (the CLI's --prepare-data path): the entry is not this key's
    with pytest.raises(ValueError, match=r"describes the entry [0-9a-f]{20}, not [0-9a-f]{20}"):
        corpus.open_cache(mine.path)


def test_cache_tampered_meta_is_refused(tmp_path):
    """meta.json edited by hand (a smaller max_id would let out-of-vocabulary ids through) is
    refused by its checksum; an identity edited with the checksum made to match is refused as
    another run's corpus."""
    root = _small_corpus(tmp_path)
    entry = corpus.prepare(text_cfg(root)).path
    path = os.path.join(entry, "meta.json")
    good = json.load(open(path))
    meta = dict(good, max_id=3)
    json.dump(meta, open(path, "w"))
    with pytest.raises(ValueError, match=r"meta\.json: does not match its own checksum.*delete .* and rerun") as e:
        corpus.prepare(text_cfg(root))
    assert "\n" not in str(e.value)
    meta = dict(good, identity=dict(good["identity"], eos=1))
    meta["checksum"] = corpus._checksum(meta)
    json.dump(meta, open(path, "w"))
    with pytest.raises(ValueError, match=r"not this run's corpus: it was built with EOS id 1, this run has 2"):
        corpus.prepare(text_cfg(root))
    json.dump(good, open(path, "w"))
    assert corpus.prepare(text_cfg(root)).path == entry


def test_cache_key_of_a_small_corpus_is_its_content(tmp_path):
    """A small corpus rewritten with other text of the same size, its mtime put back, is a new
    entry (its files' contents are in the key), not the old tokens."""
    root = _small_corpus(tmp_path)
    first = corpus.prepare(text_cfg(root))
    src = root / "text" / "b.jsonl"
    text = src.read_bytes()
    _overwrite_keeping_stat(src, text.replace(b"w1 ", b"w2 ").replace(b"w1\"", b"w2\""))
    second = corpus.prepare(text_cfg(root))
    assert second.path != first.path
    assert np.asarray(second.tokens).tolist() != np.asarray(first.tokens).tolist()


def test_corrupt_cache_is_refused_on_every_rank(pool, tmp_path):
    """In a job, rank 0 checks the entry's contents; every rank raises its one-line refusal."""
    root = _small_corpus(tmp_path)
    cfg = text_cfg(root)
    entry = corpus.prepare(cfg).path
    tokens = os.path.join(entry, "tokens.bin")
    ids = np.fromfile(tokens, dtype=np.uint32)
    _overwrite_keeping_stat(tokens, ids[::-1].tobytes())
    over = [f"data={root / 'text'}", *small_text(root), "cp=2"]
    got = pool.run(tc.fit_error, str(tmp_path / "run"), over, world=2)
    assert got[0] == got[1] and "tokens.bin: its content does not match the SHA-256" in got[0], got


def test_bin_errors(tmp_path):
    (tmp_path / "e.bin").write_bytes(b"")
    (tmp_path / "o.bin").write_bytes(b"\x01\x02\x03")
    for name, msg in [("e.bin", "e.bin: empty token file"),
                      ("o.bin", "o.bin: 3 bytes is not a whole number of uint16")]:
        cfg = load("tiny", [f"data={tmp_path / name}"])
        with pytest.raises(ValueError, match=msg):
            D.make_source(cfg)


# --- packing: documents, labels, positions ------------------------------------------------------

def test_pack_documents_and_labels():
    # two sequences of 8: documents begin at 0, 3, 5 in the first (and the token after it begins
    # one: 8), at 0 (a document cut by the window edge) and 6 in the second
    starts = [np.array([0, 3, 5, 8]), np.array([0, 6])]
    cu, pos = D.pack_documents(starts, 8)
    assert cu == (0, 3, 5, 8, 14, 16)
    assert pos.tolist() == [0, 1, 2, 0, 1, 0, 1, 2] + [0, 1, 2, 3, 4, 5, 0, 1]
    labels = torch.arange(16).reshape(2, 8)
    cut = D.cut_at_documents(labels, starts)
    # a document's last token predicts nothing (its label would be the next document's first)
    assert cut.tolist() == [[0, 1, D.IGNORE, 3, D.IGNORE, 5, 6, D.IGNORE], [8, 9, 10, 11, 12, D.IGNORE, 14, 15]]
    # one document per sequence: positions are those of the unpacked sequences
    cu, pos = D.pack_documents([np.array([0])] * 3, 8)
    assert cu == (0, 8, 16, 24) and pos.tolist() == list(range(8)) * 3


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_packed_batch_shards(corpus_dir, layout, cp):
    cfg = text_cfg(corpus_dir)
    src = D.make_source(cfg)
    idx = range(3)
    toks, labs, _, cu, pos = D.packed_sequences(src, idx)
    S = cfg.seq_len
    assert toks.shape == (1, 3 * S) and cu[0] == 0 and cu[-1] == 3 * S
    # independent of the cache's document ends: documents end with EOS
    for b, i in enumerate(idx):
        t = src.sample(i)[0]
        ends = [j + 1 for j in range(S) if t[j] == EOS]
        assert [c - b * S for c in cu if b * S < c < (b + 1) * S] == [e for e in ends if e < S]
        assert all(labs[0, b * S + e - 1] == D.IGNORE for e in ends)
    for a, z in zip(cu[:-1], cu[1:]):
        assert pos[a:z].tolist() == list(range(z - a))
    got = [D.shard_batch(toks, labs, [], layout, r, cp, "cpu", positions=pos, cu_seqlens=cu) for r in range(cp)]
    for r, b in enumerate(got):
        assert b.cu_seqlens == cu  # global boundaries, the same on every CP rank
        where = be.position_ids(3 * S, layout, r, cp)
        assert torch.equal(b.tokens[0], toks[0, where]) and torch.equal(b.positions, pos[where])
    assert torch.equal(be.unshard([b.labels for b in got], layout), labs)


def test_doc_starts_from_eos_match_the_cache(corpus_dir):
    cfg = text_cfg(corpus_dir)
    c = corpus.prepare(cfg)
    by_ends = D.TokenStream(c.tokens, 32, seed=0, doc_ends=c.doc_ends)
    by_eos = D.TokenStream(c.tokens, 32, seed=0, eos=EOS)
    for i in range(by_ends.windows):
        assert by_ends.doc_starts(i).tolist() == by_eos.doc_starts(i).tolist()
    assert any(len(by_ends.doc_starts(i)) > 2 for i in range(by_ends.windows))


def test_instruct_labels_only_the_completion(corpus_dir):
    cfg = load("tiny", [f"data={corpus_dir / 'inst.jsonl'}", f"tokenizer={corpus_dir / 'tok'}", "data_format=instruct",
                        "prompt_field=q", "completion_field=a", f"data_cache={corpus_dir / 'cache'}", "seq_len=32",
                        "model.vocab_size=64"])
    c = corpus.prepare(cfg)
    rows = [json.loads(line) for line in open(corpus_dir / "inst.jsonl")]
    want_t, want_m = [], []
    for r in rows:
        p, a = [BOS] + ids_of(r["q"]), ids_of(r["a"]) + [EOS]
        want_t += p + a
        want_m += [0] * len(p) + [1] * len(a)
    assert np.asarray(c.tokens).tolist() == want_t and np.asarray(c.mask).tolist() == want_m
    src = D.make_source(cfg)
    for i in range(5):
        t, lab, _ = src.sample(i)
        a = src._start(i, 0)
        target = np.asarray(want_m[a + 1: a + 33]) == 1
        assert (lab[target] == t[1:][target]).all() and (lab[~target] == D.IGNORE).all()
        assert target.any() and (~target).any()


# --- gradient accumulation and the loader ------------------------------------------------------

def test_loader_micro_batches_and_resume_position():
    one = D.Loader(None, batch_size=2, dp=2, dp_rank=1)
    acc = D.Loader(None, batch_size=1, dp=2, dp_rank=1, accum=2)
    for s in range(3):  # a rank reads the same sequences as one batch or as micro-batches
        assert list(one.indices(s)) == [i for m in range(2) for i in acc.indices(s, m)]
    state = one.state_dict(5)
    assert state["next_sequence"] == 20
    # resumed with another batch size / accumulation / dp: reads on from sequence 20
    other = D.Loader(None, batch_size=1, dp=1, dp_rank=0, accum=3)
    other.load_state_dict(state)
    assert [i for m in range(3) for i in other.indices(5, m)] == [20, 21, 22]
    assert list(other.indices(6, 0)) == [23] and other.state_dict(7)["next_sequence"] == 26
    legacy = D.Loader(None, batch_size=2, dp=1, dp_rank=0)
    legacy.load_state_dict({"next_step": 4, "sequences_per_step": 2})
    assert list(legacy.indices(4)) == [8, 9]


@pytest.mark.parametrize("world,cp", [(1, 1), (2, 1), (2, 2)])
def test_grad_accum_equals_one_big_batch(pool, corpus_dir, world, cp):
    """accum 2 x batch 1 == accum 1 x batch 2 on instruct data, whose micro-batches hold different
    numbers of labelled tokens (a mean of micro-batch means would differ)."""
    data = str(corpus_dir / "inst.jsonl")
    base = small_text(corpus_dir, "data_format=instruct", "prompt_field=q", "completion_field=a", f"cp={cp}",
                      "grad_clip=0", "warmup_steps=0", "lr=1e-3", "schedule=constant")
    big = pool.run(tc.accum_step, data, base + ["batch_size=2", "grad_accum=1"], world=world)[0]
    acc = pool.run(tc.accum_step, data, base + ["batch_size=1", "grad_accum=2"], world=world)[0]
    assert abs(acc[0] - big[0]) <= 1e-6 * abs(big[0])
    for n in big[1]:
        assert rel_err(acc[1][n], big[1][n]) <= 2e-6, n
        # AdamW's first step moves each weight by lr x g / (|g| + eps): entries with |g| near eps
        # turn the gradients' rounding differences into up to ~1e-3 lr, hence the looser bound
        assert (acc[2][n] - big[2][n]).abs().max() <= 1e-3 * 1e-3, n
        assert rel_err(acc[2][n], big[2][n]) <= 2e-5, n
    assert all(g.abs().max() > 0 for g in big[1].values())
    # the micro-batches really differ in their labelled tokens
    cfg = tc.small_config(base + ["batch_size=1"], data)
    src = D.make_source(cfg)
    counts = [int((src.sample(i)[1] != D.IGNORE).sum()) for i in range(2 * world // cp)]
    assert len(set(counts)) > 1, counts


def test_grad_accum_resume_continues_exactly(pool, tmp_path):
    extra = ["cp=2", "save_every=2", "grad_accum=2", "batch_size=1"]
    full = pool.run(tc.run_steps, str(tmp_path / "a"), 4, extra, world=2)[0]
    pool.run(tc.run_steps, str(tmp_path / "b"), 4, extra, stop_after=2, world=2)
    resumed = pool.run(tc.run_steps, str(tmp_path / "b"), 4, extra, resume=True, world=2)[0]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(full, resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=0)
        assert b["tokens"] == a["tokens"] == a["step"] * 2 * 32


def test_text_data_tokenized_by_rank_0_only(pool, corpus_dir, tmp_path):
    over = [f"tokenizer={corpus_dir / 'tok'}", f"data_cache={tmp_path / 'cache'}", "cp=2"]
    got = pool.run(tc.tokenize_calls, str(corpus_dir / "text"), over, world=2)
    assert got == [(1, 0), (0, 0)]


# --- metrics.jsonl on resume ----------------------------------------------------------------------

def test_resume_repairs_metrics_jsonl(pool, tmp_path):
    """A kill mid-write leaves a partial line; the resumed run neither fails on it nor glues its
    first record to it, and the file holds each step once."""
    extra = ["cp=2", "save_every=2"]
    full = pool.run(tc.run_steps, str(tmp_path / "a"), 4, extra, world=2)[0]
    pool.run(tc.run_steps, str(tmp_path / "b"), 4, extra, stop_after=3, world=2)
    path = tmp_path / "b" / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"kind": "step", "step": 4, "lo')
    # the stopped run's summary, then the fragment, which reading skips
    assert [r.get("step") for r in M.read_jsonl(str(path))] == [1, 2, 3, None]
    resumed = pool.run(tc.run_steps, str(tmp_path / "b"), 4, extra, resume=True, world=2)[0]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in full], rel=1e-6)
    lines = path.read_text().splitlines()
    assert all(json.loads(line) for line in lines)  # every line whole
    assert sum(json.loads(line)["kind"] == "summary" for line in lines) == 1


def test_repair_jsonl_unit(tmp_path):
    p = tmp_path / "m.jsonl"
    recs = [{"kind": "step", "step": s} for s in (1, 2, 3)] + [{"kind": "eval", "step": 2}, {"kind": "summary"},
                                                             {"kind": "step", "step": 4}]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"kind": "st')
    assert M.repair_jsonl(str(p), 2) == 4
    assert M.read_jsonl(str(p)) == [recs[0], recs[1], recs[3]]
    assert M.repair_jsonl(str(p), 2) == 0
    p.write_text('{"kind": "step", "step": 1}\n{"kind"')
    log = M.MetricsLog(str(p), 0, echo=False)
    log.write({"kind": "step", "step": 2})  # not glued to the fragment
    assert p.read_text().splitlines()[-1] == '{"kind": "step", "step": 2}'
    p.write_text('{"kind": "step", "step": 1}\nnot json\n{"kind": "step", "step": 2}\n')
    with pytest.raises(ValueError, match=r"m\.jsonl:2: not a JSON line"):
        M.read_jsonl(str(p))


# --- sinks and the progress bar ------------------------------------------------------------------

class FakeWriter:
    def __init__(self):
        self.scalars, self.closed = [], False

    def add_scalar(self, tag, value, global_step):
        self.scalars.append((tag, value, global_step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def test_sinks_get_step_and_eval_numbers(tmp_path):
    w = FakeWriter()
    log = M.MetricsLog(str(tmp_path / "m.jsonl"), 0, echo=False)
    log.sinks = [M.TensorBoardSink("", writer=w)]
    log.write({"kind": "step", "step": 3, "loss": 2.5, "mfu": None, "lr": 1e-3})
    log.write({"kind": "eval", "step": 3, "passkey_acc": 0.5, "token_acc_by_depth": [0.1, None, 0.3, 0.4]})
    log.write({"kind": "summary", "steps": 3})
    log.close()
    assert w.scalars == [("train/loss", 2.5, 3), ("train/lr", 1e-3, 3), ("eval/passkey_acc", 0.5, 3),
                         ("eval/token_acc_by_depth/0", 0.1, 3), ("eval/token_acc_by_depth/2", 0.3, 3),
                         ("eval/token_acc_by_depth/3", 0.4, 3)]
    assert w.closed and log.sinks == []
    # a non-zero rank writes nothing anywhere
    w1 = FakeWriter()
    other = M.MetricsLog(str(tmp_path / "x.jsonl"), 1, echo=False)
    other.sinks = [M.TensorBoardSink("", writer=w1)]
    other.write({"kind": "step", "step": 1, "loss": 1.0})
    assert w1.scalars == [] and not (tmp_path / "x.jsonl").exists()


def test_missing_sink_package_names_the_extra(monkeypatch):
    real = __import__("importlib").util.find_spec
    monkeypatch.setattr("importlib.util.find_spec",
                        lambda name, *a: None if name in ("tensorboard", "wandb") else real(name, *a))
    for key in ("tensorboard", "wandb"):
        want = rf"{key}=true needs the {key} package: pip install 'burstengine\[{key}\]'"
        with pytest.raises(ValueError, match=want):
            load("tiny", [f"{key}=true"])


def test_tensorboard_sink_in_a_run(pool, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recs = pool.run(tc.run_steps, str(tmp_path / "r"), 3, ["cp=1", "tensorboard=true"], world=1)[0]
    ev = EventAccumulator(str(tmp_path / "r" / "tensorboard"))
    ev.Reload()
    loss = ev.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in recs], rel=1e-6)


def test_wandb_sink_offline(tmp_path):
    wandb = pytest.importorskip("wandb")
    sink = M.WandbSink("burst-test", "t", str(tmp_path), mode="offline", config={"a": 1}, module=wandb)
    sink.log({"kind": "step", "step": 1, "loss": 2.0})
    sink.log({"kind": "step", "step": 2, "loss": 1.5})
    sink.close()
    runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    assert len(runs) == 1
    files = os.listdir(tmp_path / "wandb" / runs[0])
    assert any(f.endswith(".wandb") and os.path.getsize(tmp_path / "wandb" / runs[0] / f) > 0 for f in files)


class TTY(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_and_log_lines_do_not_overwrite_each_other():
    pytest.importorskip("tqdm")
    out = TTY()
    bar = M.Progress(10, True, initial=2, file=out)
    assert bar.on
    for s in range(3, 8):
        bar.update(s, f"loss {s:.4f}")
        bar.write(f"step {s} line")
    bar.close()
    text = out.getvalue()
    # each log line stands whole on a line of its own, the bar only ever redrawn in place
    lines = [seg.strip() for line in text.split("\n") for seg in line.split("\r")]
    for s in range(3, 8):
        assert f"step {s} line" in lines
    assert "7/10" in text and "loss 7.0000" in text
    assert not M.Progress(10, True, file=io.StringIO()).on  # not a TTY: no bar


# --- packed documents through the model (needs the model's cu_seqlens) ---------------------------

HAS_CU = "cu_seqlens" in inspect.signature(Transformer.forward).parameters


@pytest.mark.skipif(not HAS_CU, reason="Transformer.forward takes no cu_seqlens yet (branch finetune-model adds "
                                       "it); the integrator un-skips after merging")
@pytest.mark.parametrize("cp,layout", [(1, "contiguous"), (2, "zigzag"), (2, "contiguous")])
def test_doc_mask_equals_documents_one_by_one(pool, corpus_dir, cp, layout):
    from test_train import check_same

    data = str(corpus_dir / "text")
    over = small_text(corpus_dir, f"cp={cp}", f"layout={layout}", "doc_mask=true", "batch_size=2")
    got = pool.run(tc.loss_and_grads, data, over, world=cp)[0]
    # reference: every document (piece of one within a sequence) alone, float64, no CP
    cfg = tc.small_config(over, data)
    model = Transformer(cfg.model, loss=cfg.loss).double()
    model.init_weights(cfg.seed)
    src = D.make_source(cfg)
    total, count, pieces = 0.0, 0, 0
    for i in range(cfg.batch_size):
        t = torch.from_numpy(src.sample(i)[0])
        S = cfg.seq_len
        edges = [0] + [j + 1 for j in range(S) if t[j] == EOS and j + 1 < S] + [S]
        for a, z in zip(edges[:-1], edges[1:]):
            lab = t[a + 1:z + 1].clone()
            if t[z - 1] == EOS:
                lab[-1] = D.IGNORE  # the next document's first token is not this one's target
            total = total + model(t[a:z][None], torch.arange(z - a), lab[None])
            count += int((lab != D.IGNORE).sum())
            pieces += 1
    assert pieces > 2 * cfg.batch_size  # several documents per sequence
    loss = total / count
    loss.backward()
    check_same(got, (loss.item(), {n: p.grad for n, p in model.named_parameters()}))


@pytest.mark.skipif(not HAS_CU, reason="Transformer.forward takes no cu_seqlens yet (branch finetune-model adds "
                                       "it); the integrator un-skips after merging")
def test_fit_with_doc_mask_and_accumulation(pool, corpus_dir, tmp_path):
    data = str(corpus_dir / "text")
    over = small_text(corpus_dir, "cp=2", "doc_mask=true", "grad_accum=2", "batch_size=1", f"data={data}")
    recs = pool.run(tc.run_steps, str(tmp_path / "r"), 2, over, world=2)[0]
    assert [r["step"] for r in recs] == [1, 2]
    # every token is a target but the last of each document (and a sequence's last: its label is
    # the next window's first, which stays)
    src = D.make_source(tc.small_config(over))
    for r in recs:
        idx = range((r["step"] - 1) * 2, r["step"] * 2)
        want = sum(int((D.packed_sequences(src, [i])[1] != D.IGNORE).sum()) for i in idx)
        assert r["target_tokens"] == want < 2 * 32
        assert np.isfinite(r["loss"]) and r["tokens"] == r["step"] * 64
    # passkey sequences are one document each: evaluation runs unpacked
    pool.run(tc.run_steps, str(tmp_path / "p"), 1, ["cp=2", "doc_mask=true", "batch_size=2"], world=2)


def test_cli_tokenizes_once_before_spawning(corpus_dir, tmp_path):
    from test_train import _cli

    sets = tc.SMALL + [f"data={corpus_dir / 'text'}", f"tokenizer={corpus_dir / 'tok'}",
                       f"data_cache={tmp_path / 'cache'}", "steps=2", "cp=2", f"out_dir={tmp_path / 'run'}"]
    args = ["train", "--config", "tiny", "--world", "2"] + [a for s in sets for a in ("--set", s)]
    rc, out = _cli(*args, "--prepare-data")
    assert rc == 0 and "tokenizing 21 file(s)" in out and "documents (tokenized in" in out, out
    assert not (tmp_path / "run").exists()  # nothing trained
    rc, out = _cli(*args)
    assert rc == 0 and "tokenizing" not in out, out
    assert [r["step"] for r in M.read_jsonl(str(tmp_path / "run" / "metrics.jsonl")) if r["kind"] == "step"] == [1, 2]
    rc, out = _cli(*args, "--set", f"data={tmp_path / 'none'}")
    assert rc == 2 and "no such file or directory" in out, out


def test_a_sink_that_fails_to_open_stops_every_rank(pool, tmp_path):
    pytest.importorskip("tensorboard")
    os.makedirs(tmp_path / "r")
    (tmp_path / "r" / "tensorboard").write_text("a file where the event directory goes")
    got = pool.run(tc.fit_error, str(tmp_path / "r"), ["cp=2", "tensorboard=true"], world=2)
    assert all(g is not None and g.startswith("opening the metrics sinks: FileExistsError") for g in got), got


def test_tokenizer_and_eos_from_the_init_directory(tmp_path):
    """init=DIR (an HF model directory): its tokenizer.json, and EOS from its config files (here
    only config.json names one, as for many base models)."""
    from types import SimpleNamespace

    init = tmp_path / "model"
    make_tokenizer(str(init), config=False)
    (init / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "eos_token_id": 4}))
    cfg = SimpleNamespace(data="x", tokenizer="", init=str(init))
    path = corpus.tokenizer_path(cfg)
    assert path == str(init / "tokenizer.json")
    assert corpus.eos_id(path, corpus.load_tokenizer(path)) == 4
    # an explicit tokenizer wins over init's
    other = make_tokenizer(str(tmp_path / "other"))
    assert corpus.tokenizer_path(SimpleNamespace(data="x", tokenizer=other, init=str(init))) == other
    os.remove(init / "tokenizer.json")
    with pytest.raises(ValueError, match=r"init '.*model': no tokenizer\.json at"):
        corpus.tokenizer_path(cfg)
