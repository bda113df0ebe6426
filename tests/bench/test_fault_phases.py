"""A rank lost at each phase of a job (`burstengine bench faults`, real processes started like
torchrun starts them, gloo): every survivor exits non-zero within the deadline + slack, none
hangs or finishes, and (but at the first call, see docs/faults.md) each names the lost rank.
Each job is bounded by a hard limit: a regression fails instead of hanging CI.  The same jobs
run on GPUs: `python -m burstengine bench faults --device cuda`."""
import pytest

from burstengine.bench.faults import phases as faults

DEADLINE = 5.0
LIMIT = 90.0  # hard limit per job: survivors still running then count as hung


@pytest.mark.parametrize("fault", ["subgroups", "skip_backward", "store_host", "checkpoint_save", "first_call",
                                   "agree_gather", "checks_local"])
def test_lost_rank_at_every_phase(fault, tmp_path):
    res = faults.run_fault(fault, world=4, deadline=DEADLINE, limit=LIMIT, tmp=str(tmp_path))
    problems = faults.judge(res)
    if fault == "first_call":
        # a rank killed before the first collective: gloo's error names an address and every
        # survivor's census sees two silent ranks, so the message need not name it; the rest holds
        problems = [p for p in problems if "did not name" not in p]
        assert all("RankLost" in s["error"] for s in res["survivors"].values()), res
    assert not problems, (problems, res)


@pytest.mark.parametrize("fault", ["before_group", "generate_step", "generate_freeze", "prefill_freeze", "eval_freeze"])
def test_every_command_ends_a_lost_rank(fault, tmp_path):
    """The commands themselves (`python -m burstengine` on 2 ranks launched as torchrun launches
    them): a rank killed before the group forms, killed in a ring step of generate, or frozen
    (SIGSTOP) in generate, prefill or eval: the survivor exits non-zero within the deadline +
    slack, naming it in one line (no gloo traceback, no hour of silence)."""
    res = faults.run_fault(fault, world=2, deadline=DEADLINE, limit=LIMIT, tmp=str(tmp_path))
    assert not faults.judge(res), (faults.judge(res), res)
    for r, s in res["survivors"].items():
        assert s["rc"] == 75 and not s["traceback"], (r, s)
