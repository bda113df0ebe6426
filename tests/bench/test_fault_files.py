"""Damaged files in, one line out: the cases of `burstengine bench faults-files`
(burstengine/bench/faults/files.py), each run as a user runs it.  A damaged HF directory
through train, generate and prefill; a damaged newest checkpoint through export (the run falls
back to the intact one and says why, the checkpoint named directly is refused naming the file);
an out_dir that is a file or another model's directory; a disk that fills mid-export; exports
racing into one out_dir.  The bench starts a fresh interpreter per command; here they run in the
test process (tests/cli_cases.py), but for the full disk (a patch of the writer in a process of
its own) and the racing exports (processes at once), which keep theirs."""
import pytest

import cli_cases
from burstengine.bench.faults import files as ff


@pytest.fixture(scope="module", autouse=True)
def commands_in_this_process():
    spawned = ff.cli

    def cli(argv, timeout=300.0, env=None, code=None):
        return spawned(argv, timeout, env, code) if code else cli_cases.run(argv, env=env)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ff, "cli", cli)
        yield


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    return ff.make_hf_dir(str(d / "hf")), ff.make_run(str(d / "run"))


# each damage through one command, the commands in turn (bench faults-files runs every pair)
HF_CASES = [(damage, list(ff.HF_COMMANDS)[i % len(ff.HF_COMMANDS)]) for i, damage in enumerate(ff.HF_DAMAGE)]


@pytest.mark.parametrize("damage,command", HF_CASES)
def test_damaged_hf_dir_is_one_line_naming_the_file(good, damage, command, tmp_path):
    assert ff.hf_case(good[0], damage, command, str(tmp_path)) is None


@pytest.mark.parametrize("damage", list(ff.CKPT_DAMAGE))
def test_export_of_a_damaged_checkpoint_falls_back_or_is_refused(good, damage, tmp_path):
    assert ff.checkpoint_case(good[1], damage, str(tmp_path)) == []


def test_export_out_dir_a_file_or_another_model(good, tmp_path):
    assert ff.out_dir_cases(good[1], good[0], str(tmp_path)) == []


def test_export_on_a_full_disk_leaves_the_earlier_export(good, tmp_path):
    assert ff.full_disk_case(good[1], str(tmp_path)) == []


def test_concurrent_exports_leave_one_whole_export(good, tmp_path):
    assert ff.concurrent_exports(good[1], str(tmp_path)) == []
