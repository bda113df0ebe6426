"""`burstengine bench faults`: a rank lost at every phase of a job, and how each survivor ends.

Each fault runs as a small job of real processes started the way torchrun starts them (env://
rendezvous on this host, the runner hosting the c10d store as torchrun's agent does; store_host
alone uses plain env:// rendezvous, where rank 0 hosts it), one process per rank, on CPU/gloo (``--device cpu``) or one GPU per
rank over NCCL (``--device cuda``): the jobs are written device-agnostic, so the same command
runs on a GPU host.  The victim rank (VICTIM) does something to itself at one phase:

================  ===========================================================================
first_call        SIGKILL at the start of the first attention call (before the argument check)
agree_gather      SIGKILL inside the first argument-check all-gather (the double ring's, at 4+)
checks_local      runs BURST_CHECKS=local alone: it skips the argument check the others wait in
subgroups         SIGKILL just before the double ring's sub-groups are made (topology "2x2")
ring_step         SIGKILL in the middle of a forward ring step
skip_call         skips the last attention call (stays alive, as if stuck elsewhere)
skip_backward     skips the backward of its second call and goes on to the third
freeze            SIGSTOP mid ring step (a frozen rank)
store_host        rank 0, hosting the c10d store, SIGKILLed mid ring step
checkpoint_save   SIGKILL while writing its part of a torch.distributed.checkpoint save
before_group      `burstengine train`: SIGKILL before the process group forms
train_step        `burstengine train`: SIGKILL mid training step (after its forward)
generate_step     `burstengine generate`: SIGKILL in a ring step of the prefill
generate_freeze   `burstengine generate`: SIGSTOP in a decode step
prefill_freeze    `burstengine prefill`: SIGSTOP in a ring step
eval_freeze       `burstengine eval needle`: SIGSTOP in a decode step
================  ===========================================================================

The last six run the commands themselves (``python -m burstengine`` in each rank, launched as
torchrun launches them), so what is tested is the commands' own fault handling.

Every survivor must exit non-zero within the deadline plus slack, its error naming the victim
("rank V lost"); none may hang or finish.  The record holds, per fault, each survivor's
seconds from the fault to its exit, its exit code and whether it named the victim.

    python -m burstengine bench faults --out-dir benchmarks/results          # CPU, gloo
    torchrun is not needed; on a GPU host: ... bench faults --device cuda --world 4

``python -m burstengine.bench.faults.phases job <fault>`` is one rank of a job (what the runner starts).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import time
from ..tables import Section, fixed, num, table
from ..usage import command_parser

FAULTS = ("first_call", "agree_gather", "checks_local", "subgroups", "ring_step", "skip_call", "skip_backward",
          "freeze", "store_host", "checkpoint_save", "before_group", "train_step", "generate_step", "generate_freeze",
          "prefill_freeze", "eval_freeze")
COMMANDS = ("before_group", "train_step", "generate_step", "generate_freeze", "prefill_freeze", "eval_freeze")
NEEDS_4 = ("subgroups",)  # the double ring (topology 2x2)
SLACK = 10.0  # seconds past the deadline (and the census, and a watchdog's grace) a survivor may take


# --- one rank of a fault job -------------------------------------------------------------------

def _job(fault: str) -> int:
    """One rank's part of a fault job; its exit code."""
    # the ranks of a job only: the runner itself stays light (no torch.distributed state)
    import torch  # noqa: I001  (a rank's imports, see above)
    import torch.distributed as dist

    import burstengine as be  # a rank of the job: see above
    from burstengine.comm import fault as fl  # a rank of the job: see above
    from burstengine.comm import topology as topo  # a rank of the job: see above
    from burstengine.kernels import KERNELS  # a rank of the job: see above
    from burstengine.kernels.reference import ReferenceKernel  # a rank of the job: see above

    rank = int(os.environ["RANK"])
    victim = int(os.environ["VICTIM"])
    device = os.environ.get("FAULT_DEVICE", "cpu")
    deadline = float(os.environ["BURST_TIMEOUT"])
    torch.set_num_threads(1)
    me = rank == victim

    def die(sig=signal.SIGKILL):
        print(f"FAULT_AT {time.time():.3f}", flush=True)
        os.kill(os.getpid(), sig)

    _all_started(rank, int(os.environ["WORLD_SIZE"]))
    if fault in COMMANDS:
        return _command_job(fault, me, die)

    class Saboteur(ReferenceKernel):
        """The reference kernel, except that the victim dies or freezes in its 3rd block."""

        name = "saboteur"
        calls = 0

        def forward_into(self, *args, **kwargs):
            Saboteur.calls += 1
            if me and Saboteur.calls == 3 and fault in ("ring_step", "freeze", "store_host"):
                die(signal.SIGSTOP if fault == "freeze" else signal.SIGKILL)
            return super().forward_into(*args, **kwargs)

    KERNELS["saboteur"] = Saboteur()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # the group's own timeout: the deadline under test, so NCCL's watchdog also ends a wait
    fl.init_process_group("nccl" if device == "cuda" else "gloo", timeout_s=deadline)
    if fault == "subgroups" and me:
        made = topo.make_groups
        topo.make_groups = lambda *a, **k: (die(), made(*a, **k))[1]
    if fault == "agree_gather" and me:
        post = fl.post

        def post_then_die(start, op):  # the victim joins the argument check's all-gather, then dies in it
            works = post(start, op)
            if op.what.startswith("burst_attn_func's argument check"):
                die()
            return works

        fl.post = post_then_die
    if fault == "checks_local" and me:
        os.environ["BURST_CHECKS"] = "local"
        print(f"FAULT_AT {time.time():.3f}", flush=True)  # from its first call on, it is the odd one
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 16, h, 16, generator=g).to(device).requires_grad_() for h in (4, 2, 2))
    # the saboteur on every device: it is where the victim dies, and the reference kernel runs on GPUs
    double = fault == "subgroups" or (fault == "agree_gather" and int(os.environ["WORLD_SIZE"]) >= 4)
    kw = dict(causal=True, layout="zigzag", kernel="saboteur", topology="2x2" if double else "auto")
    if fault == "checkpoint_save":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        if me:
            write = FileSystemWriter.write_data
            FileSystemWriter.write_data = lambda *a, **k: (die(), write(*a, **k))[1]
        with fl.Watchdog(timeout=deadline) as dog:
            try:
                dcp.save({"w": torch.full((4,), float(rank))}, storage_writer=FileSystemWriter(os.environ["FAULT_DIR"]))
            except Exception as e:
                lost = dog.explain(e, "the checkpoint save")
                raise lost or e
        print("FINISHED", flush=True)
        return 0
    def calls():
        for call in range(3):
            if fault == "first_call" and me and call == 0:
                die()
            if fault == "skip_call" and me and call == 2:
                print(f"FAULT_AT {time.time():.3f}", flush=True)
                time.sleep(3 * deadline + 30)  # alive, elsewhere: the runner ends it
            out = be.burst_attn_func(q, k, v, **kw)
            if fault == "skip_backward" and me and call == 1:
                print(f"FAULT_AT {time.time():.3f}", flush=True)
                continue
            out.sum().backward()
        dist.barrier()

    if device == "cuda":
        # on NCCL the host does not wait for a ring transfer: what ends the survivors of a lost
        # peer is a watchdog, as every burstengine command runs one.  NCCL's own, at the group's
        # timeout, first dumps its debug state, and did not end 4 H200 ranks within 30 s of it
        # (benchmarks/results/faults_4gpu_nccl.json)
        with fl.Watchdog(timeout=deadline) as dog:
            try:
                calls()
            except Exception as e:
                lost = dog.explain(e, "the attention calls")
                raise lost or e
    else:
        calls()  # gloo's waits are the host's: the ring's own deadlines end them, naming the rank
    print("FINISHED", flush=True)
    return 0


