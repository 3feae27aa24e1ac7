"""Shared fixtures: random cases and the tolerances of the comparison with PyTorch."""

import zlib

import numpy as np
import pytest

try:
    import torch
except ImportError:  # test_bf16.py runs without torch (its torch tests skip); the rest need it
    torch = None


def pytest_configure(config):
    # torch 1.13's LazyLinear (d2l's projections) warns on every construction that it is new.
    config.addinivalue_line("filterwarnings", "ignore:Lazy modules are a new feature")


# The oracle is small; one thread keeps it deterministic and leaves the cores to attn.
if torch is not None:
    torch.set_num_threads(1)

# float32: attn and PyTorch agree within tolerance, not bitwise (different summation and scaling
# orders, see the semantics notes); float64 pins the math down much tighter.
TOLERANCE = {
    np.float32: dict(rtol=1e-5, atol=1e-6),
    np.float64: dict(rtol=1e-10, atol=1e-12),
}


def autograd_node_names(out):
    """Names of the autograd nodes behind `out` (the caller keeps `out` alive: a Python
    Function's graph node lives only as long as the tensors it made)."""
    seen, todo = set(), [out.grad_fn]
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        todo.extend(g for g, _ in f.next_functions)
    return [_OP_NODE_NAMES.get(type(f).__name__, type(f).__name__) for f in seen]


# PyTorch >= 2.4 runs attn.torch's kernels as custom operators (python/attn/_torch_ops.py), whose
# autograd nodes are named after the op; 1.13 runs them as autograd Functions. One name for each.
_OP_NODE_NAMES = {f"GeneratedBackwardFor_attn_{op}_defaultBackward": name for op, name in (
    ("linear", "_LinearBackward"), ("sdpa", "_AttentionBackward"),
    ("heads_attention", "_HeadsAttentionBackward"),
    ("packed_heads_attention", "_PackedHeadsAttentionBackward"))}


def assert_close(actual, expected, dtype, what=""):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), err_msg=what,
                               **TOLERANCE[np.dtype(dtype).type])


def assert_close_f32(actual, torch32, torch64, what=""):
    """float32 against PyTorch's float32 result, forgiving PyTorch's own float32 error: an element
    also passes when it is within the float32 tolerance of PyTorch's float64 result. Parameter
    gradients sum many cancelling products, so torch's float32 value can sit further than
    atol 1e-6 from the truth (the C++ parity test applies the same rule)."""
    a, e32, e64 = (np.asarray(x, np.float64) for x in (actual, torch32, torch64))
    tol = TOLERANCE[np.float32]
    ok = (np.abs(a - e32) <= tol["atol"] + tol["rtol"] * np.abs(e32)) | (
        np.abs(a - e64) <= tol["atol"] + tol["rtol"] * np.abs(e64))
    if not ok.all():
        np.testing.assert_allclose(a, e32, err_msg=what + " (and not within tolerance of torch's "
                                   "float64 result either)", **tol)


def case_seed(request):
    # A fixed seed per test case (from its id, not Python's salted hash), so a failure
    # reproduces alone and across runs.
    # The id without its directory, so the case is the same wherever pytest is started from.
    nodeid = request.node.nodeid.rsplit("/", 1)[-1]
    return zlib.crc32(nodeid.encode())


@pytest.fixture
def rng(request):
    return np.random.default_rng(case_seed(request))


@pytest.fixture(autouse=True)
def torch_seed(request):
    # The d2l reference modules draw their weights from PyTorch's global generator, which
    # PyTorch seeds from the OS in every process: seeded per case as well, a case's weights (and
    # so whether its tolerances hold) are the same on every run. A test's own manual_seed wins.
    if torch is not None:
        torch.manual_seed(case_seed(request))
