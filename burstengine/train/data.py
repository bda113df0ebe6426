"""Training data: global sequences in, this rank's shard of inputs, labels and positions out.

Three sources, each a deterministic function of (seed, sequence index), so the data position
of a run is just its step and a resumed run reads exactly what the uninterrupted one would:

* ``passkey`` (the default): a synthetic long-context task made on the fly.  A passkey of a few
  tokens is hidden at a random depth of a long random filler; the sequence ends by asking for it.
  Only the answer is labelled, so the loss and the accuracy measure retrieval alone.
* a ``.bin`` file of uint16/uint32 token ids (nanoGPT's format), read through a memmap.
* a ``.jsonl`` file with one ``{"text": ...}`` per line, tokenized with a local
  ``tokenizer.json`` (the ``tokenizers`` package); documents are joined with an end-of-text token.

Token streams are *packed*: cut into consecutive windows of seq_len + 1 tokens (documents run
across window edges, attention runs across document edges, as in nanoGPT), windows visited in a
seeded random order per epoch.

Labels are made on the global sequence, before it is split over the CP ranks: a rank's last
position is followed by a token that lives on another rank, and its label is still exact.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch

from ..layout import position_ids, shard

IGNORE = -100

# passkey vocabulary: special tokens, then passkey symbols, then filler
BOS, KEY, QUERY, EOS = 0, 1, 2, 3
FIRST_SYMBOL = 4


def _rng(seed: int, stream: int, index: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed, stream, index]))


class Passkey:
    """Passkey retrieval (Mohtashami & Jaggi, 2023)::

        BOS  ..filler..filler..  KEY k1..kL  ..filler..filler..  QUERY KEY k1..kL
                                                                        ^ the answer

    As in the original test, the filler is one fixed "sentence" repeated (here a random one of
    ``period`` tokens drawn once from the seed, entered at a random phase): it carries no
    information, so the only way to the answer is to find the earlier KEY, at whatever depth it
    was hidden, and copy what followed it.  The passkey is L distinct symbols out of
    ``symbols``; filler tokens come from the rest of the vocabulary.  Only the answer is
    labelled (train and held-out alike), so the loss and the accuracy measure retrieval alone;
    chance is 1/symbols per answer token."""

    def __init__(self, seq_len: int, vocab: int, key_len: int = 4, symbols: int = 16, seed: int = 0,
                 period: int = 23):
        self.seq_len, self.vocab, self.key_len, self.symbols, self.seed = seq_len, vocab, key_len, symbols, seed
        self.filler0 = FIRST_SYMBOL + symbols
        self.sentence = _rng(seed, 999, 0).integers(self.filler0, vocab, size=period)

    def sample(self, index: int, stream: int = 0) -> tuple[np.ndarray, np.ndarray, float]:
        """(tokens (S+1,), labels (S,), depth of the key in [0, 1]) of sequence ``index``;
        stream 0 is training data, others are held-out."""
        S, L = self.seq_len, self.key_len
        g = _rng(self.seed, stream, index)
        P = len(self.sentence)
        t = np.empty(S + 1, dtype=np.int64)
        t[0] = BOS
        t[1:] = np.resize(np.roll(self.sentence, -int(g.integers(P))), S)
        key = FIRST_SYMBOL + g.permutation(self.symbols)[:L]
        q = S - L - 1  # QUERY here, then KEY, then the answer: the last L tokens
        at = int(g.integers(1, q - L - 1))  # the hidden KEY marker, anywhere before the question
        t[at] = KEY
        t[at + 1:at + 1 + L] = key
        t[q], t[q + 1] = QUERY, KEY
        t[q + 2:] = key
        labels = np.full(S, IGNORE, dtype=np.int64)
        labels[q + 1:] = key  # label i is token i+1: from the question's KEY on
        return t, labels, at / q


class TokenStream:
    """Packed windows of seq_len + 1 tokens from a 1-D token array (a memmap for .bin files)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int = 0):
        if len(tokens) < seq_len + 1:
            raise ValueError(f"the data has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.windows = (len(tokens) - 1) // seq_len
        self._perm = (None, None)

    def sample(self, index: int, stream: int = 0) -> tuple[np.ndarray, np.ndarray, float]:
        epoch, i = divmod(index, self.windows)
        if self._perm[0] != (stream, epoch):
            self._perm = ((stream, epoch), _rng(self.seed, 1000 + stream, epoch).permutation(self.windows))
        w = int(self._perm[1][i])
        t = np.asarray(self.tokens[w * self.seq_len: w * self.seq_len + self.seq_len + 1], dtype=np.int64)
        return t, t[1:].copy(), float("nan")


def load_bin(path: str, dtype: str) -> np.ndarray:
    return np.memmap(path, dtype=np.dtype(dtype), mode="r")


def _eos_id(tok) -> int:
    for name in ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]"):
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise ValueError("the tokenizer has no end-of-text token (<|endoftext|>, </s>, <eos>, ...) to join documents")