def _all_started(rank: int, world: int, limit: float = 120.0) -> None:
    """Wait (a file each, in FAULT_START) until every rank of the job has started and imported
    torch.  The deadline under test also bounds forming the group (the check-in, gloo's
    connections), and a loaded machine can take longer than that to start the processes, which
    is no phase of the job: the fault's timings start at FAULT_AT, after this."""
    where = os.environ.get("FAULT_START")
    if not where:
        return
    open(os.path.join(where, str(rank)), "w").close()
    end = time.time() + limit
    while len(os.listdir(where)) < world and time.time() < end:
        time.sleep(0.05)


def _command_job(fault: str, me: bool, die) -> int:
    """One rank of a command run as torchrun runs it (``-m burstengine``), the victim
    sabotaged at the fault's phase; the command's exit code."""
    import torch  # noqa: I001  (a rank's imports)

    from burstengine.kernels import KERNELS  # a rank of the job: see _job
    from burstengine.kernels.reference import ReferenceKernel  # a rank of the job: see _job

    tmp = os.environ["FAULT_DIR"]
    os.makedirs(tmp, exist_ok=True)
    world = int(os.environ["WORLD_SIZE"])
    stop = signal.SIGSTOP if fault.endswith("_freeze") else signal.SIGKILL

    class Saboteur(ReferenceKernel):
        """The reference kernel; the victim dies or freezes in its 3rd block."""

        name = "saboteur"
        calls = 0

        def forward_into(self, *args, **kwargs):
            Saboteur.calls += 1
            if me and Saboteur.calls == 3 and fault in ("generate_step", "prefill_freeze"):
                die(stop)
            return super().forward_into(*args, **kwargs)

    KERNELS["saboteur"] = Saboteur()
    if me and fault in ("generate_freeze", "eval_freeze"):
        from burstengine.inference import step  # a rank of the job: see _job

        decode = step.DecodeStep.launch  # one decode step's work
        count = [0]

        def frozen_at_third(self):
            count[0] += 1
            if count[0] == 3:
                die(stop)
            return decode(self)

        step.DecodeStep.launch = frozen_at_third
    if me and fault == "before_group":
        die()
    if me and fault == "train_step":
        kill = os.kill  # the trainer kills itself (BURST_FAULT_KILL_IN_STEP): say when

        def said(pid, sig):
            if pid == os.getpid() and sig == signal.SIGKILL:
                print(f"FAULT_AT {time.time():.3f}", flush=True)
            kill(pid, sig)

        os.kill = said
    prompt = os.path.join(tmp, "prompt.npy")
    if not os.path.exists(prompt):
        import numpy as np

        np.save(f"{prompt}.{os.getpid()}.npy", np.arange(64) % 500)
        os.replace(f"{prompt}.{os.getpid()}.npy", prompt)
    kernel = ["--kernel", "saboteur"]
    argv = {
        "before_group": ["train", "--set", f"out_dir={tmp}/run", "--set", "steps=3", "--set", f"cp={world}"],
        "train_step": ["train", "--set", f"out_dir={tmp}/run", "--set", "steps=3", "--set", f"cp={world}"],
        "generate_step": ["generate", "--model", "tiny", "--prompt-tokens", prompt, "--max-new-tokens", "8",
                          "--quiet", *kernel],
        "generate_freeze": ["generate", "--model", "tiny", "--prompt-tokens", prompt, "--max-new-tokens", "8",
                            "--quiet"],
        "prefill_freeze": ["prefill", "--model", "tiny", "--seq", str(64 * world), *kernel],
        "eval_freeze": ["eval", "needle", "--model", "tiny", "--lengths", "64", "--depths", "0.5",
                        "--out", f"{tmp}/needle"],
    }[fault]
    if fault == "train_step":
        os.environ["BURST_FAULT_KILL_IN_STEP"] = f"{os.environ['VICTIM']}:2"
    torch.set_num_threads(1)
    # the command's entry point as `torchrun -m burstengine` runs it (the bench imports no command)
    sys.argv = ["burstengine", *argv]
    try:
        runpy.run_module("burstengine", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    if code == 0:
        print("FINISHED", flush=True)
    return code


def _job_main(fault: str) -> None:
    import traceback

    try:
        code = _job(fault)
    except BaseException:
        print(f"RAISED_AT {time.time():.3f}", flush=True)
        traceback.print_exc()
        sys.stderr.flush()
        # as burstengine's launcher does: no interpreter teardown, which can block on a c10d
        # store whose host (rank 0) is gone
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


# --- the runner --------------------------------------------------------------------------------

def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stamp(text: str, tag: str) -> float | None:
    m = re.search(rf"^{tag} ([0-9.]+)$", text, re.M)
    return float(m.group(1)) if m else None


def victim_of(fault: str, world: int) -> int:
    return 0 if fault == "store_host" else world - 1 if fault != "subgroups" else 3


def run_fault(fault: str, world: int = 4, deadline: float = 6.0, device: str = "cpu", limit: float = 180.0,
              tmp: str | None = None) -> dict:
    """Run one fault job; the victim, each survivor's (rc, seconds from the fault to its exit,
    named the victim, the last line of its error) and whether any hung."""
    import tempfile

    victim = victim_of(fault, world)
    port = _port()
    tmp = tmp or tempfile.mkdtemp(prefix="burst_faults_")
    procs, logs = {}, {}
    start = os.path.join(tmp, "started")
    os.makedirs(start, exist_ok=True)
    agent = {}
    if fault != "store_host":
        # as torchrun does: its agent (here, this runner) hosts the c10d store, so the store
        # outlives any rank; store_host keeps plain env:// rendezvous, where rank 0 hosts it
        from torch.distributed import TCPStore

        agent = dict(store=TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False),
                     env=dict(TORCHELASTIC_USE_AGENT_STORE="True"))
    for r in range(world):
        env = dict(os.environ, **agent.get("env", {}), RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), VICTIM=str(victim), OMP_NUM_THREADS="1",
                   BURST_TIMEOUT=str(deadline), FAULT_DEVICE=device, FAULT_DIR=os.path.join(tmp, "ckpt"),
                   FAULT_START=start)
        for key in ("BURST_CHECKS", "BURST_TOPOLOGY", "BURST_CLUSTER"):
            env.pop(key, None)
        # files, not pipes: a rank must never block writing its (long, C++) error output
        logs[r] = (open(os.path.join(tmp, f"out{r}"), "w+"), open(os.path.join(tmp, f"err{r}"), "w+"))
        procs[r] = subprocess.Popen([sys.executable, "-m", "burstengine.bench.faults.phases", "job", fault], env=env,
                                    stdout=logs[r][0], stderr=logs[r][1], text=True)
    ends, t0 = {}, time.time()
    while time.time() - t0 < limit:
        for r, p in procs.items():
            if r not in ends and p.poll() is not None:
                ends[r] = time.time()
        if all(r in ends for r in procs if r != victim):
            break
        time.sleep(0.05)
    for r, p in procs.items():
        if p.poll() is None:
            if r == victim:
                p.send_signal(signal.SIGCONT)
            p.kill()
        p.wait()
    outs = {}
    for r, files in logs.items():
        outs[r] = []
        for f in files:
            f.seek(0)
            outs[r].append(f.read())
            f.close()
    if os.environ.get("FAULT_DEBUG"):
        for r, (o, e) in outs.items():
            print(f"--- rank {r}\n{o}\n{e[-3000:]}", file=sys.stderr)
    at = _stamp(outs[victim][0], "FAULT_AT")
    survivors = {}
    for r, (out, err) in outs.items():
        if r == victim:
            continue
        lines = [ln for ln in err.strip().splitlines() if "RankLost" in ln or "watchdog" in ln or "Error" in ln]
        survivors[r] = dict(rc=procs[r].returncode, hung=r not in ends, finished="FINISHED" in out,
                            seconds=None if r not in ends or at is None else round(ends[r] - at, 2),
                            named_victim=bool(re.search(rf"rank {victim} lost", err)),
                            traceback="Traceback" in err,
                            error=(lines[-1] if lines else (err.strip().splitlines() or [""])[-1])[:400])
    return dict(fault=fault, world=world, victim=victim, deadline_s=deadline, device=device, survivors=survivors)


