"""Our kernels against cuDNN in the records, and what ``auto`` runs per card beside them.

Five kinds of record time one of our kernels and cuDNN in the same launch on one GPU:

* ``lao_bench*`` (burstengine bench lao-bench): the plain forward, 32 q / 32 kv heads, and the ring
  step's forward_into / backward_into, 32 q heads on 32 or 8 kv heads (cuDNN plus the torch merge
  or gradient adds); its forward+backward rows are not read, as the rules choose the forward and
  the backward separately;
* ``gluon_*`` (benchmarks/probe_gluon.py, probe_gluon_fwd.py): the plain causal (and, in newer
  forward records, full) forward or backward at 24 q / 8 kv heads (the scripts' H, HKV), with
  variants behind flags;
* ``fp8_*`` (burstengine bench fp8): its bf16 rows, the plain forward (kernel "triton": Gluon on
  Hopper), 32 q / 8 kv heads;
* ``probe_head_dims*`` (benchmarks/probe_head_dims.py): the plain forward and backward at head dims
  64-256, 32 or 24 q / 8 kv heads ("ours" is TritonKernel: Gluon where it takes the call);
* ``probe_gluon_bwd*`` (benchmarks/probe_gluon_bwd_variants.py): the plain backward, or the ring
  step's backward_into (cuDNN plus the gradient adds), at d 64 and 128, 32 q / 8 kv heads, with
  variants;

at lengths the Gluon kernels take.  In the last two, whose rows span head dims, a method's name
ends in its head dim (``ours d64``), since a head dim's kernel can change alone.
:func:`comparisons` reads them as ``Versus`` rows.  Only the kernels as they are now count:
``TODAY`` names, per record and call, the methods that are today's kernels (the others of a probe
are variants); ``STALE`` lists the record parts that timed a kernel changed since, and
:func:`before_chunks` the rows of shapes whose kernel changed since.  :func:`disagreements` checks kernels/choices.py against the
rows that count (tests/kernels/test_choices.py); ``block_auto`` draws the table of docs/kernels.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...kernels.choices import AUTO_TABLE, CARDS, card_key
from ...kernels.gluon import grid
from ...kernels.registry import AutoKernel
from ..tables import med, span, table

# A shape where the two kernels' times differ by less than this fraction is a tie: either choice
# agrees with it.  Four launches of one kernel on one H100 spread this much and more at 8K
# (fp8_h100*.json: ours 0.95-1.08x cuDNN at 8K causal).
TIE = 0.03

# the head dims kernels/gluon takes, per call (d=256: fwd.py's wide build, bwd_wide.py; d=96: fwd.py's
# pieces, the forward only)
GLUON_DIMS = {**dict.fromkeys(("forward", "forward_into"), (64, 96, 128, 256)),
              **dict.fromkeys(("backward", "backward_into"), (64, 128, 256))}
GLUON_PROBE = dict(heads=24, kv_heads=8, head_dim=128)  # benchmarks/probe_gluon.py's H, HKV, D
FP8_SPEED = dict(heads=32, kv_heads=8, head_dim=128)  # bench fp8's speed inputs (probes/fp8.py)

# the ring step's backward_into as it is since 7f228ad, in probe_gluon_bwd_variants.py's names
_INTO_TODAY = ("ours lag=0 stagger=1 max_steps=1024 chunk=512 into d128",
               "ours lag=1 stagger=1 max_steps=1024 chunk=1024 into d64")
# record -> {call: the method that times today's kernel}
TODAY = {
    "fp8_h100.json": {"forward": "ours_bf16"},
    "fp8_h100_2.json": {"forward": "ours_bf16"},
    "fp8_h100_final.json": {"forward": "ours_bf16"},
    "fp8_h200.json": {"forward": "ours_bf16"},
    "fp8_h100_quant.json": {"forward": "ours_bf16"},
    "gluon_fwd_h100.json": {"forward": "gluon"},
    "gluon_fwd_h200.json": {"forward": "gluon"},
    "gluon_fwd_pipe_h200.json": {"forward": "gluon"},  # its "gluon pipe" is the variant dropped after ec1508e
    # 1d52501: the FFMA softmax; 24c1355 after it changed only the negative-scale build
    "gluon_fwd_maskfirst_h200.json": {"forward": "gluon"},
    "gluon_fwd_full_h200.json": {"forward": "gluon"},  # two launches at 62bb743, full blocks at 16K-128K
    "gluon_fwd_full2_h200.json": {"forward": "gluon"},
    "gluon_fwd_poly_d64_h200.json": {"forward": "gluon"},  # d=64; its "gluon polyN": POLY, dropped after 8793396
    # d=256 (f83f2ec), the plain forward and the ring step's forward_into (beside cuDNN + the torch merge)
    "gluon_fwd_d256_h200.json": {"forward": "gluon", "forward_into": "gluon-into"},
    "gluon_fwd_d96_h200.json": {"forward": "gluon", "forward_into": "gluon-into"},  # d=96 (51c48e5)
    "gluon_bwd_h100.json": {"backward": "gluon bwd"},
    "gluon_bwd_transposed_h200.json": {"backward": "gluon bwd tr=0"},  # the flag off: the kernel as kept
    "gluon_bwd_variants_h200.json": {"backward": "gluon bwd indep=0 pf=1 opaque=1"},  # what 9015d4e kept
    "lao_bench.json": {"backward_into": "ours"},  # at 9015d4e, the Gluon backward as it is
    # "ours" at d 96 and 256 was TritonKernel's fallback, cuDNN (d 64's backward was Triton's then),
    # Gluon at 64 and 128; d=256 is Gluon's since f83f2ec (forward) and bwd_wide.py (backward), d=96's
    # forward since 51c48e5, so those rows here no longer count
    "probe_head_dims_h200.json": {"forward": ("ours d64", "ours d128"), "backward": ("ours d96", "ours d128")},
    "probe_head_dims_lag_h200.json": {"forward": ("ours d64", "ours d128"),
                                      "backward": ("ours d64", "ours d96", "ours d128")},
    "probe_head_dims_short_h200.json": {"forward": ("ours d128", ), "backward": ("ours d128", )},
    "probe_head_dims_d64bwd_h200.json": {"forward": ("ours d64", "ours d128"), "backward": ("ours d128", )},
    "probe_head_dims_d64_long_h200.json": {"forward": ("ours d64", ), "backward": ("ours d64", )},  # 24 and 32 q heads
    "probe_head_dims_d256_h200.json": {"forward": ("ours d256", ), "backward": ("ours d256", )},  # at 71c106e
    # "ours v0" at d=128 is the kernel as kept (the variant bits off); at d=64 LAG is today's ("v4")
    "probe_gluon_bwd_variants_h200.json": {"backward": ("ours v0 d128", )},
    "probe_gluon_bwd_lag_h200.json": {"backward": ("ours v4 d64", )},
    "probe_gluon_bwd_lag2_h200.json": {"backward": ("ours v4 d64", "ours v0 d128")},
    "probe_gluon_bwd_stagger_h200.json": {"backward": ("ours lag=1 stagger=1 d64", "ours lag=0 stagger=1 d128")},
    # max_steps=1 is one q head a program, what MAX_STEPS (1,024) gives at 64K-128K
    "probe_gluon_bwd_split_h200.json": {"backward_into": ("ours lag=1 stagger=1 max_steps=1 into d64",
                                                          "ours lag=0 stagger=1 max_steps=1 into d128")},
    # chunk=512 at d=128, 1,024 at d=64: gluon/grid.py's Q_CHUNK (7f228ad)
    "probe_gluon_bwd_chunk_into_h200.json": {"backward_into": _INTO_TODAY},
    # 8K-32K; its "max_steps=1" rows are the variant (one q head a program at every length)
    "probe_gluon_bwd_short_split_h200.json": {"backward_into": _INTO_TODAY},
    # the check after grid.py's plan() (e41dca4), and 16K timed three times
    "probe_gluon_bwd_check_h200.json": {"backward": ("ours lag=0 stagger=1 max_steps=1024 chunk=512 d128",
                                                     "ours lag=1 stagger=1 max_steps=1024 chunk=1024 d64")},
    # d=256 (bwd_wide.py): sdp=1 the kernel as kept, sdp=0 the split by kv columns behind the flag
    "probe_gluon_bwd_d256_sdp_h200.json": {"backward": ("ours lag=0 stagger=1 max_steps=1024 chunk=256 sdp=1 d256", )},
    "probe_gluon_bwd_d256_into_h200.json": {
        "backward_into": ("ours lag=0 stagger=1 max_steps=1024 chunk=256 sdp=1 into d256", )},
    "probe_gluon_bwd_chunk_plain_h200.json": {"backward": (
        "ours lag=0 stagger=1 max_steps=1024 chunk=512 d128", "ours lag=1 stagger=1 max_steps=1024 chunk=1024 d64")},
}
_FFMA = "the Gluon forward changed after it (1d52501: the FFMA softmax)"
_SPILLS = "the Gluon backward changed after it (9015d4e: the spill fix)"
_LAG = "at d=64, the Gluon backward before LAG (37b24ab)"
STALE = {
    ("lao_bench.json", "forward"): _FFMA,
    ("lao_bench.json", "forward_into"): _FFMA,
    ("lao_bench_h100.json", "forward"): _FFMA,
    ("gluon_fwd_variants_h200.json", "forward"): "29508cb: the FFMA softmax still behind a flag",
    ("gluon_variants_h200.json", "forward"): _FFMA,
    ("gluon_variants_h200.json", "backward"): _SPILLS,
    ("gluon_bwd_indep_h200.json", "backward"): _SPILLS,
    ("gluon_bwd_prefetch_h200.json", "backward"): _SPILLS,
    ("gluon_wide_h200.json", "forward"): "443989c: the wide kv tiles' branch, dropped after it (335b3d1)",
    ("probe_head_dims_h200.json", "backward"): "at d=64, the Triton backward (the Gluon one takes d=64 since 360580b)",
    ("probe_head_dims_d64bwd_h200.json", "backward"): _LAG,
    ("probe_gluon_bwd_variants_h200.json", "backward"): _LAG + "; v1, v2: variants dropped after it",
    ("probe_gluon_bwd_lag2_h200.json", "backward"): "v12 at both head dims: a variant dropped after it",
    ("probe_gluon_bwd_stagger_h200.json", "backward"): "stagger=0: full blocks before STAGGER (d3679ef)",
    ("probe_gluon_bwd_split_h200.json", "backward_into"): "max_steps off and 4096: the group split later than "
                                                          "MAX_STEPS splits it now",
    ("probe_gluon_bwd_d256_h200.json", "backward"): "d=256's first build (6461e33): S and dP split by kv columns, "
                                                     "dQ pieces one after another; SDP since",
    ("probe_gluon_bwd_chunk_sweep_h200.json", "backward_into"): "d369722: chunk sizes swept before Q_CHUNK was set "
                                                                "per head dim (and the loop's % since replaced)",
}
# Full blocks of more q tiles than gluon/grid.py's Q_CHUNK (d=128 past 32K rows, d=64 past 64K): the
# Gluon backward cuts them into chunks since 7f228ad; the records named here were made after, the
# others before
_CHUNKED = ("probe_gluon_bwd_chunk_into_h200.json", "probe_gluon_bwd_chunk_plain_h200.json",
            "probe_head_dims_d64_long_h200.json", "probe_gluon_bwd_short_split_h200.json",
            "probe_gluon_bwd_check_h200.json")
# rows; d=256's backward (bwd_wide.py) had chunks from its first build
_CHUNKS_FROM = {d: grid.Q_CHUNK[d] * grid.Q_ROWS[d] for d in (64, 128)}
_BEFORE_CHUNKS = "full blocks of d=128 past 32K rows and d=64 past 64K, timed before the chunks (7f228ad)"


def before_chunks(r) -> bool:
    """Whether ``r`` timed the Gluon backward on a full block it now cuts into chunks, before it did."""
    return (r.call in ("backward", "backward_into") and r.mask == "full" and r.record not in _CHUNKED
            and r.S > _CHUNKS_FROM.get(r.head_dim, r.S))


@dataclass(frozen=True)
class Versus:
    """One timing of one of our kernels beside cuDNN's in the same launch."""

    record: str
    card: str  # the device's name
    call: str  # kernels/choices.py's: "forward", "backward" (plain), the ring step's "forward_into", "backward_into"
    mask: str
    heads: int
    kv_heads: int
    head_dim: int
    S: int  # query rows = keys
    method: str  # the record's name for ours
    ours_s: float
    cudnn_s: float

    @property
    def speedup(self) -> float:
        return self.cudnn_s / self.ours_s


