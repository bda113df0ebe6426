"""The correctness matrix on GPUs: bf16 BurstAttention over NCCL against a float64 reference.

    torchrun --nproc_per_node 4 -m burstengine bench gpu-correctness --seq-local 8192

For worlds 2 and 4 (sub-groups of the launch), causal/full x 3 layouts x 2 backward schemes
x SDPA flash/cuDNN x GQA 1/2/4 x head dim 64/128 x batch 1/2: forward output, lse and the
three gradients of every rank's shard vs the float64 reference on the full sequence, as
||x - ref|| / ||ref|| (the pass criterion) and max|x - ref| / max|ref|.  Beside each, the same
errors of the single-GPU kernel on the whole sequence in bf16 ("kernel_only"), so the record
shows what the ring adds to the kernel's own rounding.  Writes
gpu_correctness_<world>gpu.json in $BURST_RESULTS or ./burst-results.
"""
import itertools
import os
import time

import torch
import torch.distributed as dist

from ..tables import Section, num, table
import burstengine as be
from ...kernels import get_kernel
from ...kernels.reference import ReferenceKernel
from ...masks import CAUSAL, FULL
from ...testing import fro_err, rel_err
from ..records import write_record
from ..usage import command_parser

NAMES = ("out", "lse", "dq", "dk", "dv")


def reference(q, k, v, do, causal):
    """float64 out, lse and gradients on the full sequence (chunked, so it fits)."""
    ref = ReferenceKernel()
    mask = CAUSAL if causal else FULL
    scale = q.shape[-1] ** -0.5
    out, lse = ref.forward(q, k, v, scale, mask)
    delta = (do * out).sum(-1).transpose(1, 2)
    dq, dk, dv = ref.backward(do, q, k, v, lse, delta, scale, mask)
    return out, lse, dq, dk, dv


def kernel_only(kern, q, k, v, do, causal, refs):
    """Errors of one bf16 kernel call on the whole sequence (no ring): the floor for the ring."""
    mask = CAUSAL if causal else FULL
    scale = q.shape[-1] ** -0.5
    qb, kb, vb, dob = (t.to(torch.bfloat16) for t in (q, k, v, do))
    out, lse = kern.forward(qb, kb, vb, scale, mask)
    delta = (dob.float() * out.float()).sum(-1).transpose(1, 2)
    dq, dk, dv = kern.backward(dob, qb, kb, vb, lse, delta, scale, mask, out=out)
    return dict(zip(NAMES, (fro_err(a, b) for a, b in zip((out, lse, dq, dk, dv), refs))))