def judge(res: dict, slack: float = SLACK) -> list[str]:
    """What is wrong with one fault's result (empty: every survivor ended non-zero, in time,
    naming the victim)."""
    bad = []
    for r, s in res["survivors"].items():
        what = f"{res['fault']}: rank {r}"
        if s["hung"]:
            bad.append(f"{what} hung")
        elif s["finished"] or s["rc"] == 0:
            bad.append(f"{what} finished as if nothing happened")
        elif not s["named_victim"]:
            bad.append(f"{what} did not name rank {res['victim']}: {s['error']}")
        elif s["seconds"] is None or s["seconds"] > res["deadline_s"] + slack:
            bad.append(f"{what} took {s['seconds']} s (deadline {res['deadline_s']} s + {slack} s)")
    return bad


def _fuzz_counts(tests_dir: str | None) -> dict | None:
    """The bad-call fuzz of the test suite (``tests_dir``/fuzz_cases.py of a checkout): calls
    tried, hangs and silent wrong answers, per world size.  None without a tests directory (an
    installed package has none)."""
    path = os.path.join(tests_dir, "fuzz_cases.py") if tests_dir else None
    if not path or not os.path.exists(path):
        return None
    from ...testing import suite_on_path  # torch comes with the fuzz: the runner stays light otherwise
    suite_on_path(tests_dir)  # fuzz_cases imports the suite's helpers and tests/attention/test_fuzz.py
    spec = importlib.util.spec_from_file_location("fuzz_cases", path)
    cases = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_cases"] = cases  # one module object: the pool pickles its functions by name
    spec.loader.exec_module(cases)
    return cases.run_all()


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or command_parser("burstengine bench faults", __doc__.split("\n\n")[0])
    p.add_argument("--faults", default=None, help=f"comma-separated subset of {FAULTS} [all; {', '.join(NEEDS_4)} "
                                                  f"only with --world 4 or more]")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--deadline", type=float, default=6.0, help="BURST_TIMEOUT of the jobs (seconds)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--limit", type=float, default=180.0, help="seconds before a job's ranks are killed [%(default)s]")
    p.add_argument("--no-fuzz", action="store_true", help="skip the bad-call fuzz (counts of calls tried)")
    p.add_argument("--tests", default="tests", help="the checkout's tests/ folder, whose fuzz cases are counted "
                                                    "[%(default)s; skipped when absent]")
    p.add_argument("--out-dir", default=None, help="record directory [$BURST_RESULTS or ./burst-results]")
    p.add_argument("--name", default=None, help="record name (default faults_<device>)")
    return p


