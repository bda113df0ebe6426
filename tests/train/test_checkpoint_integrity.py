"""A resume never continues from corrupt state or from another run's checkpoint: every file of a
checkpoint is checked against the size and SHA-256 recorded at save; a bad one is named and the
newest intact checkpoint is used instead; settings that change the data stream or the model
cannot change on resume, the schedule's can (and are logged)."""
import os

import pytest

import train_cases as tc
from burstengine.train import checkpoint as ckpt
from burstengine.train.loop import resume_changes

EXTRA = ["cp=2", "save_every=2", "save_keep=3", "layout=zigzag"]


def _flip(path, n=64):
    with open(path, "r+b") as f:
        f.seek(max(0, os.path.getsize(path) // 2 - n // 2))
        data = f.read(n)
        f.seek(-len(data), 1)
        f.write(bytes(b ^ 0xFF for b in data))


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _zero(path):
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(b"\0" * size)


DAMAGE = {"flip": _flip, "truncate": _truncate, "zero": _zero, "delete": os.remove}


@pytest.fixture(scope="module")
def trained(pool, tmp_path_factory):
    """A 2-rank run with checkpoints at steps 2 and 4, and its step losses."""
    base = tmp_path_factory.mktemp("ckpt")
    full = pool.run(tc.run_steps, str(base / "full"), 6, EXTRA, world=2)[0]
    pool.run(tc.run_steps, str(base / "run"), 6, EXTRA, stop_after=4, world=2)
    return base, {r["step"]: r["loss"] for r in full}


def _copy_run(base, tmp_path):
    import shutil
    dst = tmp_path / "run"
    shutil.copytree(base / "run", dst)
    return dst


def _shard(run, step):
    d = run / "checkpoints" / f"step_{step:08d}"
    return d / sorted(n for n in os.listdir(d) if n.endswith(".distcp"))[0]


def test_meta_records_every_file(trained):
    base, _ = trained
    d = base / "run" / "checkpoints" / "step_00000004"
    meta = ckpt.read_meta(str(d))
    assert sorted(meta["files"]) == sorted(n for n in os.listdir(d) if n != "meta.json")
    assert all(len(v["sha256"]) == 64 and v["bytes"] > 0 for v in meta["files"].values())


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_falls_back_to_intact(pool, trained, tmp_path, damage):
    base, full = trained
    run = _copy_run(base, tmp_path)
    bad = _shard(run, 4)
    DAMAGE[damage](bad)
    kind, steps, said = pool.run(tc.resume_outcome, str(run), 6, EXTRA, world=2)[0]
    assert kind == "ok"
    text = "\n".join(said)
    assert str(bad) in text and "not intact" in text, text
    assert "step_00000002 instead" in text, text
    got = {r["step"]: r["loss"] for r in steps[-4:]}  # steps 3..6 after the resume from step 2
    assert sorted(got) == [3, 4, 5, 6]
    for s in got:  # the intact checkpoint continues exactly as the uninterrupted run did
        assert got[s] == pytest.approx(full[s], rel=1e-6, abs=0), (s, got, full)


def test_no_intact_checkpoint_is_one_clear_error(pool, trained, tmp_path):
    base, _ = trained
    run = _copy_run(base, tmp_path)
    for step in (2, 4):
        _flip(_shard(run, step))
    kind, msg = pool.run(tc.resume_outcome, str(run), 6, EXTRA, world=2)[0]
    assert kind == "error" and "no intact checkpoint" in msg and "\n" not in msg, msg
    assert str(_shard(run, 4)) in msg and str(_shard(run, 2)) in msg


def test_garbage_meta_is_named(pool, trained, tmp_path):
    base, _ = trained
    run = _copy_run(base, tmp_path)
    meta = run / "checkpoints" / "step_00000004" / "meta.json"
    meta.write_text("{not json")
    kind, steps, said = pool.run(tc.resume_outcome, str(run), 6, EXTRA, world=2)[0]
    assert kind == "ok" and any(str(meta) in s and "corrupt" in s for s in said), said


@pytest.mark.parametrize("change,fixed", [("seq_len=16", True), ("model.dim=16", True), ("seed=3", True),
                                          ("lr=1e-3", False), ("warmup_steps=1", False)])
def test_resume_refuses_what_changes_data_or_model(pool, trained, tmp_path, change, fixed):
    base, _ = trained
    run = _copy_run(base, tmp_path)
    out = pool.run(tc.resume_outcome, str(run), 6, EXTRA + [change], world=2)[0]
    key = change.split("=")[0]
    if fixed:
        assert out[0] == "error" and key in out[1] and "another run" in out[1], out
    else:
        assert out[0] == "ok" and any(f"resume changes {key}" in s for s in out[2]), out[2]


def test_resume_changes_rule():
    saved = {"lr": 1.0, "steps": 4, "model": {"dim": 8}, "seq_len": 32}
    assert resume_changes(saved, dict(saved)) == []
    assert resume_changes(saved, {**saved, "steps": 8}) == ["resume changes steps: 4 -> 8"]
    with pytest.raises(ValueError, match=r"model\.dim \(8 -> 16\)"):
        resume_changes(saved, {**saved, "model": {"dim": 16}})


def test_weights_only_checkpoint_must_be_step_0(tmp_path):
    """A weights-only checkpoint (bench finetune load --save) is a step-0 one: one that says a
    later step is refused before anything is read, rather than resumed with a fresh optimizer."""
    import json

    (tmp_path / "meta.json").write_text(json.dumps({"step": 3, "world": 1, "optimizer": False, "files": {}}))
    with pytest.raises(ValueError, match="holds no optimizer state but says step 3"):
        ckpt.load(str(tmp_path), None, None)


def test_a_rank_stopped_mid_save_exits_as_told_not_as_a_write_error(pool, tmp_path):
    """Ctrl-C under the spawning launcher stops each rank by SIGTERM (SystemExit 143): one caught
    inside DCP's writer is the rank being stopped, not a failed write, so every rank leaves with it
    (once said "rank 0 could not write the checkpoint ... (SystemExit: 143)" beside the one line
    Ctrl-C gives)."""
    got = pool.run(tc.save_stopped, str(tmp_path / "ckpt"), world=2)
    assert got == [("SystemExit", "143")] * 2, got
