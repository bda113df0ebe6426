"""What ``kernel="auto"`` runs on CUDA, per card: the rules registry.AutoKernel walks.

A rule list is (most query rows in the block, kernel) pairs, first match wins; the kernel is one
of registry.KERNELS by name, or "gluon": kernels/gluon where it takes the block (Hopper, bf16/fp16,
lengths multiples of 128, d 64/128/256, and 96 for the forward; TritonKernel runs it), else the
next pair.  Calls: "forward" (plain), "forward_into" (the ring step onto a running (O, lse)),
"backward" (plain: fresh gradients, what a direct caller of the kernel API gets) and
"backward_into" (the ring step onto float32 gradients: what the ring, training and a one-rank
ring run; cuDNN needs separate gradient adds there).

``AUTO_TABLE`` holds the rules of every card, keyed (call, mask kind), and (call, mask kind, head
dim) where a head dim differs; ``CARDS`` the rules a card measured otherwise, by a word of its
device name and keyed (call, mask kind, head dim): the head dims the records measured, so an
unmeasured head dim keeps ``AUTO_TABLE``'s rule.  Each entry names the records behind it
(benchmarks/results/); bench/probes/vs_cudnn.py reads those records, and
tests/kernels/test_choices.py fails when a rule here disagrees with them.
"""
from __future__ import annotations

import torch

from ..masks import CAUSAL, FULL, STRICT

# Every card, as measured on one H200 (the rules before cards had their own):
# - the ring step's forward_into of a full/causal/strict block: Gluon, 1.03-1.35x cuDNN + the torch
#   merge on every ring-step case of lao_bench.json (commit 9015d4e, before the FFMA softmax of
#   1d52501 that sped the Gluon forward up; not timed again since);
# - the backward (plain or ring step): Gluon, 1.03-1.23x cuDNN + the gradient adds on every ring-step
#   case of lao_bench.json, 1.00-1.05x cuDNN's plain backward at 16K-128K, causal, 24 q / 8 kv heads
#   (gluon_bwd_variants_h200.json, gluon_bwd_transposed_h200.json);
# - the backward at d=64 (Gluon's since 360580b, measured on H200 only): cuDNN, but where a card's
#   records say ours is faster (CARDS);
# - elsewhere cuDNN (not Hopper, lengths not multiples of 128), except a strict block's forward up
#   to 8K rows, where SDPA pays a shifted call and Triton is faster;
# - "spec": any MaskSpec (windows, documents, block masks), which SDPA cannot express; registry.py
#   sends one whose visible pairs lie mostly in large pieces to cuDNN piece by piece.
AUTO_TABLE = {
    ("forward", FULL): [(None, "cudnn")],
    ("forward", CAUSAL): [(None, "cudnn")],
    ("forward", STRICT): [(8192, "triton"), (None, "cudnn")],
    ("forward", "spec"): [(None, "triton")],
    ("forward_into", FULL): [(None, "gluon"), (None, "cudnn")],
    ("forward_into", CAUSAL): [(None, "gluon"), (None, "cudnn")],
    ("forward_into", STRICT): [(None, "gluon"), (8192, "triton"), (None, "cudnn")],
    ("forward_into", "spec"): [(None, "triton")],
    ("backward", FULL): [(None, "gluon"), (None, "cudnn")],
    ("backward", CAUSAL): [(None, "gluon"), (None, "cudnn")],
    ("backward", STRICT): [(None, "gluon"), (None, "cudnn")],
    ("backward", "spec"): [(None, "triton")],
    ("backward_into", FULL): [(None, "gluon"), (None, "cudnn")],
    ("backward_into", CAUSAL): [(None, "gluon"), (None, "cudnn")],
    ("backward_into", STRICT): [(None, "gluon"), (None, "cudnn")],
    ("backward_into", "spec"): [(None, "triton")],
    **{(call, kind, 64): [(None, "cudnn")] for call in ("backward", "backward_into") for kind in (FULL, CAUSAL, STRICT)},
    # d=256: the Gluon kernels take it since f83f2ec (forward) and bwd_wide.py (backward), measured
    # on H200 only (CARDS)
    **{(call, kind, 256): [(None, "cudnn")] for call in ("forward_into", "backward", "backward_into")
       for kind in (FULL, CAUSAL, STRICT)},
    # d=96: the Gluon forward takes it in two column pieces (fwd.py's PIECES); until a card measures it
    **{("forward_into", kind, 96): [(None, "cudnn")] for kind in (FULL, CAUSAL, STRICT)},
}

# cuDNN up to 8K rows (ours 0.89-1.08x there, median 0.93x full and 0.98x causal on H100), the
# Gluon forward above
_GLUON_ABOVE_8K = [(8192, "cudnn"), (None, "gluon"), (None, "cudnn")]

