import pytest

from burstengine.testing import DistPool


@pytest.fixture(scope="session")
def pool():
    """Four gloo processes for the whole test session; cases pick world sizes 1-4 from it."""
    p = DistPool(world=4)
    yield p
    p.close()