def _lao(name, rec, card):
    sl, rs = rec.get("single_launch") or {}, rec.get("ring_step") or {}
    times = {(r["S"], r["mask"], r["method"]): med(r["times"]) for r in sl.get("rows", [])
             if r.get("what") == "fwd" and r.get("times")}
    for (S, mask, method), t in times.items():
        if method == "ours" and (S, mask, "cudnn") in times:
            yield Versus(name, card, "forward", mask, sl["heads"], sl["heads"], sl["head_dim"], S, method, t,
                         times[(S, mask, "cudnn")])
    ring = {(r["n"], r["hkv"], r["mask"], r["what"], r["kernel"]): med(r["times"]) for r in rs.get("rows", [])
            if r.get("times")}
    for (n, hkv, mask, what, kernel), t in ring.items():
        if kernel == "ours" and (n, hkv, mask, what, "cudnn") in ring:
            yield Versus(name, card, what, mask, rs["heads"], hkv, rs["head_dim"], n, kernel, t,
                         ring[(n, hkv, mask, what, "cudnn")])


def _probe(name, rec, card):
    # rows with a "mask" name their methods "<method> <mask>" (probe_gluon_fwd.py since ec1508e);
    # the others are causal
    times = {(r["S"], r.get("mask", "causal"), r["method"].removesuffix(f" {r['mask']}") if "mask" in r
              else r["method"]): med(r["times"]) for r in rec.get("bench", []) if "method" in r}
    for (S, mask, method), t in times.items():
        # "<method>-into": the ring step's forward_into (probe_gluon_fwd.py --into)
        call = "backward" if "bwd" in method else "forward_into" if method.endswith("-into") else "forward"
        base = {"forward": ("cudnn", "cudnn fwd"), "forward_into": ("cudnn-into", ), "backward": ("cudnn bwd", )}[call]
        cudnn = next((times[(S, mask, b)] for b in base if (S, mask, b) in times), None)
        if method not in base and not method.startswith("cudnn") and cudnn is not None:
            # the head dim where the record names it (probe_gluon_fwd.py --d since a90b813)
            yield Versus(name, card, call, S=S, method=method, ours_s=t, cudnn_s=cudnn, mask=mask,
                         **dict(GLUON_PROBE, head_dim=rec.get("head_dim", GLUON_PROBE["head_dim"])))


