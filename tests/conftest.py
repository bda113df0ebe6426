import os

import pytest
import torch

# Without a GPU, Triton kernels can only run in Triton's interpreter, and triton.jit picks the
# interpreter when triton is first imported: so say so before anything imports it (the gloo
# workers inherit it too).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from burstengine.testing import DistPool, suite_on_path  # noqa: E402

# the tests sit in folders named like the package's parts, the helpers they share (*_cases.py,
# triton_interp.py) here: every module of the suite is importable by its basename, in this process
# and in the gloo workers it spawns
suite_on_path(os.path.dirname(os.path.abspath(__file__)))

# where triton is installed (not in CI), kernels tried in this process run in its interpreter:
# with triton_interp's fixes to it, as in the interpreter scripts
if not torch.cuda.is_available():
    try:
        import triton_interp  # noqa: F401,E402
    except ImportError:
        pass

# the suite runs beside 4 worker processes on small CI machines: one thread each keeps tiny ops
# from paying for thread hand-offs
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def pool():
    """Four gloo processes for the whole test session; cases pick world sizes 1-4 from it."""
    p = DistPool(world=4)
    yield p
    p.close()


# The files that take longest (seconds of test time on the 2-core CI box, `--durations`), run
# first: with two test processes and a file each at a time (--dist loadfile), a long file started
# last would leave the other process idle at the end.  A stale name here only loses the ordering.
LONGEST_FIRST = ("bench/test_fault_phases.py", "inference/test_generate.py", "comm/test_fault.py", "cli/test_cli.py",
                 "train/test_train_lock.py", "model/test_lora.py", "bench/test_bench.py", "train/test_finetune.py",
                 "train/test_train.py", "train/test_train_fault.py", "train/test_soak.py", "cli/test_demo.py")


def pytest_collection_modifyitems(session, config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    rank = {os.path.join(here, f): i for i, f in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(str(it.path), len(rank)))  # stable: the rest keep their order
