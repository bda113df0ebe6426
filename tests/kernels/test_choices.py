"""What ``auto`` runs per card (kernels/choices.py): the rules agree with the committed records
(bench/probes/vs_cudnn.py reads them), and the dispatch follows the card's name, read from the
device (mocked here: no GPU), with ``gluon=False`` keeping every call off Gluon."""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from burstengine.bench.probes import vs_cudnn
from burstengine.cli.report import load_records
from burstengine.kernels import AUTO_TABLE, CARDS, KERNELS, AutoKernel, choices, registry
from burstengine.masks import CAUSAL, FULL, STRICT, MaskSpec

RECORDS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
H100, H200, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB"

# AUTO_TABLE and the Gluon rules before cards had rules of their own: forward_into and the backward
# of a full/causal/strict block Gluon takes ran there, everything else by this table
BEFORE = {
    ("forward", FULL): [(None, "cudnn")],
    ("forward", CAUSAL): [(None, "cudnn")],
    ("forward", STRICT): [(8192, "triton"), (None, "cudnn")],
    ("forward", "spec"): [(None, "triton")],
    ("backward", FULL): [(None, "cudnn")],
    ("backward", CAUSAL): [(None, "cudnn")],
    ("backward", STRICT): [(None, "cudnn")],
    ("backward", "spec"): [(None, "triton")],
}


def _before(call, mask, sq, takes, d=128):
    # the Gluon backward took d=128 only before 360580b: a backward at d=64 went to cuDNN
    if call != "forward" and takes and mask in (FULL, CAUSAL, STRICT) and (call == "forward_into" or d == 128):
        return "triton"
    kind = "spec" if isinstance(mask, MaskSpec) else mask
    return next(n for rows, n in BEFORE[("backward" if call.startswith("backward") else "forward", kind)]
                if rows is None or sq <= rows)


@pytest.fixture(scope="module")
def records():
    return load_records(str(RECORDS))


def test_every_record_of_ours_beside_cudnn_is_sorted(records):
    """A new lao_bench/gluon/fp8 record must be named in vs_cudnn.TODAY or STALE, so none is
    skipped unread; and the records give rows of today's kernels on both cards the rules name."""
    rows = vs_cudnn.comparisons(records)
    assert vs_cudnn.unclassified(rows) == []
    # and each name there matches rows (a misspelt method would count nothing)
    for name, calls in vs_cudnn.TODAY.items():
        for call in calls:
            for method in vs_cudnn.today(name, call):
                assert any((r.record, r.call, r.method) == (name, call, method) for r in rows), (name, call, method)
    for name, call in vs_cudnn.STALE:
        assert any((r.record, r.call) == (name, call) for r in rows), (name, call)
    counted = vs_cudnn.counted(rows)
    for key in CARDS:
        assert any(key in r.card for r in counted), key


def test_rules_agree_with_the_records(records):
    assert vs_cudnn.disagreements(records) == []


def _cards(**change):
    cards = {k: dict(v) for k, v in CARDS.items()}
    for key, rules in change.items():
        cards[key].update(rules)
    return cards


