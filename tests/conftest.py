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