def main(argv=None) -> int:
    if argv and argv[0] == "job":
        _job_main(argv[1])
        return 0
    args = build_parser().parse_args(argv)
    faults = [f for f in args.faults.split(",") if f] if args.faults else \
        [f for f in FAULTS if args.world >= 4 or f not in NEEDS_4]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown or args.world < (4 if set(faults) & set(NEEDS_4) else 2) or args.deadline <= 0:
        print(f"burstengine bench faults: error: unknown faults {unknown} (known: {FAULTS}), or --world < 2 "
              f"(< 4 with subgroups: the double ring needs 2x2), or --deadline <= 0", file=sys.stderr)
        return 2
    from ..records import write_record  # only when writing a record

    results, problems = {}, []
    for f in faults:
        res = run_fault(f, args.world, args.deadline, args.device, limit=args.limit)
        results[f] = res
        problems += judge(res)
        times = [s["seconds"] for s in res["survivors"].values()]
        print(f"{f}: victim rank {res['victim']}; survivors' seconds to a clear exit {times}", flush=True)
    payload = dict(world=args.world, deadline_s=args.deadline, device=args.device, slack_s=SLACK, faults=results,
                   problems=problems,
                   summary={f: dict(max_seconds=max((s["seconds"] or 0) for s in r["survivors"].values()),
                                    hangs=sum(s["hung"] for s in r["survivors"].values()),
                                    named=all(s["named_victim"] for s in r["survivors"].values()))
                            for f, r in results.items()})
    if not args.no_fuzz:
        payload["fuzz"] = _fuzz_counts(args.tests)
    path = write_record(args.name or f"faults_{args.device}", payload, args.out_dir)
    print("\n".join(problems) or "every survivor ended in time, naming the victim")
    print("wrote", path)
    return 1 if problems else 0