def test_rules_against_the_records_are_caught(records):
    """The check fails when a rule contradicts a record, or a card's rule has no record for it."""
    # H100 plain causal forward back on cuDNN: ours is 1.15x at 128K
    bad = vs_cudnn.disagreements(records, cards=_cards(H100={("forward", CAUSAL, 128): [(None, "cudnn")]}))
    assert any("H100" in d and "forward causal 32/8" in d and "S=131072" in d for d in bad), bad
    # H200 plain causal forward on cuDNN: ours is 1.12x at 128K
    bad = vs_cudnn.disagreements(records, cards=_cards(H200={("forward", CAUSAL, 128): [(None, "cudnn")]}))
    assert any("NVIDIA H200 forward causal" in d and "S=131072" in d for d in bad), bad
    # H100 plain forward on Gluon at 8K too: cuDNN is 1.07x on full blocks there
    everywhere = [(None, "gluon"), (None, "cudnn")]
    bad = vs_cudnn.disagreements(records, cards=_cards(H100={("forward", FULL, 128): everywhere}))
    assert any("forward full 32/8" in d and "S=8192" in d for d in bad), bad
    # H200's full forward on Gluon from 8K: cuDNN's is faster at 16K (the median of its launches)
    above_8k = CARDS["H100"][("forward", FULL, 128)]
    bad = vs_cudnn.disagreements(records, cards=_cards(H200={("forward", FULL, 128): above_8k}))
    assert any("H200 forward full 24/8" in d and "S=16384" in d for d in bad), bad
    # a card's rule no record backs: H200's strict backward on cuDNN (no record of either there)
    bad = vs_cudnn.disagreements(records, cards=_cards(H200={("backward", STRICT, 128): [(None, "cudnn")]}))
    assert any("CARDS['H200']" in d and "'strict'" in d for d in bad), bad
    # every card's ring-step backward on cuDNN: ours is 1.03-1.23x in lao_bench.json
    table = {**AUTO_TABLE, **{("backward_into", m): [(None, "cudnn")] for m in (FULL, CAUSAL, STRICT)}}
    bad = vs_cudnn.disagreements(records, table=table)
    assert any("backward_into strict" in d for d in bad), bad
    # H200's plain backward on Gluon at 8K: cuDNN's is 1.13x there (probe_head_dims_short_h200.json)
    bad = vs_cudnn.disagreements(records, cards=_cards(H200={("backward", CAUSAL, 128): AUTO_TABLE[("backward", CAUSAL)]}))
    assert any("H200 backward causal" in d and "d=128 S=8192" in d for d in bad), bad
    # and at d=64 full, 16K (ours 0.93x, three launches)
    bad = vs_cudnn.disagreements(records, cards=_cards(H200={("backward", FULL, 64): AUTO_TABLE[("backward", FULL)]}))
    assert any("H200 backward full" in d and "d=64 S=16384" in d for d in bad), bad
    # H200's causal d=64 backward on cuDNN: ours is 1.08x at 64K
    bad = vs_cudnn.disagreements(records, cards=_cards(H200={("backward", CAUSAL, 64): [(None, "cudnn")]}))
    assert any("H200 backward causal" in d and "d=64 S=65536" in d for d in bad), bad
    # H200's causal d=256 forward on cuDNN: ours is 1.18x at 128K (gluon_fwd_d256_h200.json)
    bad = vs_cudnn.disagreements(records, cards=_cards(H200={("forward", CAUSAL, 256): [(None, "cudnn")]}))
    assert any("H200 forward causal" in d and "d=256 S=131072" in d for d in bad), bad
    # and its full one on Gluon: cuDNN is 1.03x at 128K
    bad = vs_cudnn.disagreements(records, cards=_cards(H200={("forward", FULL, 256): [(None, "gluon"), (None, "cudnn")]}))
    assert any("H200 forward full" in d and "d=256 S=131072" in d for d in bad), bad
    # H200's causal d=256 backward on Gluon: cuDNN is 1.04x at 16K (probe_head_dims_d256_h200.json)
    bad = vs_cudnn.disagreements(records, cards=_cards(H200={("backward", CAUSAL, 256): [(None, "gluon"), (None, "cudnn")]}))
    assert any("H200 backward causal" in d and "d=256 S=16384" in d for d in bad), bad
    # H200's full d=96 forward on Gluon from 8K: cuDNN is 1.23x there (gluon_fwd_d96_h200.json)
    bad = vs_cudnn.disagreements(records, cards=_cards(H200={("forward", FULL, 96): [(None, "gluon"), (None, "cudnn")]}))
    assert any("H200 forward full" in d and "d=96 S=8192" in d for d in bad), bad
    # without the tie band, H100's backward at 16K (ours 0.98x) would ask for cuDNN
    bad = vs_cudnn.disagreements(records, tie=0.0)
    assert any("H100" in d and "backward causal" in d and "S=16384" in d for d in bad), bad


