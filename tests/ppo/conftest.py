import jax
import pytest


@pytest.fixture(autouse=True)
def float64():
    """The PPO math is compared with float64 numpy references, so run it in float64."""
    with jax.enable_x64(True):
        yield