# --- docs/results.md ----------------------------------------------------------------------------

FAULT_WHAT = {
    "first_call": "SIGKILL at the start of the first call (before the argument check)",
    "agree_gather": "SIGKILL inside the first argument-check all-gather",
    "checks_local": "runs BURST_CHECKS=local alone (skips the argument check)",
    "before_group": "train: SIGKILL before the process group forms",
    "train_step": "train: SIGKILL mid training step",
    "generate_step": "generate: SIGKILL in a prefill ring step",
    "generate_freeze": "generate: frozen (SIGSTOP) in a decode step",
    "prefill_freeze": "prefill: frozen (SIGSTOP) in a ring step",
    "eval_freeze": "eval needle: frozen (SIGSTOP) in a decode step",
    "subgroups": "SIGKILL before the double ring's sub-groups are made",
    "ring_step": "SIGKILL mid forward ring step",
    "skip_call": "skips the last call (alive elsewhere)",
    "skip_backward": "skips a backward, goes on to the next call",
    "freeze": "frozen (SIGSTOP) mid ring step",
    "store_host": "rank 0 (hosts the c10d store) SIGKILLed mid ring step",
    "checkpoint_save": "SIGKILL while writing a DCP checkpoint (under the watchdog)",
}


def render(rec):
    head = [f"{rec['world']} ranks on {rec['device']}, BURST_TIMEOUT {num(rec['deadline_s'])} s; seconds from the "
            f"fault to each survivor's exit (non-zero), and whether its error names the lost rank.", ""]
    body = []
    for name, r in rec["faults"].items():
        s = r["survivors"]
        body.append([name, FAULT_WHAT.get(name, name), r["victim"],
                     ", ".join(f"{fixed(v['seconds'], 2)}" if v["seconds"] is not None else "hung"
                               for _, v in sorted(s.items())),
                     sum(v["hung"] for v in s.values()),
                     "all" if all(v["named_victim"] for v in s.values()) else
                     f"{sum(v['named_victim'] for v in s.values())} of {len(s)}"])
    out = head + table(["fault", "what the victim does", "victim", "survivors' seconds to exit", "hung",
                        "named the victim"], body)
    fz = rec.get("fuzz")
    if fz:
        out += ["", f"Bad-call fuzz (tests/test_fuzz.py's cases): {fz['bad'] + fz['good']} calls on every rank of "
                f"worlds 2-4 ({fz['bad']} bad, {fz['good']} valid; {fz['calls']} rank-calls), {fz['failures']} "
                f"failures, {fz['hangs']} hangs, {fz['silent_wrong']} silent wrong answers.", ""]
        out += table(["batch", "bad", "valid", "failures", "silent wrong", "slowest call s"],
                     [[k, v["bad"], v["good"], v["failures"], v["silent_wrong"], fixed(v["slowest_call_s"], 3)]
                      for k, v in fz["worlds"].items()])
    return out


SECTIONS = (Section("Faults at every phase", r"^faults_", render,
                    "`burstengine bench faults`: a rank lost at each phase of a job, and the bad-call fuzz."),)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "job":
        _job_main(sys.argv[2])
    else:
        sys.exit(main(sys.argv[1:]))