def test_rules_name_kernels_and_end_with_a_catch_all():
    for rules in [*AUTO_TABLE.values(), *(r for card in CARDS.values() for r in card.values())]:
        assert rules[-1][0] is None and rules[-1][1] != "gluon", rules
        assert all(n in KERNELS or n == "gluon" for _, n in rules), rules
        assert all(n != "fp8" for _, n in rules)
    for card in CARDS.values():
        for call, kind, d in card:
            assert (call, kind) in AUTO_TABLE and d in vs_cudnn.GLUON_DIMS[call]
    for key in AUTO_TABLE:  # head-dim rules of every card: a kind AUTO_TABLE has, a head dim Gluon takes
        assert len(key) == 2 or (key[:2] in AUTO_TABLE and key[2] in vs_cudnn.GLUON_DIMS[key[0]]), key


@pytest.mark.parametrize("gluon", [True, False])
@pytest.mark.parametrize("card", ["", A100, "NVIDIA GH200 480GB"])
def test_other_cards_choose_as_before(card, gluon):
    """A card the rules do not name (and no card: CPU) chooses exactly as before, for every call,
    mask kind, head dim and size, whether Gluon takes the block or not."""
    auto = AutoKernel(gluon=gluon)
    spec = MaskSpec(causal=True, q_step=2, k_step=3)
    for call in ("forward", "forward_into", "backward", "backward_into"):
        for mask in (FULL, CAUSAL, STRICT, spec):
            for sq in (1024, 8192, 8320, 131072):
                for d in (64, 128):
                    for takes in (True, False):
                        got = auto.choose(call, mask, sq, sq, card, d, takes=lambda: takes)
                        assert got == _before(call, mask, sq, takes and gluon, d), (call, mask, sq, d, takes)


def test_h100_and_h200_plain_forward():
    auto, off = AutoKernel(), AutoKernel(gluon=False)
    yes = lambda: True  # noqa: E731  (Gluon takes the block)
    S = 131072
    assert auto.choose("forward", CAUSAL, S, S, H100, 128, takes=yes) == "triton"
    assert auto.choose("forward", FULL, S, S, H100, 128, takes=yes) == "triton"
    # H200: the causal forward measured faster in Gluon from 16K, the full one from 32K
    assert auto.choose("forward", CAUSAL, S, S, H200, 128, takes=yes) == "triton"
    assert auto.choose("forward", FULL, S, S, H200, 128, takes=yes) == "triton"
    assert auto.choose("forward", FULL, 16384, 16384, H200, 128, takes=yes) == "cudnn"
    assert auto.choose("forward", FULL, 32768, 32768, H200, 128, takes=yes) == "triton"
    # at d=64 H200's full forward runs Gluon past 64K rows, its causal one cuDNN
    assert auto.choose("forward", FULL, S, S, H200, 64, takes=yes) == "triton"
    assert auto.choose("forward", FULL, 65536, 65536, H200, 64, takes=yes) == "cudnn"
    assert auto.choose("forward", CAUSAL, S, S, H200, 64, takes=yes) == "cudnn"
    assert auto.choose("forward", CAUSAL, S, S, A100, 128, takes=yes) == "cudnn"
    # up to 8K rows cuDNN; a head dim no record measured keeps every card's rule; Gluon declining
    # the block (lengths not multiples of 128) falls through to cuDNN
    assert auto.choose("forward", CAUSAL, 8192, 8192, H100, 128, takes=yes) == "cudnn"
    assert auto.choose("forward", CAUSAL, S, S, H100, 64, takes=yes) == "cudnn"
    assert auto.choose("forward", CAUSAL, S + 64, S + 64, H100, 128, takes=lambda: False) == "cudnn"
    # gluon=False (BURST_GLUON=0): no Gluon rule is taken, and Gluon is not even asked
    asked = []
    for card in (H100, H200):
        for call in ("forward", "forward_into", "backward", "backward_into"):
            for mask in (FULL, CAUSAL, STRICT):
                got = off.choose(call, mask, S, S, card, 128, takes=lambda: asked.append(1) or True)
                assert got == "cudnn", (card, call, mask)
    assert not asked


