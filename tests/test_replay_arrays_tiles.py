"""A compiled step of sums whose terms tile ranges of slots that nothing else reads writes
their adjoints (``program_arrays._red_tiles``: each ``0.0 + g``), and those adjoints are
not zeroed first (kmeans' gradient's blocked sums over its points, a row sum's blocks):
the same bits as the sums' compiled rule adding to zeroed adjoints, with every adjoint
the sweep does not zero NaN before it; NaN, inf and -0.0 among the inputs; torch's
numbers."""

import numpy as np
import pytest

import tapegrad as tg
from tapegrad._program_derivs import _hvp_run
from tapegrad.interpreters import program_arrays as PA

from test_replay_arrays_km import _kmeans_at, _run_nan_adjoints
from test_replay_hvp_value import bits

torch = pytest.importorskip("torch")


def _back(code):
    return dict(zip(code.run.__code__.co_freevars, code.run.__closure__))["back"].cell_contents


def _tiled(code):
    return sum(1 for s in _back(code) if type(s[3]) is tuple and s[3][0] is PA.TILES)


def _special(x):
    x = x.copy()
    x.flat[[3, 1007, 2020, 3033]] = [np.inf, -0.0, np.nan, -np.inf]
    return x


FUNCS = {
    "row_sums": lambda M, x: (M.exp(x).sum(1) * M.sin(x[:, 0])).sum(),
    "log_row_sums": lambda M, x: M.log(M.exp(x).sum(1)).sum(),
    # (the exps read again: their adjoints added to by another rule, not tiles)
    "read_again": lambda M, x: M.exp(x).sum(1).sum() + (M.exp(x)[:, 3] * 5.0).sum(),
}


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("name", list(FUNCS))
def test_tiled_sums_same_bits(name, special, monkeypatch):
    f = FUNCS[name]
    x0 = np.random.default_rng(2).normal(size=(40, 1000))
    x = _special(x0) if special else x0
    v = np.random.default_rng(3).normal(size=x0.shape)
    P = tg.trace(lambda t: f(tg, t), x0)
    got = P.value_and_grad(x) + P.grad_and_hvp((x,), (v,))
    assert _tiled(P._code) >= (0 if name == "read_again" else 1)
    with monkeypatch.context() as m:
        m.setattr(PA, "_red_tiles", lambda rows, back, out: (back, []))
        P2 = tg.trace(lambda t: f(tg, t), x0)
        want = P2.value_and_grad(x) + P2.grad_and_hvp((x,), (v,))
        assert _tiled(P2._code) == 0
    for a, b in zip(got, want):
        assert bits(a) == bits(b)
    # the adjoints it leaves unzeroed are written before they are read
    res = _run_nan_adjoints(P._code, x.ravel())
    assert bits(res) == bits(np.concatenate(([want[0]], want[1].ravel())))
    if not special:
        xt = torch.tensor(x, requires_grad=True)
        g, = torch.autograd.grad(f(torch, xt), xt)
        np.testing.assert_allclose(got[1], g.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["plain", "nan", "inf", "zero"])
def test_kmeans_hvp_tiles_same_bits(case, monkeypatch):
    """kmeans' Hessian-vector program: the gradient's blocked sums over the points (80,000
    terms) tile; H v, the gradient and the value the bits of the sums' compiled rule."""
    make, PT0, C0 = _kmeans_at(case)
    v = np.random.default_rng(5).normal(size=C0.shape)
    P = make()
    got = P.grad_and_hvp((C0,), (v,))
    code = _hvp_run(P._code)
    # (zero points: constants that split the instructions, the sums no longer tiles)
    assert _tiled(code) >= (0 if case == "zero" else 2)
    with monkeypatch.context() as m:
        m.setattr(PA, "_red_tiles", lambda rows, back, out: (back, []))
        P2 = make()
        want = P2.grad_and_hvp((C0,), (v,))
    for a, b in zip(got, want):
        assert bits(a) == bits(b)
    res = _run_nan_adjoints(code, np.concatenate((C0.ravel(), v.ravel())))
    assert not np.isnan(res[2 + C0.size:]).any() or case in ("nan", "inf")
    np.testing.assert_array_equal(res[1], want[0])
