"""Text corpora, tokenized once: jsonl / parquet / plain-text files (or directories of them) into a
cached token file that every later launch, and every rank, memory-maps.

Sources: a ``.jsonl`` file holds one JSON object per line, a ``.parquet`` file one row per
document (pyarrow, the ``data`` extra), a ``.txt`` file is one document; a directory stands for
every such file under it, in sorted order.  Two formats:

* ``text``: each document is ``text_field``, encoded as the tokenizer encodes by default (with
  its special tokens, e.g. Llama's BOS), then EOS.  Every token is a target.
* ``instruct``: each row has ``prompt_field`` and ``completion_field``; the document is
  prompt (with the tokenizer's special tokens) + completion + EOS, and only the completion and
  its EOS are targets (a per-token loss mask).

The tokenizer is a ``tokenizers`` ``tokenizer.json`` (the ``tokenizer`` field, or the ``init``
model directory's); EOS is read from the configuration files beside it (tokenizer_config.json's
``eos_token``, else generation_config.json's / config.json's ``eos_token_id``), else a special
end-of-text token of tokenizer.json itself; ``eos_id`` overrides all of them.

The cache, ``<data_cache>/<key>/``, holds ``tokens.bin`` (uint32), ``docs.npy`` (int64
cumulative document ends), ``mask.bin`` (uint8 targets, instruct only) and ``meta.json``.  The
key hashes everything the tokens depend on: the tokenizer file's bytes, the EOS id, the format
and fields, and each source's path, size and modification time; so an edited source or another
tokenizer gets a new entry and an unchanged setup is never tokenized again.  An entry is written
under a temporary name and renamed into place when complete: a killed tokenization leaves
nothing that can be mistaken for a finished cache.  In a job only rank 0 tokenizes; the others
wait for it, then map the files.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass

import numpy as np

CACHE_VERSION = 1
TEXT_SUFFIXES = (".jsonl", ".parquet", ".txt")
FORMATS = ("text", "instruct")
BATCH_DOCS = 1024  # documents encoded per tokenizers call
# EOS names a standalone tokenizer.json may mark special (only when no config file says)
_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
_DATA_EXTRA = "pip install 'burstengine[data]'"


# --- what to read ---------------------------------------------------------------------------------

def list_files(path: str) -> list[str]:
    """The source files of ``path``: itself, or every usable file under a directory, sorted by
    their path relative to it (so the order never depends on the file system)."""
    if os.path.isfile(path):
        if not path.endswith(TEXT_SUFFIXES):
            raise ValueError(f"data {path!r}: not a text corpus file (expected one of {list(TEXT_SUFFIXES)}, "
                             f"or a .bin token file)")
        return [path]
    if not os.path.isdir(path):
        raise ValueError(f"data {path!r}: no such file or directory")
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [os.path.join(root, f) for f in files if f.endswith(TEXT_SUFFIXES) and not f.startswith(".")]
    if not found:
        raise ValueError(f"data {path!r} is a directory with no {', '.join(TEXT_SUFFIXES)} files in it")
    return sorted(found, key=lambda f: os.path.relpath(f, path))


def tokenizer_path(cfg) -> str:
    """The tokenizer.json of a text-data job: the ``tokenizer`` field (a file, or a directory
    holding tokenizer.json), else the ``init`` model directory's."""
    given = cfg.tokenizer or getattr(cfg, "init", "")
    if not given:
        raise ValueError(f"text data {cfg.data!r} needs a tokenizer: set tokenizer=PATH/tokenizer.json "
                         f"or init=HF_MODEL_DIR")
    path = os.path.join(given, "tokenizer.json") if os.path.isdir(given) else given
    if not os.path.isfile(path):
        what = "tokenizer" if cfg.tokenizer else "init"
        raise ValueError(f"{what} {given!r}: no tokenizer.json at {path!r}")
    return path