def test_h200_plain_backward_and_the_ring_steps():
    """On H200 the plain backward runs cuDNN where the records say it is faster (d=128: short
    blocks); the ring step's backward_into, where cuDNN needs separate gradient adds, runs Gluon
    (full d=128 blocks past 64K too, since the Gluon backward cuts them into chunks).  At d=64 (measured on H200 only)
    H200 runs Gluon on causal blocks, both calls, cuDNN on the others; H100 and other cards keep
    Gluon at d=128 and cuDNN at d=64."""
    auto, yes = AutoKernel(), (lambda: True)
    for S, mask, d, want in ((8192, CAUSAL, 128, "cudnn"), (16384, CAUSAL, 128, "cudnn"), (32768, CAUSAL, 128, "triton"),
                             (8192, FULL, 128, "cudnn"), (16384, FULL, 128, "triton"), (65536, FULL, 128, "triton"),
                             (131072, FULL, 128, "triton"), (8192, STRICT, 128, "triton")):
        assert auto.choose("backward", mask, S, S, H200, d, takes=yes) == want, (S, mask, d)
        assert auto.choose("backward_into", mask, S, S, H200, d, takes=yes) == "triton", (S, mask, d)
        assert auto.choose("backward", mask, S, S, H100, d, takes=yes) == "triton", (S, mask, d)
    for call in ("backward", "backward_into"):
        assert auto.choose(call, CAUSAL, 8192, 8192, H200, 64, takes=yes) == "cudnn", call
    for S in (16384, 131072):
        for call in ("backward", "backward_into"):
            assert auto.choose(call, CAUSAL, S, S, H200, 64, takes=yes) == "triton", (call, S)
            for mask in (FULL, STRICT):
                assert auto.choose(call, mask, S, S, H200, 64, takes=yes) == "cudnn", (call, mask, S)
            for mask in (FULL, CAUSAL, STRICT):
                assert auto.choose(call, mask, S, S, H100, 64, takes=yes) == "cudnn", (call, mask, S)
    # where Gluon does not take the block, cuDNN
    assert auto.choose("backward", FULL, 32768, 32768, H200, 128, takes=lambda: False) == "cudnn"


def test_head_dim_256():
    """d=256: on H200 the plain causal forward and the ring step's forward_into of full and causal
    blocks run Gluon, the plain full forward cuDNN; the backward (bwd_wide.py) Gluon on full blocks,
    plain and backward_into, cuDNN on causal ones; other cards and strict blocks keep cuDNN
    (unmeasured), and where Gluon does not take the block, cuDNN."""
    auto, yes, no = AutoKernel(), (lambda: True), (lambda: False)
    for S in (8192, 131072):
        assert auto.choose("forward", CAUSAL, S, S, H200, 256, takes=yes) == "triton"
        assert auto.choose("forward", FULL, S, S, H200, 256, takes=yes) == "cudnn"
        for mask in (FULL, CAUSAL):
            assert auto.choose("forward_into", mask, S, S, H200, 256, takes=yes) == "triton", (mask, S)
            for card in (H100, A100):
                assert auto.choose("forward_into", mask, S, S, card, 256, takes=yes) == "cudnn", (card, mask, S)
                assert auto.choose("forward", mask, S, S, card, 256, takes=yes) == "cudnn", (card, mask, S)
        assert auto.choose("forward_into", STRICT, S, S, H200, 256, takes=yes) == "cudnn"
        for call in ("backward", "backward_into"):
            assert auto.choose(call, FULL, S, S, H200, 256, takes=yes) == "triton", call
            assert auto.choose(call, FULL, S, S, H200, 256, takes=no) == "cudnn", call
            for mask in (CAUSAL, STRICT):
                assert auto.choose(call, mask, S, S, H200, 256, takes=yes) == "cudnn", (call, mask)
            for card in (H100, A100):
                assert auto.choose(call, FULL, S, S, card, 256, takes=yes) == "cudnn", (call, card)


