"""The work a backward skips or shortens for speed (GradBench's vectorized evals): each
shortcut gives torch's numbers and is checked to be taken."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.autograd import _tensor_backend
from tapegrad.interpreters import cpu

torch = pytest.importorskip("torch")


def _count(monkeypatch, module):
    calls = []
    real = module.sum_to
    monkeypatch.setattr(module, "sum_to", lambda g, shape: calls.append(shape) or real(g, shape))
    return calls


@pytest.mark.parametrize("create_graph", [False, True])
def test_constant_input_gradient_not_summed(monkeypatch, create_graph):
    # the broadcast of a constant's gradient is never undone: nobody reads it (kmeans'
    # points, (n, k, d) -> (n, 1, d), was most of its backward)
    calls = _count(monkeypatch, _tensor_backend if create_graph else cpu)
    rng = np.random.default_rng(0)
    c0, x0 = rng.normal(size=(5, 1, 3)), rng.normal(size=(4, 3))
    out = []
    for M in (tg, torch):
        c = M.tensor(c0)
        x = M.tensor(x0, requires_grad=True)
        d = c - x
        g, = M.autograd.grad((d * d).sum(), x, create_graph=create_graph)
        if create_graph:
            h, = M.autograd.grad(g.sum(), x)
            out.append((g.detach().numpy(), h.numpy()))
        else:
            out.append((g.numpy(),))
    for a, b in zip(*out):
        np.testing.assert_allclose(a, b, rtol=1e-14)
    assert all(tuple(s) == (4, 3) for s in calls), calls  # x's only, never c's (5, 1, 3)


SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e308, -1e308, 5e-324])


def _same_bits(r, s):
    return (r.shape == s.shape and np.array_equal(r, s, equal_nan=True)
            and np.array_equal(np.signbit(r)[~np.isnan(r)], np.signbit(s)[~np.isnan(s)]))


@pytest.mark.parametrize("n", range(1, 10))
def test_fast_sum_is_numpys_sum_bit_for_bit(n):
    # the short-last-axis sum (k-means' squared distances) adds in NumPy's order: same
    # bits, a sum of -0.0s is +0.0, infinities and NaNs as NumPy
    from tapegrad.ops.arrays import fast_sum, sum_to
    rng = np.random.default_rng(n)
    with np.errstate(all="ignore"):
        for frac in (0.0, 0.1, 0.5, 1.0):
            a = rng.normal(size=(300, 3, n)) * rng.lognormal(size=(300, 3, n)) * 10
            m = rng.random(a.shape) < frac
            a[m] = rng.choice(SPECIALS, size=m.sum())
            a[0, 0] = -0.0
            for axis, keep in ((-1, False), (2, True), ((2,), False)):
                assert _same_bits(np.sum(a, axis=axis, keepdims=keep), fast_sum(a, axis, keep))
            if n > 1:
                assert _same_bits(np.sum(a, axis=2, keepdims=True), sum_to(a, (300, 3, 1)))
    x = rng.normal(size=(300, 3, n))
    np.testing.assert_array_equal(tg.sum(tg.tensor(x), 2).numpy(), np.sum(x, axis=2))
    np.testing.assert_allclose(tg.sum(tg.tensor(x), -1).numpy(),
                               torch.sum(torch.tensor(x), -1).numpy(), rtol=1e-14, atol=1e-14)


def test_fast_sum_taken(monkeypatch):
    from tapegrad.ops import arrays
    calls = []
    real = arrays._sum_last
    monkeypatch.setattr(arrays, "_sum_last", lambda a, n: calls.append(n) or real(a, n))
    tg.sum(tg.tensor(np.ones((1000, 10, 8))), 2)
    tg.sum(tg.tensor(np.ones((1000, 10, 8))), 1)  # not the last axis: NumPy's own
    assert calls == [8]


def test_fast_sum_other_axes_unchanged():
    from tapegrad.ops.arrays import fast_sum, sum_to
    a = np.random.default_rng(0).normal(size=(300, 3, 4))
    for axis in ((0, 2), (1, 2), (0,), 1, (0, 1, 2)):
        assert _same_bits(fast_sum(a, axis, True), np.sum(a, axis=axis, keepdims=True))
    assert _same_bits(sum_to(a, (1, 3, 1)), np.sum(a, axis=(0, 2), keepdims=True))


@pytest.mark.parametrize("case", ["ties", "nan", "inf", "plain"])
@pytest.mark.parametrize("create_graph", [False, True])
def test_full_max_gradient_shortcuts(case, create_graph):
    # max()'s gradient counts ties with count_nonzero and looks for NaNs only when the
    # result is NaN (lse's backward): torch's values, with create_graph too
    x0 = np.random.default_rng(1).normal(size=(4, 5))
    if case == "ties":
        x0[1, 2] = x0[3, 4] = x0[0, 0] = 9.0
    elif case == "nan":
        x0[2, 2] = x0[0, 1] = np.nan
    elif case == "inf":
        x0[1, 1] = np.inf
    out = []
    for M in (tg, torch):
        x = M.tensor(x0, requires_grad=True)
        for fn in (M.max, M.min):
            g, = M.autograd.grad(fn(x) * 3.0, x, create_graph=create_graph)
            out.append(g.detach().numpy())
            if create_graph:
                h, = M.autograd.grad((g * x).sum(), x)
                out.append(h.numpy())
    half = len(out) // 2
    for a, b in zip(out[:half], out[half:]):
        np.testing.assert_allclose(a, b, rtol=1e-15, equal_nan=True)
