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
cumulative document ends), ``mask.bin`` (uint8 targets, instruct only), ``meta.json`` and
``verified.json``.  The key hashes everything the tokens depend on (the entry's *identity*): the
tokenizer file's bytes (its content, not its path), the EOS id, the format and fields, and each
source's path, size and modification time, plus its content hash when the corpus is small (see
:func:`source_identity`); so an edited source or another tokenizer gets a new entry and an
unchanged setup is never tokenized again.  An entry is written under a temporary name and
renamed into place when complete: a killed tokenization leaves nothing that can be mistaken for
a finished cache.  In a job only rank 0 tokenizes; the others wait for it, then map the files.

An entry is not trusted by its name or its sizes.  meta.json records the identity, the token and
document counts, the size and SHA-256 of every data file (hashed while tokenizing: no extra
read) and a checksum of itself; opening an entry checks the checksum (a hand-edited meta.json),
that the identity hashes to the entry's own key and equals this run's (another tokenizer's or
corpus's entry copied or moved under this key), the sizes, and the contents.  Hashing a
multi-GB tokens.bin on every launch would cost a full read each time, and hashing sampled
blocks misses a change outside the samples; so the full hash is checked once per change of the
files: ``verified.json`` records the (size, mtime, ctime, inode) at which each file last matched
its recorded hash, and a file whose stat still equals that is not read again.  Any rewrite of a
file (even of the same size with its mtime restored, which ``touch -r`` and ``cp -p`` do) moves
its ctime, which no user command can set back, so the next open hashes it in full.  Silent
corruption that changes no metadata (bad disks) is left to the storage.  Where verified.json
cannot be written (a read-only cache) every open hashes the files.  Any mismatch is a one-line
ValueError naming the file and what differs, and the fix: delete the entry and rerun.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field

import numpy as np

from .digest import file_sha256
from .diskfull import full_disk, no_space

CACHE_VERSION = 2  # 2: meta.json records the identity, file hashes and its own checksum
# a corpus this small is identified by the contents of its files too (see source_identity)
HASH_SOURCES_BYTES = 64 << 20
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
    identity: dict = field(default_factory=dict, compare=False)  # what the key hashes (meta.json keeps it)

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
    identity = {"version": CACHE_VERSION, "tokenizer": file_sha256(tok_path), "eos": eos, "format": cfg.data_format,
                "fields": list(fields), "sources": source_identity(files)}
    return Spec(files=tuple(files), tokenizer=tok_path, eos_id=eos, format=cfg.data_format, fields=fields,
                cache=os.path.join(default_cache(cfg), entry_key(identity)), identity=identity)


def source_identity(files) -> list[list]:
    """[path, size, mtime_ns] of each source, with its SHA-256 appended when the corpus has at
    most HASH_SOURCES_BYTES.  The stat is what tells a large corpus: hashing it would read every
    source on every launch (and on every rank), minutes for the hundreds of GB a pretraining
    corpus has on shared storage, to save a tokenization only a same-size rewrite with its mtime
    restored (cp -p, rsync -t, touch -r) could fool.  A small corpus costs nothing to hash, so
    there even that rewrite gets a new entry."""
    out = []
    for p in files:
        st = os.stat(p)
        out.append([os.path.abspath(p), st.st_size, st.st_mtime_ns])
    if sum(row[1] for row in out) <= HASH_SOURCES_BYTES:
        for row in out:
            row.append(file_sha256(row[0]))
    return out


def entry_key(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


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
        meta["checksum"] = _checksum(meta)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        _record_verified(tmp, meta)
        try:
            os.rename(tmp, sp.cache)
        except OSError:  # another job finished the same entry first: theirs is as good as ours
            if not os.path.exists(os.path.join(sp.cache, "meta.json")):
                raise
    except OSError as e:
        if full_disk(e)[0]:
            raise no_space(parent) from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sp.cache


def _tokenize(sp: Spec, out: str) -> dict:
    tok = load_tokenizer(sp.tokenizer)
    instruct = sp.format == "instruct"
    ends, n_tok, max_id, skipped = [], 0, -1, 0
    h_tok, h_mask = hashlib.sha256(), hashlib.sha256()
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
                    ids = np.asarray(ctx + target, dtype=np.uint32).tobytes()
                    ft.write(ids)
                    h_tok.update(ids)
                    if instruct:
                        m = np.concatenate([np.zeros(len(ctx), np.uint8), np.ones(len(target), np.uint8)]).tobytes()
                        fm.write(m)
                        h_mask.update(m)
                    ids = np.frombuffer(ids, dtype=np.uint32)
                    n_tok += len(ids)
                    ends.append(n_tok)
                    max_id = max(max_id, int(ids.max()))
    if not ends:
        raise ValueError(f"data {', '.join(sp.files[:3])}{' ...' if len(sp.files) > 3 else ''}: no documents "
                         f"(every {'row' if instruct else 'text'} is empty)")
    np.save(os.path.join(out, "docs.npy"), np.asarray(ends, dtype=np.int64))
    files = {"tokens.bin": {"bytes": 4 * n_tok, "sha256": h_tok.hexdigest()},
             "docs.npy": {"bytes": os.path.getsize(os.path.join(out, "docs.npy")),
                          "sha256": file_sha256(os.path.join(out, "docs.npy"))}}
    if instruct:
        files["mask.bin"] = {"bytes": n_tok, "sha256": h_mask.hexdigest()}
    return {"version": CACHE_VERSION, "key": sp.key, "identity": sp.identity, "tokens": n_tok,
            "documents": len(ends), "dtype": "uint32", "max_id": max_id, "eos_id": sp.eos_id, "format": sp.format,
            "fields": list(sp.fields), "tokenizer": os.path.abspath(sp.tokenizer), "skipped_empty": skipped,
            "sources": [os.path.abspath(p) for p in sp.files], "files": files}


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


def _checksum(meta: dict) -> str:
    """The SHA-256 of meta.json's fields but its checksum (canonical JSON)."""
    rest = {k: v for k, v in meta.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def _stamp(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _record_verified(entry: str, meta: dict) -> None:
    """verified.json: each data file's stat now, as matching the hash meta.json records (best
    effort: a read-only cache just hashes again next time)."""
    rec = {n: {"stat": _stamp(os.path.join(entry, n)), "sha256": f["sha256"]} for n, f in meta["files"].items()}
    tmp = os.path.join(entry, f".verified.json.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, os.path.join(entry, "verified.json"))
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def _verify_contents(entry: str, meta: dict, fix: str) -> None:
    """Each data file matches the SHA-256 meta.json records: hashed in full unless its stat
    equals the one verified.json recorded for that hash (see the module doc)."""
    try:
        with open(os.path.join(entry, "verified.json")) as f:
            seen = json.load(f)
    except (OSError, ValueError):
        seen = {}
    fresh = False
    for name, want in meta["files"].items():
        path = os.path.join(entry, name)
        known = seen.get(name) if isinstance(seen, dict) else None
        if isinstance(known, dict) and known.get("sha256") == want["sha256"] and known.get("stat") == _stamp(path):
            continue
        if file_sha256(path) != want["sha256"]:
            raise ValueError(f"token cache {path}: its content does not match the SHA-256 recorded when it was built "
                             f"(overwritten or corrupted, same size); {fix}")
        fresh = True
    if fresh:
        _record_verified(entry, meta)


_IDENTITY = {"version": "cache version", "tokenizer": "tokenizer (SHA-256 of tokenizer.json)", "eos": "EOS id",
             "format": "data_format", "fields": "fields"}


def _identity_change(built: dict, now: dict, meta: dict, sp: Spec) -> str | None:
    """What differs between the identity an entry was built for and this run's (None: nothing)."""
    for k, what in _IDENTITY.items():
        if built.get(k) != now[k]:
            if k == "tokenizer":
                return (f"it was built with the tokenizer {meta.get('tokenizer')} (sha256 {str(built.get(k))[:12]}), "
                        f"this run's {os.path.abspath(sp.tokenizer)} is sha256 {now[k][:12]}")
            return f"it was built with {what} {built.get(k)!r}, this run has {now[k]!r}"
    was, new = built.get("sources") or [], now["sources"]
    for a, b in zip(was, new):
        if a != b:
            return f"it was built from the source {a[0]} ({a[1]} bytes, mtime_ns {a[2]}), this run reads {b[0]} " \
                   f"({b[1]} bytes, mtime_ns {b[2]}){' with other contents' if a[:3] == b[:3] else ''}"
    if len(was) != len(new):
        return f"it was built from {len(was)} source file(s), this run reads {len(new)}"
    return None


def open_cache(entry: str, sp: Spec | None = None, hash_files: bool = True) -> Corpus:
    """The cache entry at ``entry``, checked (see the module doc): against this run's ``sp``
    when given, and its files' contents unless ``hash_files`` is False (a rank whose rank 0
    has just checked them).  ValueError naming the file and what differs otherwise."""
    meta_path = os.path.join(entry, "meta.json")
    if not os.path.exists(meta_path):
        raise ValueError(f"token cache {entry!r} is missing (rank 0 writes it; is data_cache on storage every "
                         f"node of the job shares?)")
    meta = _read_json(meta_path)
    fix = f"delete {entry} and rerun to tokenize again"
    if meta.get("checksum") != _checksum(meta):
        raise ValueError(f"token cache {meta_path}: does not match its own checksum (edited, or written by another "
                         f"version); {fix}")
    try:
        n, docs = int(meta["tokens"]), int(meta["documents"])
        has_mask = meta["format"] == "instruct"
        files, built = meta["files"], meta["identity"]
        if meta["dtype"] != "uint32" or n < 1 or docs < 1 or not isinstance(files, dict) or \
                not isinstance(built, dict):
            raise ValueError("bad values")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{meta_path}: not a token-cache meta.json ({e}); delete {entry} to tokenize again") from None
    change = _identity_change(built, sp.identity, meta, sp) if sp is not None else None
    if change:
        raise ValueError(f"token cache {meta_path}: not this run's corpus: {change}; {fix}")
    if entry_key(built) != os.path.basename(os.path.normpath(entry)):  # without sp: is it this key's at all?
        raise ValueError(f"token cache {meta_path}: describes the entry {entry_key(built)}, not "
                         f"{os.path.basename(os.path.normpath(entry))} (copied or moved here?); {fix}")
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
    if hash_files:
        _verify_contents(entry, meta, fix)
    return Corpus(tokens=np.memmap(tok_path, dtype=np.uint32, mode="r"), doc_ends=ends, mask=mask, meta=meta,
                  path=entry)


def prepare(cfg, group=None) -> Corpus:
    """The corpus of ``cfg``, tokenized once.  In a process group (``group``, default the world
    when one is initialised), rank 0 builds a missing entry while the others wait; a failure on
    rank 0 is raised, with its message, on every rank."""
    import torch.distributed as dist

    sp = spec(cfg)  # every rank alike: errors here need no agreement
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return open_cache(build(sp), sp)
    err, out = [None], None
    if dist.get_rank(group) == 0:  # builds a missing entry and checks its contents, for every rank
        try:
            out = open_cache(build(sp), sp)
        except ValueError as e:
            err = [str(e)]
    dist.broadcast_object_list(err, group=group, group_src=0)
    if err[0] is not None:
        raise ValueError(err[0])
    try:
        out, err = out or open_cache(sp.cache, sp, hash_files=False), None
    except ValueError as e:
        out, err = None, str(e)
    # every rank must see the entry (node-local storage would not): agree before going on
    errs = [None] * dist.get_world_size(group)
    dist.all_gather_object(errs, err, group=group)
    bad = [(r, e) for r, e in enumerate(errs) if e is not None]
    if bad:
        raise ValueError(f"rank {bad[0][0]}: {bad[0][1]}")
    return out
