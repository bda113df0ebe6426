"""A small BurstAttention loop for the fault tests, started as plain processes (env://, like
torchrun without the agent) by tests/test_fault.py.

    python tests/fault_job.py kill|stall|groups

kill:   rank VICTIM SIGKILLs itself in the middle of a ring step (forward, after the shift of
        the next K/V was posted); no watchdog: the ring's own errors and the store notice
        must bring every other rank down, naming it.
stall:  rank VICTIM freezes itself (SIGSTOP) mid-step; every rank runs a Watchdog and the ring
        has no deadline of its own: the watchdogs must notice the silence and end the job.
groups: ranks disagree on the group (rank VICTIM passes a 2-rank subgroup): the argument
        check's all-gathers never complete; BURST_TIMEOUT must turn that into an error.
diverge: rank VICTIM, alive, skips one backward and goes on to the next call (its heartbeat goes
        on); every wait is made non-blocking, as on NCCL (no deadline of the ring's or the
        check's; gloo's own timeout is long): the watchdogs must bound the queued waits.
"""
import dataclasses
import os
import signal
import sys
import time

import torch

import burstengine as be
from burstengine.comm import fault
from burstengine.kernels import KERNELS
from burstengine.kernels.reference import ReferenceKernel

MODE = sys.argv[1]
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
VICTIM = int(os.environ.get("VICTIM", "2"))
torch.set_num_threads(1)


class Saboteur(ReferenceKernel):
    """The reference kernel, except that the victim dies or freezes in its 5th block."""

    name = "saboteur"
    calls = 0

    def forward_into(self, *args, **kwargs):
        Saboteur.calls += 1
        if RANK == VICTIM and Saboteur.calls == 5 and MODE in ("kill", "stall"):
            print(f"FAULT_AT {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL if MODE == "kill" else signal.SIGSTOP)
        return super().forward_into(*args, **kwargs)


def steps(group=None, n=200):
    g = torch.Generator().manual_seed(RANK)
    q = torch.randn(1, 32, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(1, 32, 2, 16, generator=g, requires_grad=True)
    v = torch.randn(1, 32, 2, 16, generator=g, requires_grad=True)
    for i in range(n):
        out = be.burst_attn_func(q, k, v, group=group, causal=True, layout="zigzag", kernel="saboteur")
        if MODE == "diverge" and RANK == VICTIM and i == 2:
            print(f"FAULT_AT {time.time():.3f}", flush=True)
            continue
        out.sum().backward()


def main():
    KERNELS["saboteur"] = Saboteur()
    # the group's own timeout is long: the deadlines under test (BURST_TIMEOUT, the watchdog's)
    # are shorter, so they are what ends the job
    fault.init_process_group("gloo", timeout_s=120)
    if MODE == "diverge":
        wait = fault.wait  # as on NCCL: the host queues the wait and goes on; no deadline applies

        fault.wait = lambda works, op: wait(works, dataclasses.replace(op, blocking=False))
    if MODE in ("stall", "diverge"):
        with fault.Watchdog(timeout=float(os.environ.get("WATCHDOG_TIMEOUT", "5"))):
            steps()
    elif MODE == "groups":
        import torch.distributed as dist

        pair = dist.new_group([VICTIM - 1, VICTIM])
        steps(group=pair if RANK == VICTIM else None, n=3)
    else:
        steps()
    print("FINISHED", flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        print(f"RAISED_AT {time.time():.3f}", flush=True)
        raise