CARDS = {
    # "NVIDIA H100 80GB HBM3": the plain forward, 32 q / 8 kv heads, d=128, in fp8_h100.json,
    # fp8_h100_2.json, fp8_h100_quant.json, fp8_h100_final.json (their bf16 rows, four launches):
    # causal 8K 0.95-1.08x, 32K 1.01-1.08x, 128K 1.13-1.15x; full 8K 0.89-0.99x, 32K 1.02-1.08x,
    # 128K 1.00-1.04x; 24 q / 8 kv heads, causal, gluon_fwd_h100.json: 16K 1.03x, 64K 1.07x.
    # The backward stays Gluon: gluon_bwd_h100.json 0.98x at 16K, 1.02x at 64K (within the tie).
    "H100": {
        ("forward", FULL, 128): _GLUON_ABOVE_8K,
        ("forward", CAUSAL, 128): _GLUON_ABOVE_8K,
    },
    # "NVIDIA H200", ours over cuDNN in the records (vs_cudnn's table in docs/kernels.md), 24 or 32
    # q heads on 8 kv heads.  The plain forward at d=128: causal 0.98-1.08x at 8K, 0.95-1.11x at
    # 16K, 0.99-1.06x at 32K, 1.05x at 64K, 1.11-1.14x at 128K; full 0.83-0.92x at 8K, 0.91-1.07x
    # at 16K, 0.97-1.05x at 32K, 0.99-1.03x at 64K-128K: cuDNN's up to 16K there.  At d=64: causal
    # 0.93-1.03x up to 64K and 0.99-1.03x at 128K (cuDNN's); full 0.88-0.97x at 16K, 0.98-1.02x at
    # 64K, 1.02-1.04x at 128K (Gluon's past 64K).
    #
    # The plain backward at d=128: causal 0.85-0.89x at 8K and about 0.96x at 16K, level above;
    # full 0.89-0.91x at 8K, 0.97-1.04x at 16K, level at 32K-128K (128K: 0.90x until full blocks
    # were cut into chunks of q tiles, 1.01x since: probe_gluon_bwd_chunk_plain_h200.json).  At
    # d=64: full 0.92x at 16K, level above; causal 0.97-0.99x at 16K, 1.06-1.10x at 64K-128K, and
    # the ring step's backward_into causal 0.88x at 8K (probe_gluon_bwd_short_split_h200.json), 1.00x
    # at 16K, 1.05-1.12x at 32K-128K: Gluon on causal d=64 blocks past 8K rows, both calls (the plain
    # one has no 8K record; it follows the ring step's).  At d=128 the ring step's backward_into keeps
    # Gluon everywhere (AUTO_TABLE): level with cuDNN and its adds at 128K full since the chunks.
    "H200": {
        ("forward", CAUSAL, 128): _GLUON_ABOVE_8K,
        ("forward", FULL, 128): [(16384, "cudnn"), (None, "gluon"), (None, "cudnn")],
        ("forward", FULL, 64): [(65536, "cudnn"), (None, "gluon"), (None, "cudnn")],
        ("backward", CAUSAL, 128): [(16384, "cudnn"), (None, "gluon"), (None, "cudnn")],
        ("backward", FULL, 128): [(8192, "cudnn"), (None, "gluon"), (None, "cudnn")],
        ("backward", CAUSAL, 64): [(8192, "cudnn"), (None, "gluon"), (None, "cudnn")],
        ("backward_into", CAUSAL, 64): [(8192, "cudnn"), (None, "gluon"), (None, "cudnn")],
        # d=256 (gluon_fwd_d256_h200.json, 24 q / 8 kv heads; probe_head_dims_d256_h200.json, 32): the
        # plain causal forward 1.00-1.20x at 8K-128K, the full one 0.90-1.01x (cuDNN's); the ring
        # step's forward_into 1.13-1.43x causal, 1.02-1.23x full, beside cuDNN + the torch merge
        ("forward", CAUSAL, 256): [(None, "gluon"), (None, "cudnn")],
        ("forward_into", CAUSAL, 256): [(None, "gluon"), (None, "cudnn")],
        ("forward_into", FULL, 256): [(None, "gluon"), (None, "cudnn")],
        # d=256's backward (bwd_wide.py, SDP; probe_gluon_bwd_d256_sdp_h200.json, ..._into_h200.json,
        # 32 q / 8 kv heads, 16K-64K): full blocks 1.03x cuDNN plain, 1.04x beside cuDNN + the adds;
        # causal 0.96-0.97x plain (with probe_head_dims_d256_h200.json's), 0.99-1.01x backward_into
        # (ties: cuDNN's)
        ("backward", FULL, 256): [(None, "gluon"), (None, "cudnn")],
        ("backward_into", FULL, 256): [(None, "gluon"), (None, "cudnn")],
        # d=96, the forward in column pieces (gluon_fwd_d96_h200.json, one launch, 24 q / 8 kv heads):
        # plain causal 0.90x at 8K, 1.02x at 16K, 1.09-1.22x at 64K-128K; plain full 0.81-0.90x up to
        # 16K, 1.00-1.04x at 64K-128K; forward_into 1.05-1.33x causal, 0.97-1.12x full
        ("forward", CAUSAL, 96): [(8192, "cudnn"), (None, "gluon"), (None, "cudnn")],
        ("forward", FULL, 96): [(16384, "cudnn"), (None, "gluon"), (None, "cudnn")],
        ("forward_into", CAUSAL, 96): [(None, "gluon"), (None, "cudnn")],
        ("forward_into", FULL, 96): [(None, "gluon"), (None, "cudnn")],
    },
}


def card_key(name: str, cards: dict = CARDS) -> str | None:
    """The first key of ``cards`` that is a word of the device ``name`` ("H200" is NVIDIA H200
    and H200 NVL, not GH200); None for a card they do not name."""
    words = name.split()
    return next((key for key in cards if key in words), None)


def card_rules(name: str, cards: dict = CARDS) -> dict:
    """The rules ``cards`` hold for the device ``name`` ({}: the card keeps ``AUTO_TABLE``)."""
    key = card_key(name, cards)
    return {} if key is None else cards[key]


def device_name(device) -> str:
    """The device's name ("NVIDIA H100 80GB HBM3"); "" off CUDA."""
    device = torch.device(device)
    return torch.cuda.get_device_properties(device).name if device.type == "cuda" else ""