def _fp8(name, rec, card):
    for r in rec.get("speed", []):
        yield Versus(name, card, "forward", r["mask"], S=r["S"], method="ours_bf16", ours_s=r["ours_bf16"]["s"],
                     cudnn_s=r["cudnn"]["s"], **FP8_SPEED)


def _head_dims(name, rec, card):
    rows = [r for r in rec.get("rows", []) if "error" not in r and "fwd_s" in r]
    times = {(r["D"], r.get("H", rec["heads"]), r["S"], r["mask"], r["method"]): r for r in rows}
    for (D, H, S, mask, method), r in times.items():
        c = times.get((D, H, S, mask, "cudnn"))
        if method != "cudnn" and c is not None:
            for call, key in (("forward", "fwd_s"), ("backward", "bwd_s")):
                yield Versus(name, card, call, mask, H, rec["kv_heads"], D, S, f"{method} d{D}", med(r[key]),
                             med(c[key]))


def _bwd_variants(name, rec, card):
    # rows of the ring step's backward_into (--into) name it in "call"; cuDNN's include the adds
    times = {(r.get("call", "backward"), r["D"], r["S"], r["mask"], r["method"]): med(r["times"])
             for r in rec.get("rows", [])}
    for (call, D, S, mask, method), t in times.items():
        c = times.get((call, D, S, mask, "cudnn"))
        if method != "cudnn" and c is not None:
            yield Versus(name, card, call, mask, rec["heads"], rec["kv_heads"], D, S, f"{method} d{D}", t, c)


