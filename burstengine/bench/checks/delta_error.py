"""What rebuilding ``out`` from D costs in accuracy (issue 3, item 6).

The burst backward moves D = rowsum(dO * O) instead of O, but the SDPA flash / cuDNN backward
ops take ``out`` and compute D themselves.  kernels/sdpa.py passes out' = dO * D / |dO|^2 (so
rowsum(dO * out') = D up to one rounding of out' to bf16).  This script compares, against a
float64 reference, the gradients a bf16 kernel gives with the true ``out`` and with out', on
random inputs, for full and causal blocks, head dims 64 and 128, GQA 1 and 4.

    burstengine bench delta-error            # one GPU
    burstengine bench delta-error --device cpu --kernel reference --seq 256   # harness smoke run
"""
import itertools

import torch

from ...kernels import KERNELS
from ...kernels.reference import ReferenceKernel
from ...kernels.sdpa import out_from_delta
from ...masks import CAUSAL, FULL
from ...testing import fro_err
from ..records import OUT_DIR_HELP, write_record
from ..tables import Section, num, table
from ..usage import command_parser


def main(argv=None):
    ap = command_parser("burstengine bench delta-error", __doc__)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kernels", default="cudnn,flash")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    low = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ref = ReferenceKernel()
    rows = []
    for (causal, D, g), name in itertools.product(itertools.product((False, True), (64, 128), (1, 4)),
                                                  args.kernels.split(",")):
        kern = KERNELS[name]
        gen = torch.Generator(device=dev).manual_seed(1000 * D + 10 * g + causal)
        H, S = args.heads, args.seq
        q, do = (torch.randn(1, S, H, D, device=dev, dtype=torch.float64, generator=gen) for _ in range(2))
        k, v = (torch.randn(1, S, H // g, D, device=dev, dtype=torch.float64, generator=gen) for _ in range(2))
        mask, scale = (CAUSAL if causal else FULL), D ** -0.5
        out64, lse64 = ref.forward(q, k, v, scale, mask)
        delta64 = (do * out64).sum(-1).transpose(1, 2)
        want = ref.backward(do, q, k, v, lse64, delta64, scale, mask)
        ql, kl, vl, dol = (t.to(low) for t in (q, k, v, do))
        out, lse = kern.forward(ql, kl, vl, scale, mask)
        delta = (dol.float() * out.float()).sum(-1).transpose(1, 2)
        rebuilt = out_from_delta(dol, delta)
        d_err = fro_err((dol.float() * rebuilt.float()).sum(-1).transpose(1, 2), delta)
        with_out = kern.backward(dol, ql, kl, vl, lse, delta, scale, mask, out=out)
        with_delta = kern.backward(dol, ql, kl, vl, lse, delta, scale, mask)  # out rebuilt from delta
        row = dict(kernel=name, causal=causal, D=D, gqa=g, S=S, H=H, delta_rebuild_err=d_err)
        for tag, got in (("true_out", with_out), ("rebuilt_out", with_delta)):
            row[tag] = {n: fro_err(a, b) for n, a, b in zip(("dq", "dk", "dv"), got, want)}
        rows.append(row)
        print(f"{name:6s} {'causal' if causal else 'full':6s} D={D:3d} gqa={g}  rowsum err of out' {d_err:.1e}  "
              + "  ".join(f"{n}: {row['true_out'][n]:.2e} -> {row['rebuilt_out'][n]:.2e}" for n in ("dq", "dk", "dv")),
              flush=True)
    worst = {t: max(max(r[t].values()) for r in rows) for t in ("true_out", "rebuilt_out")}
    print(f"worst normwise gradient error vs fp64: with the true out {worst['true_out']:.2e}, "
          f"with out rebuilt from D {worst['rebuilt_out']:.2e}")
    print("wrote", write_record("delta_error", dict(rows=rows, worst=worst), args.out_dir))


# --- docs/results.md ----------------------------------------------------------------------------

def render(rec):
    body = [[r["kernel"], "causal" if r["causal"] else "full", r["D"], r["gqa"], r["S"], num(r["delta_rebuild_err"]),
             num(max(r["true_out"].values())), num(max(r["rebuilt_out"].values()))] for r in rec["rows"]]
    return table(["kernel", "mask", "D", "GQA", "S", "D rebuild error", "worst grad error (true O)",
                  "worst grad error (rebuilt O)"], body)


SECTIONS = (Section("Backward from a rebuilt D", r"^delta_error", render,
                    "`burstengine bench delta-error`: gradient error when D = rowsum(dO·O) comes from the merged O."),)