def main(argv=None):
    ap = command_parser("burstengine bench gpu-correctness", __doc__)
    ap.add_argument("--seq-local", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tol", type=float, default=1e-2)
    ap.add_argument("--kernels", default="flash,cudnn", help="local kernels for the ring, e.g. auto,triton "
                    "(on Hopper the ring step of auto/triton runs kernels/gluon/fwd.py)")
    ap.add_argument("--name", default=None, help="record name (default gpu_correctness_<world>gpu)")
    args = ap.parse_args(argv)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda")
    worlds = [w for w in (2, 4, 8) if w <= world]
    groups = {w: (None if w == world else dist.new_group(list(range(w)))) for w in worlds}
    rows, t0 = [], time.time()
    kern_names = tuple(args.kernels.split(","))
    H, n = args.heads, args.seq_local
    for w in worlds:
        g, active = groups[w], rank < w
        S = n * w
        for causal, hkv, D, B in itertools.product((False, True), (H, H // 2, H // 4), (64, 128), (1, 2)):
            gen = torch.Generator(device=dev).manual_seed(hash((w, causal, hkv, D, B)) % (1 << 31))
            q = torch.randn(B, S, H, D, generator=gen, device=dev, dtype=torch.float64)
            k = torch.randn(B, S, hkv, D, generator=gen, device=dev, dtype=torch.float64)
            v = torch.randn(B, S, hkv, D, generator=gen, device=dev, dtype=torch.float64)
            do = torch.randn(B, S, H, D, generator=gen, device=dev, dtype=torch.float64)
            if not active:
                continue
            r_out, r_lse, r_dq, r_dk, r_dv = reference(q, k, v, do, causal)
            base = {name: kernel_only(get_kernel(name, dev), q, k, v, do, causal, (r_out, r_lse, r_dq, r_dk, r_dv))
                    for name in kern_names}
            for layout, backward, kernel in itertools.product(be.LAYOUTS, ("burst", "ring"), kern_names):
                def loc(t, dim=1):
                    return be.shard(t, layout, rank, w, dim=dim)
                ql, kl, vl = (loc(t).to(torch.bfloat16).requires_grad_() for t in (q, k, v))
                out, lse = be.burst_attn_func(ql, kl, vl, group=g, causal=causal, layout=layout, backward=backward,
                                              kernel=kernel, return_lse=True)
                out.backward(loc(do).to(torch.bfloat16))
                got = (out, lse, ql.grad, kl.grad, vl.grad)
                want = (loc(r_out), loc(r_lse, 2), loc(r_dq), loc(r_dk), loc(r_dv))
                # squared-norm sums reduce exactly across ranks; max errors reduce by max
                sq = torch.tensor([[(a.double() - b).norm().item() ** 2, b.norm().item() ** 2] for a, b in zip(got, want)],
                                  device=dev, dtype=torch.float64)
                mx = torch.tensor([rel_err(a, b) for a, b in zip(got, want)], device=dev, dtype=torch.float64)
                dist.all_reduce(sq, group=g)
                dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=g)
                fro = (sq[:, 0] / sq[:, 1]).sqrt().tolist()
                row = dict(world=w, causal=causal, layout=layout, backward=backward, kernel=kernel, B=B, H=H, hkv=hkv,
                           D=D, seq_local=n, **dict(zip(NAMES, fro)), max_err=dict(zip(NAMES, mx.tolist())),
                           kernel_only=base[kernel])
                row["ok"] = all(row[x] <= args.tol for x in NAMES)
                rows.append(row)
                if rank == 0 and not row["ok"]:
                    print("FAIL", row, flush=True)
            if rank == 0:
                print(f"[{time.time() - t0:6.1f}s] world {w} causal={causal} hkv={hkv} D={D} B={B}: "
                      f"worst {max(max(r[x] for x in NAMES) for r in rows[-12:]):.2e} "
                      f"(kernel alone: {max(max(b.values()) for b in base.values()):.2e})",
                      flush=True)
            del q, k, v, do, r_out, r_lse, r_dq, r_dk, r_dv
            torch.cuda.empty_cache()
    if rank == 0:
        worst = {x: max(r[x] for r in rows) for x in NAMES}
        n_ok = sum(r["ok"] for r in rows)
        path = write_record(args.name or f"gpu_correctness_{world}gpu",
                            dict(tolerance=args.tol, cases=len(rows), passed=n_ok, worst=worst, rows=rows))
        print(f"{n_ok}/{len(rows)} cases within {args.tol}; worst rel err {worst}; wrote {path}")
    dist.barrier()
    dist.destroy_process_group()


# --- docs/results.md ----------------------------------------------------------------------------

def render(rec):
    groups: dict = {}
    for r in rec["rows"]:
        groups.setdefault((r["kernel"], r["backward"]), []).append(r)
    body = [[k, b, len(rs), sum(bool(r["ok"]) for r in rs)] + [num(max(r[q] for r in rs)) for q in
                                                                ("out", "lse", "dq", "dk", "dv")]
            for (k, b), rs in sorted(groups.items())]
    head = [f"{rec['passed']}/{rec['cases']} cases within {num(rec['tolerance'])} (normwise relative error against "
            "float64, bf16 over NCCL).", ""]
    return head + table(["kernel", "backward", "cases", "passed", "worst out", "lse", "dQ", "dK", "dV"], body)


SECTIONS = (Section("Correctness on GPUs", r"^gpu_correctness", render,
                    "`burstengine bench gpu-correctness`: the bf16 correctness matrix over NCCL against float64."),)