_FAMILIES = (("lao_bench", _lao), ("gluon_", _probe), ("fp8_", _fp8), ("probe_head_dims", _head_dims),
             ("probe_gluon_bwd", _bwd_variants))


def comparisons(records) -> list[Versus]:
    """Every timing of ours beside cuDNN in ``records`` [(file name, record)], today's or not."""
    out = []
    for name, rec in records:
        card = rec.get("env", {}).get("device", "")
        for prefix, read in _FAMILIES:
            if name.startswith(prefix):
                out += read(name, rec, card)
    return out


def today(record: str, call: str) -> tuple[str, ...]:
    """The methods of ``record`` that time today's kernel for ``call``."""
    names = TODAY.get(record, {}).get(call, ())
    return (names, ) if isinstance(names, str) else names


def counted(rows) -> list[Versus]:
    """The rows that timed today's kernels (``TODAY``, but not ``before_chunks``)."""
    return [r for r in rows if r.method in today(r.record, r.call) and not before_chunks(r)]


def unclassified(rows) -> list[tuple[str, str]]:
    """(record, call) of rows neither ``TODAY`` nor ``STALE`` names: a new record to sort."""
    return sorted({(r.record, r.call) for r in rows if r.call not in TODAY.get(r.record, {})
                   and (r.record, r.call) not in STALE})


