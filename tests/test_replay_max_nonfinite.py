"""Traced max/min whose gradient is inf or NaN: torch's max()/min() give it to the picked
elements only (a masked fill, an index scatter: 0.0 at every other element whatever it
is), its amax/amin multiply it by the tie mask (NaN at the others). The scalar expansion
and array programs (the NumPy thresholds forced down), against torch (review13)."""

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.interpreters import program_arrays as PA

from harness import replay_forms as RF

torch = pytest.importorskip("torch")


def mx(M, x):
    return x.max() if M is torch else M.max(x)


def mn(M, x):
    return x.min() if M is torch else M.min(x)


def mx_dim(M, X):  # max over rows' columns, the values (max(dim)'s index rule)
    return M.max(X, 1)[0]


def mn_dim(M, X):
    return M.min(X, 0)[0]


CASES = {
    # the product's gradient into the max is sum(x), -inf (finite x, the sum overflows)
    "max_times_overflowing_sum": (lambda M, x: mx(M, x) * M.sum(x),
                                  lambda n: np.r_[np.full(n - 1, -1e308), 2.0]),
    "min_times_overflowing_sum": (lambda M, x: mn(M, x) * M.sum(x),
                                  lambda n: np.r_[np.full(n - 1, 1e308), -2.0]),
    # a NaN gradient into the max (x with inf: inf - inf), 0.0 at the others in torch
    "softmax_shift_with_inf": (lambda M, x: M.sum(M.exp(x - mx(M, x))),
                               lambda n: np.r_[np.inf, np.linspace(-1.0, 1.0, n - 1)]),
    "ties_share_an_inf_gradient": (lambda M, x: mx(M, x) * M.sum(x),
                                   lambda n: np.r_[2.0, np.full(n - 2, -1e308), 2.0]),
    "max_dim_times_overflowing_rows": (
        lambda M, x: M.sum(mx_dim(M, x.reshape(4, -1)) * M.sum(x.reshape(4, -1), 1)),
        lambda n: np.where(np.arange(n) % 3 == 0, 1.0, -1e308)),
    "min_dim_nan_gradient": (
        lambda M, x: M.sum(mn_dim(M, x.reshape(4, -1)) * M.sum(x.reshape(4, -1), 0)),
        lambda n: np.where(np.arange(n) % 5 == 1, np.inf, 0.5)),
}


def torch_grad(f, x0):
    xt = torch.tensor(x0, requires_grad=True)
    g, = torch.autograd.grad(f(torch, xt), xt)
    return g.numpy()


def traced_grad(f, x0, arrays, monkeypatch):
    if not arrays:
        return tg.trace(lambda x: f(tg, x), x0).value_and_grad(x0)[1]
    for name in ("NUMPY_RED_MIN", "NUMPY_BCAST_MIN", "NUMPY_MM_MIN"):
        monkeypatch.setattr(PA, name, 16)
    monkeypatch.setattr(PA, "NUMPY_MIN", dict.fromkeys(PA.NUMPY_MIN, 16))
    with RF.array_instructions(4):
        P = tg.trace(lambda x: f(tg, x), x0)
    return P.value_and_grad(x0)[1]


@pytest.mark.parametrize("arrays", [False, True], ids=["scalar", "arrays"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_non_finite_gradient_goes_to_the_picked_elements_only(case, arrays, monkeypatch):
    f, make = CASES[case]
    x0 = make(48 if arrays else 8)
    want = torch_grad(f, x0)
    assert np.isfinite(want).sum() >= 2, "the case must have elements torch keeps finite"
    np.testing.assert_allclose(traced_grad(f, x0, arrays, monkeypatch), want, rtol=1e-12)
    xe = tg.tensor(x0, requires_grad=True)  # eager mode agrees (kept so)
    ge, = tg.autograd.grad(f(tg, xe), xe)
    np.testing.assert_allclose(ge.numpy(), want, rtol=1e-12)


@pytest.mark.parametrize("arrays", [False, True], ids=["scalar", "arrays"])
@pytest.mark.parametrize("red", ["amax", "amin"])
def test_amax_keeps_torchs_mask_product(red, arrays, monkeypatch):
    # torch's amax/amin: mask * (g / count), an inf g NaN at the other elements too
    sign = 1.0 if red == "amax" else -1.0
    f = lambda M, x: getattr(M, red)(x, 0) * M.sum(x)  # noqa: E731
    x0 = sign * np.r_[np.full(47 if arrays else 7, -1e308), 2.0]
    want = torch_grad(f, x0)
    assert np.isnan(want[0])
    np.testing.assert_allclose(traced_grad(f, x0, arrays, monkeypatch), want, rtol=1e-12)


@pytest.mark.parametrize("arrays", [False, True], ids=["scalar", "arrays"])
def test_the_hessian_of_a_max_with_ties_and_an_index(arrays, monkeypatch):
    # pick_where's rule re-records into the gradient program (its weight a constant)
    def f(M, x):
        X = x.reshape(4, -1)
        return mx(M, x * x) * M.sum(x) + M.sum(mx_dim(M, X) * M.sum(X * X, 1))
    n = 48 if arrays else 8
    x0 = np.round(np.random.default_rng(5).normal(size=n), 1)
    x0[3] = x0[5] = -3.5  # a tie of x * x's max
    u = np.random.default_rng(6).normal(size=n)
    if arrays:
        for name in ("NUMPY_RED_MIN", "NUMPY_BCAST_MIN"):
            monkeypatch.setattr(PA, name, 16)
    with RF.array_instructions(4 if arrays else 10 ** 9):
        P = tg.trace(lambda x: f(tg, x), x0)
    hv = P.hvp((x0,), (u,))[1]
    xt = torch.tensor(x0, requires_grad=True)
    gt, = torch.autograd.grad(f(torch, xt), xt, create_graph=True)
    ht, = torch.autograd.grad((gt * torch.tensor(u)).sum(), xt)
    np.testing.assert_allclose(hv, ht.numpy(), rtol=1e-10, atol=1e-12)


# (x * x, read only by the ties' tests, reads x through a detach: its rule's 0.0 * inf
# NaN went into x's adjoint; program.cut_dead)
def test_hvp_of_a_max_at_an_inf_picked_value():
    x0, u = np.array([np.inf, 2.0, 0.5]), np.array([1.0, 0.5, -0.7])
    P = tg.trace(lambda x: tg.max(x * x, 0)[0], x0)
    hv = P.hvp((x0,), (u,))[1]
    xt = torch.tensor(x0, requires_grad=True)
    gt, = torch.autograd.grad((xt * xt).max(0).values, xt, create_graph=True)
    ht, = torch.autograd.grad((gt * torch.tensor(u)).sum(), xt)
    np.testing.assert_allclose(hv, ht.numpy())