def tokenize_jsonl(path: str, tokenizer: str, field: str = "text") -> np.ndarray:
    """Every document of a jsonl file, tokenized and joined with the end-of-text token."""
    from tokenizers import Tokenizer  # optional dependency: only for tokenized text data

    tok = Tokenizer.from_file(tokenizer)
    eos = _eos_id(tok)
    texts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                texts.append(json.loads(line)[field])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: expected a JSON object with a {field!r} string ({e})") from None
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


def make_source(cfg):
    if cfg.data == "passkey":
        return Passkey(cfg.seq_len, cfg.model.vocab_size, cfg.passkey_len, cfg.passkey_symbols, cfg.seed)
    tokens = (tokenize_jsonl(cfg.data, cfg.tokenizer) if cfg.data.endswith(".jsonl")
              else load_bin(cfg.data, cfg.token_dtype))
    if len(tokens) and int(tokens.max()) >= cfg.model.vocab_size:
        raise ValueError(f"data {cfg.data!r} holds token id {int(tokens.max())} >= model.vocab_size "
                         f"{cfg.model.vocab_size}")
    return TokenStream(tokens, cfg.seq_len, cfg.seed)


@dataclass
class Batch:
    """This rank's shard: tokens and labels (B, S/cp) on the device, positions (S/cp,),
    and the depth of each sequence's passkey (for evaluation)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    depth: list[float]


def global_sequences(source, indices, stream: int = 0):
    """(inputs (B, S), labels (B, S), depths) of whole sequences, before any sharding."""
    toks, labs, depths = [], [], []
    for i in indices:
        t, lab, dep = source.sample(i, stream)
        toks.append(t[:-1])
        labs.append(lab)
        depths.append(dep)
    return torch.from_numpy(np.stack(toks)), torch.from_numpy(np.stack(labs)), depths


def _to_device(t, device):
    # from pinned memory: a copy from pageable memory waits for the device's queue to drain first
    # (a host sync at the top of every step)
    pinned = t.pin_memory() if torch.device(device).type == "cuda" else t
    return pinned.to(device, non_blocking=True)


def shard_batch(tokens, labels, depths, layout: str, cp_rank: int, cp: int, device) -> Batch:
    S = tokens.shape[1]
    return Batch(tokens=_to_device(shard(tokens, layout, cp_rank, cp), device),
                 labels=_to_device(shard(labels, layout, cp_rank, cp), device),
                 positions=position_ids(S, layout, cp_rank, cp, device=device), depth=depths)


class Loader:
    """Which sequences each step reads.  Step s on data-parallel rank d reads sequences
    s*B*dp + d*B + [0, B); every CP rank of a row reads the same ones and keeps its shard."""

    def __init__(self, source, batch_size: int, dp: int, dp_rank: int):
        self.source, self.B, self.dp, self.dp_rank = source, batch_size, dp, dp_rank

    def indices(self, step: int) -> range:
        start = (step * self.dp + self.dp_rank) * self.B
        return range(start, start + self.B)

    def state_dict(self, step: int) -> dict:
        return {"next_step": step, "sequences_per_step": self.B * self.dp}