def shapes(rows) -> dict[tuple, list[Versus]]:
    """Rows by what they timed: (card, call, mask, heads, kv heads, head dim, S); a shape timed in
    several launches has several rows."""
    out = {}
    for r in rows:
        out.setdefault((r.card, r.call, r.mask, r.heads, r.kv_heads, r.head_dim, r.S), []).append(r)
    return out


def speedup(group: list[Versus]) -> float:
    """cuDNN's time over ours for one shape: the median over the launches that timed it."""
    return med([r.speedup for r in group])


def verdict(x: float, tie: float = TIE) -> str:
    """"ours", "cudnn" or "tie" for a shape whose cuDNN time is ``x`` times ours."""
    if x > 1 + tie:
        return "ours"
    if x < 1 / (1 + tie):
        return "cudnn"
    return "tie"


def chosen(auto: AutoKernel, group: list[Versus]) -> str:
    """What ``auto`` runs for this shape: "ours" or the kernel's name.  The records' lengths are
    multiples of 128 on Hopper, so the Gluon kernels take a shape iff they take its head dim."""
    r = group[0]
    name = auto.choose(r.call, r.mask, r.S, r.S, r.card, r.head_dim, takes=lambda: r.head_dim in GLUON_DIMS[r.call])
    return "ours" if name == "triton" else name


