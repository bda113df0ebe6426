"""Training data: global sequences in, this rank's shard of inputs, labels and positions out.

Three sources, each a deterministic function of (seed, sequence index), so the data position
of a run is just its step and a resumed run reads exactly what the uninterrupted one would:

* ``passkey`` (the default): a synthetic long-context task made on the fly.  A passkey of a few
  tokens is hidden at a random depth of a long random filler; the sequence ends by asking for it.
  Only the answer is labelled, so the loss and the accuracy measure retrieval alone.
* a ``.bin`` file of uint16/uint32 token ids (nanoGPT's format), read through a memmap.
* a text corpus (jsonl / parquet / plain text files, or directories of them), tokenized once
  with the model's tokenizer into a cached token file (:mod:`burstengine.train.corpus`); each
  document ends with EOS; ``data_format="instruct"`` labels only the completions.

Token streams are *packed*: cut into consecutive windows of seq_len + 1 tokens, windows visited
in a seeded random order per epoch.  Documents run across window edges.  Without ``doc_mask``
attention runs across document edges too (as in nanoGPT).  With it, the B sequences of a batch
are laid end to end as one row whose document boundaries (``cu_seqlens``, global) go to the
attention ring, positions restart at each document, and the label of a document's last token
(which would be the next document's first) is dropped: each document is trained exactly as if it
were alone.

Labels are made on the global sequence, before it is split over the CP ranks: a rank's last
position is followed by a token that lives on another rank, and its label is still exact.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from ..layout import position_ids, shard
from . import corpus

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
    """Packed windows of seq_len + 1 tokens from a 1-D token array (a memmap for .bin files and
    the token cache).  Where documents begin inside a window comes from ``doc_ends`` (cumulative
    document ends, the token cache's) or, for a bare .bin file, from the token after each
    ``eos``; ``loss_mask`` (per token: 1 = a target) leaves the labels of the others at IGNORE
    (the instruct format's prompts)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int = 0, doc_ends: np.ndarray | None = None,
                 loss_mask: np.ndarray | None = None, eos: int | None = None, name: str = "the data"):
        if len(tokens) < seq_len + 1:
            raise ValueError(f"{name} has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.doc_ends, self.loss_mask, self.eos = doc_ends, loss_mask, eos
        self.windows = (len(tokens) - 1) // seq_len
        self._perm = (None, None)

    def _start(self, index: int, stream: int) -> int:
        epoch, i = divmod(index, self.windows)
        if self._perm[0] != (stream, epoch):
            self._perm = ((stream, epoch), _rng(self.seed, 1000 + stream, epoch).permutation(self.windows))
        return int(self._perm[1][i]) * self.seq_len

    def sample(self, index: int, stream: int = 0) -> tuple[np.ndarray, np.ndarray, float]:
        a = self._start(index, stream)
        t = np.asarray(self.tokens[a: a + self.seq_len + 1], dtype=np.int64)
        labels = t[1:].copy()
        if self.loss_mask is not None:
            labels[np.asarray(self.loss_mask[a + 1: a + self.seq_len + 1]) == 0] = IGNORE
        return t, labels, float("nan")

    def doc_starts(self, index: int, stream: int = 0) -> np.ndarray:
        """Offsets in [0, seq_len] where a document begins in the window of ``index``: 0 always
        (a document cut by the window edge starts again there), seq_len when the token after the
        window begins one."""
        a, S = self._start(index, stream), self.seq_len
        if self.doc_ends is not None:
            # a document ending at e (exclusive) has the next begin at e: those with a < e <= a + S
            lo = np.searchsorted(self.doc_ends, a, side="right")
            hi = np.searchsorted(self.doc_ends, a + S, side="right")
            inner = np.asarray(self.doc_ends[lo:hi], dtype=np.int64) - a
        elif self.eos is not None:
            inner = np.nonzero(np.asarray(self.tokens[a: a + S]) == self.eos)[0].astype(np.int64) + 1
        else:
            raise ValueError("this token stream knows no document boundaries (no doc_ends, no eos)")
        return np.unique(np.concatenate([[0], inner]))


def load_bin(path: str, dtype: str) -> np.ndarray:
    """A .bin file of token ids, memory-mapped (ValueError naming it when empty or cut short)."""
    item = np.dtype(dtype).itemsize
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"{path}: empty token file")
    if size % item:
        raise ValueError(f"{path}: {size} bytes is not a whole number of {dtype} tokens (token_dtype={dtype!r}; "
                         f"a file cut short, or another dtype?)")
    return np.memmap(path, dtype=np.dtype(dtype), mode="r")


def make_source(cfg, group=None):
    """The config's data source; text corpora are tokenized once (rank 0 of ``group``) and cached."""
    if cfg.data == "passkey":
        return Passkey(cfg.seq_len, cfg.model.vocab_size, cfg.passkey_len, cfg.passkey_symbols, cfg.seed)
    if cfg.data.endswith(".bin"):
        tokens = load_bin(cfg.data, cfg.token_dtype)
        top = int(tokens.max())
        eos = None
        if cfg.doc_mask:
            eos = cfg.eos_id
            if eos < 0:
                if not (cfg.tokenizer or getattr(cfg, "init", "")):
                    raise ValueError(f"doc_mask on the token file {cfg.data!r} needs its EOS id to find the documents: "
                                     f"set eos_id=N, or tokenizer / init to read it from")
                tok_path = corpus.tokenizer_path(cfg)
                eos = corpus.eos_id(tok_path, corpus.load_tokenizer(tok_path))
        stream = TokenStream(tokens, cfg.seq_len, cfg.seed, eos=eos, name=cfg.data)
    else:
        c = corpus.prepare(cfg, group)
        top = int(c.meta["max_id"])
        stream = TokenStream(c.tokens, cfg.seq_len, cfg.seed, doc_ends=c.doc_ends, loss_mask=c.mask,
                             name=f"data {cfg.data!r} (tokenized: {c.path})")
    if top >= cfg.model.vocab_size:
        raise ValueError(f"data {cfg.data!r} holds token id {top} >= model.vocab_size {cfg.model.vocab_size}")
    return stream


@dataclass
class Batch:
    """This rank's shard: tokens and labels (B, S/cp) on the device, positions (S/cp,),
    and the depth of each sequence's passkey (for evaluation).  With document masking the B
    sequences are laid end to end as one row (tokens and labels (1, B*S/cp)), ``cu_seqlens``
    holds the global document boundaries of that row (the same on every CP rank) and positions
    restart at each document."""

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    depth: list[float]
    cu_seqlens: tuple[int, ...] | None = None


def global_sequences(source, indices, stream: int = 0):
    """(inputs (B, S), labels (B, S), depths) of whole sequences, before any sharding."""
    toks, labs, depths = [], [], []
    for i in indices:
        t, lab, dep = source.sample(i, stream)
        toks.append(t[:-1])
        labs.append(lab)
        depths.append(dep)
    return torch.from_numpy(np.stack(toks)), torch.from_numpy(np.stack(labs)), depths


def doc_starts(source, index: int, stream: int = 0) -> np.ndarray:
    """Where documents begin in sequence ``index`` (a passkey sequence is one document)."""
    get = getattr(source, "doc_starts", None)
    return np.zeros(1, dtype=np.int64) if get is None else get(index, stream)


def pack_documents(starts: list[np.ndarray], seq_len: int) -> tuple[tuple[int, ...], torch.Tensor]:
    """(cu_seqlens, positions) of B sequences of ``seq_len`` laid end to end, given where
    documents begin in each (offsets in [0, seq_len], 0 first): boundaries at every start and
    every sequence edge, positions counting from 0 in each document."""
    cu = []
    for b, st in enumerate(starts):
        cu += [b * seq_len + int(s) for s in st if s < seq_len]
    cu.append(len(starts) * seq_len)
    lengths = np.diff(cu)
    ends = np.cumsum(lengths)
    pos = np.arange(cu[-1], dtype=np.int64) - np.repeat(ends - lengths, lengths)
    return tuple(cu), torch.from_numpy(pos)


def cut_at_documents(labels: torch.Tensor, starts: list[np.ndarray]) -> torch.Tensor:
    """Labels (B, S) with the targets that cross into the next document set to IGNORE: the last
    token of a document predicts nothing, since under the document mask it cannot see the next."""
    out = labels.clone()
    for b, st in enumerate(starts):
        last = np.asarray(st)[np.asarray(st) > 0] - 1
        out[b, torch.from_numpy(last)] = IGNORE
    return out


def packed_sequences(source, indices, stream: int = 0):
    """The sequences of ``indices`` as one row of packed documents: (inputs (1, B*S), labels
    (1, B*S), depths, cu_seqlens, positions (B*S,)), before any sharding."""
    toks, labs, depths = global_sequences(source, indices, stream)
    starts = [doc_starts(source, i, stream) for i in indices]
    cu, pos = pack_documents(starts, toks.shape[1])
    labs = cut_at_documents(labs, starts)
    return toks.reshape(1, -1), labs.reshape(1, -1), depths, cu, pos


def _to_device(t, device):
    # from pinned memory: a copy from pageable memory waits for the device's queue to drain first
    # (a host sync at the top of every step)
    pinned = t.pin_memory() if torch.device(device).type == "cuda" else t
    return pinned.to(device, non_blocking=True)


def shard_batch(tokens, labels, depths, layout: str, cp_rank: int, cp: int, device, positions=None,
                cu_seqlens=None) -> Batch:
    """This rank's share of global (B, S) tokens and labels; ``positions`` (S,) are the global
    sequence's (default 0..S-1)."""
    S = tokens.shape[1]
    pos = (position_ids(S, layout, cp_rank, cp, device=device) if positions is None
           else _to_device(shard(positions, layout, cp_rank, cp, dim=0), device))
    return Batch(tokens=_to_device(shard(tokens, layout, cp_rank, cp), device),
                 labels=_to_device(shard(labels, layout, cp_rank, cp), device),
                 positions=pos, depth=depths, cu_seqlens=cu_seqlens)


class Loader:
    """Which sequences each step reads.  A step is ``accum`` micro-batches of B sequences per
    data-parallel rank; micro-batch m of step s on rank d reads sequences
    base + ((s - base_step) * dp + d) * accum * B + m * B + [0, B): every CP rank of a row reads
    the same ones and keeps its shard, and a rank reads the same sequences whether it takes them
    as one batch or in micro-batches.  ``base`` is the data position of the checkpoint resumed
    (0 at the start), so a run resumed with another batch size, accumulation or dp still reads
    on from where it stopped."""

    def __init__(self, source, batch_size: int, dp: int, dp_rank: int, accum: int = 1):
        self.source, self.B, self.dp, self.dp_rank, self.accum = source, batch_size, dp, dp_rank, accum
        self.base_step, self.base_sequence = 0, 0

    @property
    def sequences_per_step(self) -> int:
        return self.B * self.accum * self.dp

    def indices(self, step: int, micro: int = 0) -> range:
        start = (self.base_sequence + ((step - self.base_step) * self.dp + self.dp_rank) * self.accum * self.B
                 + micro * self.B)
        return range(start, start + self.B)

    def state_dict(self, step: int) -> dict:
        return {"next_step": step, "sequences_per_step": self.sequences_per_step,
                "next_sequence": self.base_sequence + (step - self.base_step) * self.sequences_per_step}

    def load_state_dict(self, state: dict) -> None:
        step = int(state["next_step"])
        self.base_step = step
        # checkpoints from before next_sequence was saved: their steps were all alike
        self.base_sequence = int(state.get("next_sequence", step * state.get("sequences_per_step", 0)))
