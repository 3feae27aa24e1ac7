"""Shared fixtures: random cases and the tolerances of the comparison with PyTorch."""

import zlib

import numpy as np
import pytest
import torch



def pytest_configure(config):
    # torch 1.13's LazyLinear (d2l's projections) warns on every construction that it is new.
    config.addinivalue_line("filterwarnings", "ignore:Lazy modules are a new feature")


# The oracle is small; one thread keeps it deterministic and leaves the cores to attn.
torch.set_num_threads(1)

# float32: attn and PyTorch agree within tolerance, not bitwise (different summation and scaling
# orders, see the semantics notes); float64 pins the math down much tighter.
TOLERANCE = {
    np.float32: dict(rtol=1e-5, atol=1e-6),
    np.float64: dict(rtol=1e-10, atol=1e-12),
}


def assert_close(actual, expected, dtype, what=""):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), err_msg=what,
                               **TOLERANCE[np.dtype(dtype).type])


@pytest.fixture
def rng(request):
    # A fixed seed per test case (from its id, not Python's salted hash), so a failure
    # reproduces alone and across runs.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