def load_tokenizer(path: str):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("text data needs the tokenizers package: pip install 'burstengine[train]'") from None
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the Rust side raises plain Exceptions for any parse error
        raise ValueError(f"tokenizer {path!r} is not a valid tokenizer.json ({str(e).splitlines()[0]})") from None


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            out = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(out).__name__}")
    return out


def eos_id(tok_path: str, tok, override: int = -1) -> int:
    """The end-of-sequence id that ends every document (see the module doc for where it is read)."""
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if override >= 0:
        if override >= vocab:
            raise ValueError(f"eos_id {override} is outside the vocabulary of {tok_path} ({vocab} tokens)")
        return override
    folder = os.path.dirname(os.path.abspath(tok_path))
    for name in ("tokenizer_config.json", "generation_config.json", "config.json"):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            continue
        conf = _read_json(path)
        if name == "tokenizer_config.json":
            tok_name = conf.get("eos_token")
            if isinstance(tok_name, dict):
                tok_name = tok_name.get("content")
            if tok_name is None:
                continue
            if not isinstance(tok_name, str) or tok.token_to_id(tok_name) is None:
                raise ValueError(f"{path}: eos_token {tok_name!r} is not a token of {tok_path}")
            return tok.token_to_id(tok_name)
        i = conf.get("eos_token_id")
        if isinstance(i, list) and i:
            i = i[0]  # e.g. Llama 3 instruct lists several; the first is the tokenizer's own
        if i is None:
            continue
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab:
            raise ValueError(f"{path}: eos_token_id {i!r} is not a token id of {tok_path} ({vocab} tokens)")
        return i
    for added in tok.get_added_tokens_decoder().values():
        if added.special and added.content in _EOS_NAMES:
            return tok.token_to_id(added.content)
    raise ValueError(f"no EOS token for {tok_path}: no tokenizer_config.json (eos_token), generation_config.json "
                     f"or config.json (eos_token_id) in {folder} names one and the tokenizer has no special "
                     f"end-of-text token; set eos_id=N")


@dataclass(frozen=True)
class Spec:
    """Everything a corpus's tokens depend on, and where its cache entry lives."""

    files: tuple[str, ...]
    tokenizer: str
    eos_id: int
    format: str
    fields: tuple[str, ...]
    cache: str  # the entry's directory

    @property
    def key(self) -> str:
        return os.path.basename(self.cache)


def default_cache(cfg) -> str:
    # beside the run directories: shared by the runs of one out_dir parent, on the storage the
    # checkpoints use (which every node of a job must see anyway)
    return cfg.data_cache or os.path.join(os.path.dirname(os.path.abspath(cfg.run_dir)), "token_cache")


def spec(cfg) -> Spec:
    """The corpus of a text-data config (ValueError naming the file at fault)."""
    files = list_files(cfg.data)
    tok_path = tokenizer_path(cfg)
    tok = load_tokenizer(tok_path)
    eos = eos_id(tok_path, tok, cfg.eos_id)
    fields = (cfg.text_field,) if cfg.data_format == "text" else (cfg.prompt_field, cfg.completion_field)
    if cfg.data_format == "instruct" and any(f.endswith(".txt") for f in files):
        bad = next(f for f in files if f.endswith(".txt"))
        raise ValueError(f"data_format='instruct' needs jsonl or parquet rows with {list(fields)}; {bad!r} is "
                         f"plain text")
    h = hashlib.sha256()
    with open(tok_path, "rb") as f:
        tok_hash = hashlib.sha256(f.read()).hexdigest()
    sources = []
    for p in files:
        st = os.stat(p)
        sources.append([os.path.abspath(p), st.st_size, st.st_mtime_ns])
    h.update(json.dumps({"version": CACHE_VERSION, "tokenizer": tok_hash, "eos": eos, "format": cfg.data_format,
                         "fields": fields, "sources": sources}, sort_keys=True).encode())
    return Spec(files=tuple(files), tokenizer=tok_path, eos_id=eos, format=cfg.data_format, fields=fields,
                cache=os.path.join(default_cache(cfg), h.hexdigest()[:20]))


# --- reading documents --------------------------------------------------------------------------