def test_head_dim_96():
    """d=96 (the Gluon forward in column pieces; cuDNN's backward): on H200 the plain causal forward
    runs Gluon past 8K rows, the full one past 16K, the ring step's forward_into of full and causal
    blocks everywhere; other cards cuDNN."""
    auto, yes = AutoKernel(), (lambda: True)
    assert auto.choose("forward", CAUSAL, 8192, 8192, H200, 96, takes=yes) == "cudnn"
    assert auto.choose("forward", CAUSAL, 16384, 16384, H200, 96, takes=yes) == "triton"
    assert auto.choose("forward", FULL, 16384, 16384, H200, 96, takes=yes) == "cudnn"
    assert auto.choose("forward", FULL, 65536, 65536, H200, 96, takes=yes) == "triton"
    for S in (8192, 131072):
        for mask in (FULL, CAUSAL):
            assert auto.choose("forward_into", mask, S, S, H200, 96, takes=yes) == "triton", (mask, S)
            for card in (H100, A100):
                assert auto.choose("forward_into", mask, S, S, card, 96, takes=yes) == "cudnn", (card, mask)
                assert auto.choose("forward", mask, S, S, card, 96, takes=yes) == "cudnn", (card, mask)
        assert auto.choose("forward_into", STRICT, S, S, H200, 96, takes=yes) == "cudnn"
        for call in ("backward", "backward_into"):
            assert auto.choose(call, FULL, S, S, H200, 96, takes=lambda: False) == "cudnn", call


class _Spy:
    def __init__(self, name, seen):
        self.name, self.seen = name, seen

    def available(self, device):
        return True

    def __getattr__(self, call):
        if call not in ("forward", "forward_into", "backward", "backward_into"):
            raise AttributeError(call)
        return lambda *a, **kw: self.seen.append((self.name, call))


@pytest.fixture
def dispatch(monkeypatch):
    """``run(auto, call, mask, S, d)``: which kernel AutoKernel's call ran, with the device named
    ``card`` (its reads counted in ``reads``), Gluon taking full/causal blocks of lengths that are
    multiples of 128 (strict ones too on a ring step; its ``gluon`` arguments in ``asked``), and
    spies for cuDNN and Triton with and without Gluon."""
    d = SimpleNamespace(card="", seen=[], reads=[], asked=[])

    def name(device):
        d.reads.append(device)
        return d.card

    def takes(q, k, v, mask, *state, gluon=True):
        d.asked.append(gluon)
        return gluon and mask in (FULL, CAUSAL, STRICT) and (mask != STRICT or bool(state)) and q.shape[1] % 128 == 0

    def bwd_takes(q, k, v, mask, dout, *grads, gluon=True):
        d.asked.append(gluon)
        return gluon and mask in (FULL, CAUSAL, STRICT) and q.shape[1] % 128 == 0

    monkeypatch.setattr(choices, "device_name", name)
    monkeypatch.setattr(registry, "gluon_takes", takes)
    monkeypatch.setattr(registry, "gluon_bwd_takes", bwd_takes)
    for n in ("cudnn", "triton"):
        monkeypatch.setitem(KERNELS, n, _Spy(n, d.seen))
    monkeypatch.setitem(registry._NO_GLUON, "triton", _Spy("triton-no-gluon", d.seen))

    def run(auto, call, mask, S, hd=128):
        q = torch.empty(1, S, 2, hd, device="meta")
        out, lse = torch.empty(1, S, 2, hd, device="meta"), torch.empty(1, 2, S, device="meta")
        d.seen.clear()
        if call == "forward":
            auto.forward(q, q, q, 1.0, mask)
        elif call == "forward_into":
            auto.forward_into(q, q, q, 1.0, mask, out, lse)
        elif call == "backward":
            auto.backward(q, q, q, q, lse, lse, 1.0, mask)
        else:
            auto.backward_into(q, q, q, q, lse, lse, 1.0, mask, q, q, q)
        (ran,) = d.seen
        return ran[0]

    d.run = run
    return d