def disagreements(records, table=None, cards=None, tie: float = TIE) -> list[str]:
    """Where the rules (kernels/choices.py, or ``table`` / ``cards``) disagree with today's rows
    of the cards they name: a shape whose median speedup leaves the tie band for one kernel while
    the rules run the other; and a card's rule that no shape decides in its favour."""
    auto = AutoKernel(table, cards=cards)
    plain = AutoKernel(table, cards={})
    groups = [g for g in shapes(counted(comparisons(records))).values() if card_key(g[0].card, auto.cards)]
    out = []
    for g in groups:
        r, faster, got = g[0], verdict(speedup(g), tie), chosen(auto, g)
        if faster != "tie" and faster != got:
            out.append(f"{r.card} {r.call} {r.mask} {r.heads}/{r.kv_heads} heads d={r.head_dim} S={r.S}: ours "
                       f"{speedup(g):.3f}x cuDNN ({', '.join(sorted({x.record for x in g}))}) but auto runs {got}")
    for key, rules in auto.cards.items():
        for call, kind, d in rules:
            backed = [g for g in groups if card_key(g[0].card, auto.cards) == key
                      and (g[0].call, g[0].mask, g[0].head_dim) == (call, kind, d)
                      and chosen(auto, g) != chosen(plain, g)
                      and verdict(speedup(g), tie) == chosen(auto, g)]
            if not backed:
                out.append(f"CARDS[{key!r}][{(call, kind, d)!r}] changes auto's choice where no record of today's "
                           "kernels says it is faster")
    return out


# --- docs/kernels.md ------------------------------------------------------------------------------

_NAMES = {"cudnn": "cuDNN", "triton": "Triton", "gluon": "Gluon", "reference": "reference", "flash": "flash"}
_CALLS = (("forward", "plain forward"), ("forward_into", "ring step forward_into"),
          ("backward", "plain backward"), ("backward_into", "ring step backward_into"))


def _rules_text(rules) -> str:
    return ", then ".join(_NAMES[n] + (f" up to {rows // 1024}K rows" if rows else "") for rows, n in rules)


def _card_text(call, kind, own: dict) -> str:
    # a card's own rules per head dim, then AUTO_TABLE's per head dim, then AUTO_TABLE's
    base = _rules_text(AUTO_TABLE[(call, kind)])
    rules = {**{key[2]: r for key, r in AUTO_TABLE.items() if len(key) == 3 and key[:2] == (call, kind)},
             **{d: r for (c, k, d), r in own.items() if (c, k) == (call, kind)}}
    if not rules:
        return base
    return "; ".join([f"d={d}: {_rules_text(rules[d])}" for d in sorted(rules)] + [f"other d: {base}"])


def block_auto(records):
    """docs/kernels.md: what auto runs per card (kernels/choices.py) and today's rows behind it."""
    cards = list(CARDS)
    rules = [[label, kind if kind != "spec" else "MaskSpec"]
             + [_card_text(call, kind, CARDS[c]) for c in cards] + [_card_text(call, kind, {})]
             for call, label in _CALLS for kind in ("full", "causal", "strict", "spec")]
    auto = AutoKernel()
    rows = counted(comparisons(records))
    body = []
    for _, g in sorted(shapes(rows).items()):
        r, got = g[0], chosen(auto, g)
        runs = f" ({len(g)} launches: {span([x.speedup for x in g])}×)" if len(g) > 1 else ""
        records_ = ", ".join(f"`{n}`" for n in sorted({x.record for x in g}))
        body.append([card_key(r.card) or r.card, r.call, r.mask, r.head_dim, f"{r.heads}/{r.kv_heads}",
                     f"{r.S // 1024}K", f"{speedup(g):.2f}×{runs}", records_, _NAMES.get(got, got)])
    stale = {}
    for (name, call), why in STALE.items():
        stale.setdefault(why, []).append(f"`{name}` ({call})")
    return "\n".join(
        ["Rules per card (first match wins; Gluon: kernels/gluon where it takes the block, else the next rule; "
         "a card is known by a word of its device name):", ""]
        + table(["call", "mask"] + cards + ["other cards"], rules)
        + [f"Today's kernels beside cuDNN in the records, lengths the Gluon kernels take (ours/cuDNN: "
           f"cuDNN's time over ours, the median where a shape was timed in several launches; within "
           f"{100 * TIE:.0f}% either choice agrees):", ""]
        + table(["card", "call", "mask", "d", "q/kv heads", "S", "ours/cuDNN", "records", "auto runs"], body)
        + ["Not counted, as they timed a kernel changed since: "
           + "; ".join(f"{', '.join(v)}: {why}" for why, v in stale.items()) + f"; and the rows of {_BEFORE_CHUNKS}."])


BLOCKS = {"auto-choices": block_auto}