def _jsonl_rows(path: str, fields):
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                row = tuple(obj[k] for k in fields)
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: expected a JSON object with string field(s) {list(fields)} "
                                 f"({type(e).__name__}: {e})") from None
            if not all(isinstance(v, str) for v in row):
                raise ValueError(f"{path}:{n}: field(s) {list(fields)} must be strings, got "
                                 f"{[type(v).__name__ for v in row]}")
            yield row


def _parquet_rows(path: str, fields):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"parquet data ({path}) needs pyarrow: {_DATA_EXTRA}") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise ValueError(f"{path}: not a readable parquet file ({e})") from None
    names = pf.schema_arrow.names
    missing = [k for k in fields if k not in names]
    if missing:
        raise ValueError(f"{path}: no column(s) {missing}; it has {names}")
    n = 0
    for batch in pf.iter_batches(columns=list(fields), batch_size=BATCH_DOCS):
        cols = [batch.column(k).to_pylist() for k in fields]
        for row in zip(*cols):
            n += 1
            if not all(isinstance(v, str) for v in row):
                raise ValueError(f"{path}: row {n}: column(s) {list(fields)} must be strings, got "
                                 f"{[type(v).__name__ for v in row]}")
            yield row


def _txt_rows(path: str, fields):
    try:
        with open(path, encoding="utf-8") as f:
            yield (f.read(),)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None


def rows(path: str, fields):
    """The documents of one source file, as tuples of its ``fields``."""
    reader = _jsonl_rows if path.endswith(".jsonl") else _parquet_rows if path.endswith(".parquet") else _txt_rows
    return reader(path, fields)


def _chunks(it, n):
    buf = []
    for x in it:
        buf.append(x)
        if len(buf) == n:
            yield buf
            buf = []
    if buf:
        yield buf


# --- building and opening the cache ---------------------------------------------------------------

def exists(sp: Spec) -> bool:
    return os.path.exists(os.path.join(sp.cache, "meta.json"))


