"""kernels/gluon/bwd_wide.py's mbarrier protocol, written out as coroutines (keep in step with the
kernel: the loader, two compute warpgroups, both ways of sharing S and dP) and run under random
schedules: no schedule deadlocks, and no buffer (a Q/dO stage, P, dS) is written while a reader
of its last contents has not finished.  A GPU hang costs a whole device call; this finds one on CPU
(a first SDP build hung: its "ready" barriers waited for two arrivals where one warpgroup writes)."""
import random

import pytest


class Bar:
    """An mbarrier: ``count`` arrivals complete a phase; wait(parity) returns once the phase of that
    parity has completed (a fresh barrier's parity-1 phase counts as completed)."""

    def __init__(self, count):
        self.count, self.pending, self.bit = count, count, 0
        self.skip = False  # a test's broken protocol: waits on it return at once

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.bit ^= 1
            self.pending = self.count

    def done(self, parity):
        return self.bit != parity


def wait(bar, parity):
    while not (bar.skip or bar.done(parity)):
        yield False  # blocked


class Buffer:
    """A shared buffer: written for a step, then read ``readers`` times; a write before every read
    of the last contents is a hazard."""

    def __init__(self, name):
        self.name, self.step, self.left = name, None, 0

    def write(self, step, readers):
        if self.step == step:
            return  # the other warpgroup's half of the same tile
        assert self.left == 0, f"{self.name} written for step {step} while step {self.step} still has readers"
        self.step, self.left = step, readers

    def read(self, step):
        assert self.step == step and self.left > 0, f"{self.name}: step {step} read, holds {self.step}"
        self.left -= 1


STAGES = 2


def loader(n, q_ready, q_empty, stages):
    for j in range(n):
        st = j % STAGES
        yield from wait(q_empty[st], ((j // STAGES) & 1) ^ 1)
        stages[st].write(j, 2)  # Q and dO of step j: each warpgroup's dK reads Q, its dV dO
        q_ready[st].arrive()  # the TMA's bytes land
        yield True


def warpgroup(w, n, sdp, q_ready, q_empty, x, stages, p_buf, ds_buf):
    p_ready, p_free, ds_ready, ds_free = x
    for j in range(n):
        st, ph = j % STAGES, j & 1
        yield from wait(q_ready[st], (j // STAGES) & 1)
        if not sdp or w == 0:  # S, P (SDP: warpgroup 0's whole tile; else a half each)
            yield from wait(p_free, ph ^ 1)
            p_buf.write(j, 3 if sdp else 2)  # read by both warpgroups' dV (SDP: and warpgroup 1's dS)
            p_ready.arrive()
            yield True
        if not sdp or w == 1:  # dP, dS
            if sdp:
                yield from wait(p_ready, ph)
                p_buf.read(j)  # warpgroup 1 loads P to make dS
            yield from wait(ds_free, ph ^ 1)
            ds_buf.write(j, 2)  # read by both warpgroups' dK and dQ pieces
            ds_ready.arrive()
            yield True
        yield from wait(p_ready, ph)
        yield from wait(ds_ready, ph)
        yield True  # dV, dK and the first dQ piece run, then are waited for
        p_buf.read(j)
        p_free.arrive()
        stages[st].read(j)
        q_empty[st].arrive()
        yield True  # the other dQ pieces
        ds_buf.read(j)
        ds_free.arrive()
        yield True


def run(n, sdp, seed, ready=None, skip=()):
    """One random schedule of ``n`` steps; ``ready``: the arrivals the "ready" barriers wait for
    (None: as bwd_wide_kernel inits them, one where SDP has one warpgroup write the tile); ``skip``:
    the indices of P ready, P free, dS ready, dS free whose waits are left out."""
    rng = random.Random(seed)
    q_ready, q_empty = [Bar(1) for _ in range(STAGES)], [Bar(2) for _ in range(STAGES)]
    ready = ready or (1 if sdp else 2)
    x = [Bar(ready if i % 2 == 0 else 2) for i in range(4)]
    for i in skip:
        x[i].skip = True
    stages = [Buffer(f"stage {i}") for i in range(STAGES)]
    p_buf, ds_buf = Buffer("P"), Buffer("dS")
    live = [loader(n, q_ready, q_empty, stages)] + [
        warpgroup(w, n, sdp, q_ready, q_empty, x, stages, p_buf, ds_buf) for w in (0, 1)]
    blocked = 0
    while live:
        p = rng.choice(live)
        try:
            blocked = 0 if next(p) else blocked + 1
        except StopIteration:
            live.remove(p)
            blocked = 0
        assert blocked < 1000, f"deadlock (sdp={sdp}, seed={seed})"


@pytest.mark.parametrize("sdp", [True, False])
def test_bwd_wide_barriers_never_deadlock_or_overwrite(sdp):
    for seed in range(300):
        run(7, sdp, seed)


def test_the_model_finds_the_hang_it_was_written_for():
    """The first SDP build: its "ready" barriers initialised for two arrivals."""
    with pytest.raises(AssertionError, match="deadlock"):
        run(7, True, 0, ready=2)


@pytest.mark.parametrize("sdp, free", [(True, 1), (False, 1), (False, 3)])
def test_the_model_finds_a_missing_free_wait(sdp, free):
    """Without the wait on "P free" (or "dS free"), a warpgroup overwrites the tile while the other
    still reads it, in some schedule.  (SDP's "dS free" wait is implied: warpgroup 1 writes the next
    dS only after warpgroup 0's next P, which comes after its last dQ piece; the kernel keeps it.)"""
    found = 0
    for seed in range(300):
        try:
            run(7, sdp, seed, skip=(free, ))
        except AssertionError as e:
            assert "still has readers" in str(e), e
            found += 1
    assert found
