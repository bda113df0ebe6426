"""Needle-in-a-haystack retrieval: a passkey hidden at a depth of a long filler context, then
asked for; what fraction of (length, depth) cells the model answers exactly.

Prompts are built in token space, so a prompt has exactly the length asked for:

* with a tokenizer: the filler is a few plain sentences repeated (the passkey test of
  Mohtashami & Jaggi, "Landmark Attention", 2023); the needle sentence "The pass key is
  NNNNN. Remember it. NNNNN is the pass key." goes in at the sentence boundary nearest to
  ``depth`` x the haystack; the prompt ends with "What is the pass key? The pass key is"; the
  answer is right when the first number in the greedy continuation is the passkey.
* without one (a preset with random weights): random filler ids, a needle of a fixed random
  "key" id sequence followed by random "value" ids, and the key again at the end; the answer is
  right when the continuation starts with the value ids.
* ``passkey``: the built-in training task's own format (:class:`burstengine.train.data.Passkey`),
  for a model trained on it: its filler sentence, ``KEY`` + the passkey symbols at the depth,
  and the prompt ends with ``QUERY KEY``; the answer is right when the continuation is the
  passkey.  The task's settings (key length, symbols, seed) must be the training run's.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from ..train.data import BOS, FIRST_SYMBOL, KEY, QUERY, Passkey

FORMATS = ("auto", "text", "tokens", "passkey")  # auto: text with a tokenizer, else tokens

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = " What is the pass key? The pass key is"


@dataclass
class Case:
    length: int
    depth: float
    sample: int
    ids: list[int]
    answer: str | list[int]   # the passkey (text) or the value ids (no tokenizer)
    new_tokens: int


def parse_lengths(text: str) -> list[int]:
    """"4K,8K,1M,1000" -> [4096, 8192, 1048576, 1000]."""
    out = []
    for part in text.split(","):
        p = part.strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20}.get(p[-1:], 1)
        try:
            n = int(float(p[:-1] if mult > 1 else p) * mult)
        except ValueError:
            raise ValueError(f"--lengths: {part!r} is not a length like 4096, 4K or 1M") from None
        if n < 1:
            raise ValueError(f"--lengths: {part!r} is not a positive length")
        out.append(n)
    return out


def parse_depths(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--depths must be comma-separated numbers in [0, 1], got {text!r}") from None
    bad = [d for d in out if not 0.0 <= d <= 1.0]
    if bad:
        raise ValueError(f"--depths must lie in [0, 1], got {bad}")
    return out


def _insert(filler: list[int], unit: int, needle: list[int], depth: float) -> list[int]:
    # at a boundary of the repeated unit (a sentence group), the one nearest the depth asked for
    at = round(depth * len(filler) / unit) * unit if unit else round(depth * len(filler))
    at = min(at, len(filler))
    return filler[:at] + needle + filler[at:]


def text_case(tok, length: int, depth: float, sample: int, seed: int) -> Case:
    rng = random.Random(f"{seed}:{length}:{depth}:{sample}")
    key = str(rng.randrange(10000, 100000))
    head = [tok.bos_token_id] if tok.bos_token_id is not None else []
    unit = tok(FILLER, add_special_tokens=False).input_ids
    needle = tok(NEEDLE.format(key=key), add_special_tokens=False).input_ids
    question = tok(QUESTION, add_special_tokens=False).input_ids
    room = length - len(head) - len(needle) - len(question)
    if room < 0:
        raise ValueError(f"length {length} is shorter than the needle and question ({length - room} tokens)")
    filler = (unit * (room // len(unit) + 1))[:room]
    return Case(length, depth, sample, head + _insert(filler, len(unit), needle, depth) + question, key, 8)


def token_case(vocab: int, length: int, depth: float, sample: int, seed: int, key_len: int = 4,
               value_len: int = 4) -> Case:
    rng = random.Random(f"{seed}:{length}:{depth}:{sample}")
    kr = random.Random(f"{seed}:key")  # the same key in every prompt
    key = [kr.randrange(vocab) for _ in range(key_len)]
    value = [rng.randrange(vocab) for _ in range(value_len)]
    room = length - 2 * key_len - value_len
    if room < 0:
        raise ValueError(f"length {length} is shorter than the needle and question ({length - room} tokens)")
    filler = [rng.randrange(vocab) for _ in range(room)]
    return Case(length, depth, sample, _insert(filler, 0, key + value, depth) + key, value, value_len)


def passkey_case(task: Passkey, length: int, depth: float, sample: int, seed: int) -> Case:
    """A prompt of ``length`` tokens in the format ``task`` trained on, the KEY marker at
    ``depth`` of the room before the question (where the task's own draws put it)."""
    L, P = task.key_len, len(task.sentence)
    q = length - 2  # the prompt ends with QUERY KEY; the answer is the L symbols after it
    if q - L - 3 < 0:
        raise ValueError(f"length {length} is too short for a passkey of {L} tokens ({L + 5} at least)")
    rng = random.Random(f"{seed}:{length}:{depth}:{sample}")
    phase = rng.randrange(P)
    filler = [int(task.sentence[(phase + i) % P]) for i in range(length)]
    key = [FIRST_SYMBOL + k for k in rng.sample(range(task.symbols), L)]
    at = 1 + round(depth * (q - L - 3))  # in [1, q - L - 2], the range of the task's draws
    ids = [BOS] + filler[1:length]
    ids[at:at + 1 + L] = [KEY] + key
    ids[q:q + 2] = [QUERY, KEY]
    return Case(length, depth, sample, ids, key, L)


def correct(case: Case, new_ids: list[int], tok) -> tuple[bool, str]:
    """(exact match, what the model answered)."""
    if tok is None:
        got = new_ids[:case.new_tokens]
        return got == case.answer, " ".join(map(str, got))
    text = tok.decode(new_ids, skip_special_tokens=True)
    m = re.search(r"\d+", text)
    return bool(m) and m.group(0) == case.answer, text.strip()


def heatmap(results: list[dict], lengths: list[int], depths: list[float], path: str, title: str) -> None:
    """Accuracy per (depth, length) cell as colour, each cell annotated; written to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    acc = np.full((len(depths), len(lengths)), np.nan)
    for r in results:
        acc[depths.index(r["depth"]), lengths.index(r["length"])] = r["accuracy"]
    fig, ax = plt.subplots(figsize=(1.1 * len(lengths) + 2.5, 0.45 * len(depths) + 1.8))
    im = ax.imshow(acc, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(lengths)), [_k(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if not np.isnan(acc[i, j]):
                ax.text(j, i, f"{acc[i, j]:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="exact-match accuracy")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _k(n: int) -> str:
    if n % (1 << 20) == 0:
        return f"{n >> 20}M"
    return f"{n >> 10}K" if n % 1024 == 0 else str(n)
