import pytest
import torch

from burstengine.testing import DistPool

# the suite runs beside 4 worker processes on small CI machines: one thread each keeps tiny ops
# from paying for thread hand-offs
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def pool():
    """Four gloo processes for the whole test session; cases pick world sizes 1-4 from it."""
    p = DistPool(world=4)
    yield p
    p.close()