def test_dispatch_per_card(dispatch):
    S = 131072
    dispatch.card = H100
    auto = AutoKernel()
    assert dispatch.run(auto, "forward", CAUSAL, S) == "triton"  # TritonKernel: the Gluon forward
    assert dispatch.run(auto, "forward", FULL, S) == "triton"
    assert dispatch.run(auto, "forward", CAUSAL, 8192) == "cudnn"
    assert dispatch.run(auto, "forward", CAUSAL, S, hd=64) == "cudnn"
    assert dispatch.run(auto, "forward", CAUSAL, S + 64) == "cudnn"  # Gluon does not take it
    assert len(dispatch.reads) == 1  # the name is read once per device

    dispatch.card = H200
    auto = AutoKernel()
    assert dispatch.run(auto, "forward", CAUSAL, S) == "triton"
    assert dispatch.run(auto, "forward", FULL, S) == "triton"
    assert dispatch.run(auto, "forward", FULL, 16384) == "cudnn"
    # the plain backward and the ring step's part ways at 8K
    assert dispatch.run(auto, "backward", CAUSAL, 8192) == "cudnn"
    assert dispatch.run(auto, "backward_into", CAUSAL, 8192) == "triton"
    assert dispatch.run(auto, "backward", CAUSAL, 32768) == "triton"

    dispatch.card = A100
    auto = AutoKernel()
    for mask in (FULL, CAUSAL):
        assert dispatch.run(auto, "forward", mask, S) == "cudnn"
    assert dispatch.run(auto, "forward", STRICT, 8192) == "triton"


def test_dispatch_as_before_but_the_plain_calls(dispatch):
    """Every card runs what every card ran before, but for the plain forward of the cards the
    rules name and H200's plain backward; gluon=False runs no Gluon anywhere (Gluon is asked with gluon=False at most, and
    Triton runs its kernels without Gluon)."""
    for card in (A100, H100, H200):
        dispatch.card = card
        for gluon in (True, False):
            auto = AutoKernel(gluon=gluon)
            dispatch.asked.clear()
            for call in ("forward", "forward_into", "backward", "backward_into"):
                if gluon and (call == "forward" and card != A100 or call.startswith("backward") and card == H200):
                    continue  # test_dispatch_per_card, test_h200_plain_backward_and_the_ring_steps
                for mask in (FULL, CAUSAL, STRICT):
                    for S in (8192, 8256, 131072):
                        want = _before(call, mask, S, gluon and S % 128 == 0)
                        want = want if gluon else {"triton": "triton-no-gluon"}.get(want, want)
                        assert dispatch.run(auto, call, mask, S) == want, (card, gluon, call, mask, S)
            assert gluon or not any(dispatch.asked)


@pytest.mark.parametrize("sq,sk,hkv", [(64, 64, 2), (48, 96, 4), (33, 17, 1)])
def test_forward_into_runs_names_the_kernel_forward_into_calls(monkeypatch, sq, sk, hkv):
    """What a record says ran (bench prefill --efficiency's probe) is the kernel AutoKernel's
    forward_into hands the call to."""
    from burstengine.masks import CAUSAL

    called = []
    for name, kern in KERNELS.items():
        monkeypatch.setattr(kern, "forward_into", lambda *a, _n=name: called.append(_n))
    q, k, v = torch.randn(1, sq, 4, 32), torch.randn(1, sk, hkv, 32), torch.randn(1, sk, hkv, 32)
    out, lse = torch.zeros(1, sq, 4, 32), torch.full((1, 4, sq), float("-inf"))
    auto = AutoKernel()
    auto.forward_into(q, k, v, 0.2, CAUSAL, out, lse)
    assert called == [auto.forward_into_runs(q, k, v, CAUSAL, out, lse)]
