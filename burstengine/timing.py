"""Timing one function the same way in every benchmark: seconds per call, the slowest rank's.

Below inference/ and bench/, which all time with it.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .comm.dist import world_of


def sync(device) -> None:
    """Wait for the device (CUDA) to finish what was queued; nothing on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, group=None, warmup: int = 1, iters: int = 1, on_iter=None, events: bool = True) -> list[float]:
    """Seconds of ``fn()`` per timed iteration, after ``warmup`` untimed calls.

    With a ``group`` of more than one rank every iteration starts after a barrier and each time
    is the slowest rank's (the slowest rank sets the pace of a step).  On CUDA the clock is a pair
    of CUDA events around the call (``events=False``: the host clock until the device is done,
    launch overheads included); on CPU the host clock.  ``on_iter(i, seconds)`` is called on
    every rank after each timed iteration (progress display)."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    sync(device)
    grouped = world_of(group) > 1
    times = []
    for i in range(iters):
        sync(device)
        if grouped:
            dist.barrier(group=group)
        if device.type == "cuda" and events:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            sync(device)
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - t0)
        if on_iter:
            on_iter(i, times[-1])
    return reduce_max(times, device, group)


def reduce_max(values, device, group=None) -> list[float]:
    """Each value's maximum over the ranks of ``group`` (the values themselves on one rank)."""
    if world_of(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def median(xs) -> float:
    """The median (the mean of the middle two for an even count); NaN for no values."""
    return statistics.median(xs) if len(xs) else float("nan")