def build(sp: Spec) -> str:
    """Tokenize the corpus into its cache entry unless that exists; returns the entry."""
    if exists(sp):
        return sp.cache
    parent = os.path.dirname(sp.cache)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{sp.key}.tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        meta = _tokenize(sp, tmp)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        try:
            os.rename(tmp, sp.cache)
        except OSError:  # another job finished the same entry first: theirs is as good as ours
            if not os.path.exists(os.path.join(sp.cache, "meta.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sp.cache


def _tokenize(sp: Spec, out: str) -> dict:
    tok = load_tokenizer(sp.tokenizer)
    instruct = sp.format == "instruct"
    ends, n_tok, max_id, skipped = [], 0, -1, 0
    with open(os.path.join(out, "tokens.bin"), "wb") as ft, \
            (open(os.path.join(out, "mask.bin"), "wb") if instruct else _Null()) as fm:
        for path in sp.files:
            for chunk in _chunks(rows(path, sp.fields), BATCH_DOCS):
                if instruct:
                    prompts = tok.encode_batch([r[0] for r in chunk], add_special_tokens=True)
                    comps = tok.encode_batch([r[1] for r in chunk], add_special_tokens=False)
                    docs = [(p.ids, c.ids + [sp.eos_id]) for p, c in zip(prompts, comps)]
                else:
                    texts = [r[0] for r in chunk if r[0].strip()]
                    skipped += len(chunk) - len(texts)
                    docs = [([], e.ids if e.ids[-1:] == [sp.eos_id] else e.ids + [sp.eos_id])
                            for e in tok.encode_batch(texts, add_special_tokens=True)]
                for ctx, target in docs:
                    ids = np.asarray(ctx + target, dtype=np.uint32)
                    ft.write(ids.tobytes())
                    if instruct:
                        fm.write(np.concatenate([np.zeros(len(ctx), np.uint8), np.ones(len(target), np.uint8)])
                                 .tobytes())
                    n_tok += len(ids)
                    ends.append(n_tok)
                    max_id = max(max_id, int(ids.max()))
    if not ends:
        raise ValueError(f"data {', '.join(sp.files[:3])}{' ...' if len(sp.files) > 3 else ''}: no documents "
                         f"(every {'row' if instruct else 'text'} is empty)")
    np.save(os.path.join(out, "docs.npy"), np.asarray(ends, dtype=np.int64))
    return {"version": CACHE_VERSION, "key": sp.key, "tokens": n_tok, "documents": len(ends), "dtype": "uint32",
            "max_id": max_id, "eos_id": sp.eos_id, "format": sp.format, "fields": list(sp.fields),
            "tokenizer": os.path.abspath(sp.tokenizer), "skipped_empty": skipped,
            "sources": [os.path.abspath(p) for p in sp.files]}


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@dataclass
class Corpus:
    """A cache entry, mapped: tokens (uint32 memmap), document ends, target mask (or None)."""

    tokens: np.ndarray
    doc_ends: np.ndarray
    mask: np.ndarray | None
    meta: dict
    path: str


def open_cache(entry: str) -> Corpus:
    meta_path = os.path.join(entry, "meta.json")
    if not os.path.exists(meta_path):
        raise ValueError(f"token cache {entry!r} is missing (rank 0 writes it; is data_cache on storage every "
                         f"node of the job shares?)")
    meta = _read_json(meta_path)
    try:
        n, docs = int(meta["tokens"]), int(meta["documents"])
        has_mask = meta["format"] == "instruct"
        if meta["dtype"] != "uint32" or n < 1 or docs < 1:
            raise ValueError("bad values")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{meta_path}: not a token-cache meta.json ({e}); delete {entry} to tokenize again") from None
    tok_path = os.path.join(entry, "tokens.bin")
    size = os.path.getsize(tok_path) if os.path.exists(tok_path) else -1
    if size != 4 * n:
        raise ValueError(f"{tok_path}: {size} bytes, but {meta_path} says {n} uint32 tokens; delete {entry} to "
                         f"tokenize again")
    try:
        ends = np.load(os.path.join(entry, "docs.npy"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{os.path.join(entry, 'docs.npy')}: unreadable ({e}); delete {entry} to tokenize again") \
            from None
    if ends.shape != (docs,) or ends[-1] != n:
        raise ValueError(f"{os.path.join(entry, 'docs.npy')} does not match {meta_path}; delete {entry} to tokenize "
                         f"again")
    mask = None
    if has_mask:
        mask_path = os.path.join(entry, "mask.bin")
        if not os.path.exists(mask_path) or os.path.getsize(mask_path) != n:
            raise ValueError(f"{mask_path}: missing or not {n} bytes; delete {entry} to tokenize again")
        mask = np.memmap(mask_path, dtype=np.uint8, mode="r")
    return Corpus(tokens=np.memmap(tok_path, dtype=np.uint32, mode="r"), doc_ends=ends, mask=mask, meta=meta,
                  path=entry)


def prepare(cfg, group=None) -> Corpus:
    """The corpus of ``cfg``, tokenized once.  In a process group (``group``, default the world
    when one is initialised), rank 0 builds a missing entry while the others wait; a failure on
    rank 0 is raised, with its message, on every rank."""
    import torch.distributed as dist

    sp = spec(cfg)  # every rank alike: errors here need no agreement
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return open_cache(build(sp))
    err = [None]
    if dist.get_rank(group) == 0:
        try:
            build(sp)
        except ValueError as e:
            err = [str(e)]
    dist.broadcast_object_list(err, group=group, group_src=0)
    if err[0] is not None:
        raise ValueError(err[0])
    try:
        out, err = open_cache(sp.cache), None
    except ValueError as e:
        out, err = None, str(e)
    # every rank must see the entry (node-local storage would not): agree before going on
    errs = [None] * dist.get_world_size(group)
    dist.all_gather_object(errs, err, group=group)
    bad = [(r, e) for r, e in enumerate(errs) if e is not None]
    if bad:
        raise ValueError(f"rank {bad[0][0]}: {bad[0][1]}")
    return out
