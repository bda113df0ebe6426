"""`burstengine bench train --ablation`: which runs the rows stand for, and one launch on CPU/gloo
at a tiny size (every row runs, the step-0 losses agree, the record and tables are written)."""
import json

import pytest

import cli_cases
import train_cases as tc
from burstengine.bench.peers import ablation as A


def test_plan_is_cumulative_and_shares_runs():
    runs = A.row_runs(0.5, [0.0, 0.5, 1.0], A.DEFAULT_ROWS)
    by = {n: r for r in runs for n in r["rows"]}
    assert [r["rows"] for r in runs] == [["baseline"], ["+burst-bwd"], ["+fused-loss"], ["+seq-ckpt", "split=0.5"],
                                         ["store-all", "split=1"], ["split=0"]]
    assert by["baseline"]["config"] == {"attn_backward": "ring", "loss": "naive", "activation_checkpoint": "full",
                                        "fused_ops": "false"}
    assert by["+fused-loss"]["config"] == {"attn_backward": "burst", "loss": "fused", "activation_checkpoint": "full",
                                           "fused_ops": "false"}
    assert by["split=0"]["config"] == {"attn_backward": "burst", "loss": "fused", "activation_checkpoint": "sequence",
                                       "activation_checkpoint_split": "0.0", "fused_ops": "false"}
    assert by["store-all"]["config"]["activation_checkpoint_split"] == "1" and "selective" not in by
    only = A.row_runs(0.25, [], ["selective", "+seq-ckpt"])
    assert [r["rows"] for r in only] == [["+seq-ckpt"], ["selective"]]
    assert only[0]["config"]["activation_checkpoint_split"] == "0.25"
    new = {n: r for r in A.row_runs(0.5, [], ["+fused-ops", "auto"]) for n in r["rows"]}
    assert new["+fused-ops"]["config"]["fused_ops"] == "true" and new["+fused-ops"]["config"]["loss"] == "fused"
    assert new["auto"]["config"]["activation_checkpoint"] == "auto"
    with pytest.raises(ValueError, match="unknown ablation rows"):
        A.row_runs(0.5, [], ["baseline", "turbo"])


def test_append_replaces_rerun_rows():
    old = [{"seq_len": 8, "config": {"a": "1"}, "x": 1}, {"seq_len": 8, "config": {"a": "2"}, "x": 2}]
    new = [{"seq_len": 8, "config": {"a": "2"}, "x": 3}, {"seq_len": 16, "config": {"a": "1"}, "x": 4}]
    assert [r["x"] for r in A._combine(old, new)] == [1, 3, 4]


def _bench(*argv, out):
    """``burstengine bench train --ablation`` on 2 ranks (in this process: tests/cli_cases.py)."""
    sets = [a for s in tc.SMALL[:6] + ["passkey_symbols=8", "passkey_len=3", "layout=striped"] for a in ("--set", s)]
    rc, stdout, stderr = cli_cases.run(["bench", "train", "--ablation", "--world", "2", "--seqs", "64", "--steps", "1",
                                        "--warmup", "0", *sets, *argv], env={"BURST_RESULTS": str(out)})
    return rc, stdout + stderr


def test_ablation_runs_every_row_on_cpu(tmp_path):
    rc, out = _bench("--splits", "0,0.5,1", out=tmp_path)
    assert rc == 0, out
    rec = json.loads((tmp_path / "ablation_tiny_2xcpu.json").read_text())
    rows = rec["rows"]
    assert [r["rows"] for r in rows] == [r["rows"] for r in A.row_runs(0.5, [0.0, 0.5, 1.0], A.DEFAULT_ROWS)]
    assert all(r["ok"] and r["tokens_per_s_per_gpu"] > 0 and len(r["step_times_s"]) == 1 for r in rows), rows
    # same weights and batch in every row: the optimisations change how, not what, is computed
    losses = [r["first_loss"] for r in rows]
    assert max(losses) - min(losses) <= 2e-6 * abs(losses[0]), losses
    assert rec["splits"] == [0.0, 0.5, 1.0] and "--ablation" in rec["command"]
    assert "BurstEngine Table 2" in out and "memory vs split" in out
    # a bad row is refused before any rank starts
    rc, out = _bench("--rows", "baseline,turbo", out=tmp_path)
    assert rc == 2 and "unknown ablation rows ['turbo']" in out


def test_bench_train_counts_data_parallel_sequences(tmp_path):
    """--set cp=1 on 2 ranks (the paper's Table 5 rows): the bench keeps the user's cp (it used to force
    cp=0) and counts both ranks' sequences in tokens/s."""
    sets = [a for s in tc.SMALL[:6] + ["passkey_symbols=8", "passkey_len=3", "cp=1"] for a in ("--set", s)]
    rc, out, err = cli_cases.run(["bench", "train", "--world", "2", "--seqs", "64", "--steps", "1", "--warmup", "1",
                                  "--name", "t5", "--out-dir", str(tmp_path), *sets])
    assert rc == 0, out + err
    (row,) = json.loads((tmp_path / "t5.json").read_text())["rows"]
    assert (row["dp"], row["cp"]) == (2, 1), row
    # the untimed first step is recorded apart (a first step at a length pays kernel builds)
    assert len(row["step_times_s"]) == 1 and len(row["warmup_step_times_s"]) == 1, row
    assert row["tokens_per_s_per_gpu"] == pytest.approx(64 * 2 / 2 / row["median_step_s"]), row


def test_a_case_that_runs_out_of_memory_is_retried_with_the_fallback_plans(monkeypatch):
    """bench train gives every method the best plan that fits: after an OOM under the planned
    checkpointing, the --fallback plans in order (torch-CP ran out of memory at 256K and 512K on
    4 H100s under the plan BurstEngine's planner makes); a user's own plan is never replaced."""
    from argparse import Namespace

    from burstengine.bench.peers import train

    calls = []
    monkeypatch.setattr(train, "_say", lambda msg: None)  # rank 0's printer: no process group here

    def case(model, method, seq, args, config=(), row=None):
        calls.append(list(config))
        fits = "activation_checkpoint=full-offload" in config
        return dict(row or {}, ok=fits, **({} if fits else {"error": "out of memory"}))

    args = Namespace(fallback="full,full-offload", overrides=[])
    row = train.fitting_case("tiny", "torch-cp", 64, args, case=case)
    assert calls == [[], ["activation_checkpoint=full"], ["activation_checkpoint=full-offload"]]
    assert row["ok"] and row["activation_checkpoint"] == "full-offload"
    assert row["tried"] == [{"activation_checkpoint": "auto", "error": "out of memory"},
                            {"activation_checkpoint": "full", "error": "out of memory"}]
    calls.clear()
    row = train.fitting_case("tiny", "torch-cp", 64, Namespace(fallback="full", overrides=["activation_checkpoint=none"]),
                             case=case)
    assert calls == [[]] and not row["ok"] and "tried" not in row
    # a plan name the config does not know is refused before any rank starts
    bad = Namespace(model="tiny", fallback="fulll", overrides=[], ablation=False, seqs="64", methods="burst",
                    world=2, longest=False)
    assert train.validate(bad).startswith("--fallback fulll: activation_checkpoint must be one of")
