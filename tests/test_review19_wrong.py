"""Wrong numbers found by the hunt of review 19, against torch: each program, on eager
tensors and traced (value and gradient), at the rows that found it."""
import numpy as np
import pytest

import tapegrad as tg

torch = pytest.importorskip("torch")

inf, nan = np.inf, np.nan


def same(got, want):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=0, equal_nan=True)


def check(f, x):
    """``f(M, x)``'s value and gradient, eager and traced, against torch's."""
    xt = torch.tensor(x, requires_grad=True)
    yt = f(torch, xt)
    gt, = torch.autograd.grad(yt.sum(), xt)
    xe = tg.tensor(x, requires_grad=True)
    ye = f(tg, xe)
    ge, = tg.autograd.grad(ye.sum(), xe)
    same(ye.detach().numpy(), yt.detach().numpy())
    same(ge.numpy(), gt.numpy())
    P = tg.trace(lambda a: f(tg, a), np.ones_like(x))
    same(P(x), yt.detach().numpy())
    P = tg.trace(lambda a: f(tg, a).sum(), np.ones_like(x))
    same(P.grad(x), gt.numpy())


#: rows with +inf among large finite elements (their exps overflowed in the traced rows:
#: gradient NaN where torch's exp(x - inf) is 0), -inf, all -inf, NaN, the largest double
LSE_ROWS = [[1e160, -1e160, 5e159, inf], [1e308, -1e308, 5e307, inf], [1.0, -1.0, 0.5, inf],
            [inf, -inf], [inf, inf], [-inf, -inf], [-inf, 2.0], [nan, 1.0], [inf, nan, -inf],
            [np.finfo(np.float64).max, inf], [-inf], [inf], [nan], [1.0, 2.0, 3.0]]


@pytest.mark.parametrize("row", LSE_ROWS, ids=str)
def test_logsumexp_at_nonfinite_rows_matches_torch(row):
    check(lambda M, a: M.logsumexp(a, 0), np.array(row))


def test_logsumexp_rows_at_nonfinite_elements_match_torch():
    x = np.array([[1e300, 2e300, inf], [1.0, -inf, 3.0], [-inf, -inf, -inf], [nan, 2.0, inf]])
    check(lambda M, a: M.logsumexp(a, 1) * 3.0, x)
    check(lambda M, a: M.logsumexp(a, (0, 1), keepdim=True), x[:2])


#: a row with +inf: torch's softmax and log_softmax shift by the max itself, NaN throughout
#: (inf - inf); shifting by 0 there gave 0 and -inf at the finite elements, eager and traced
SOFTMAX_ROWS = [[1.0, -1.0, 0.5, inf], [inf, 1.0], [inf, inf], [inf, -inf], [-inf, -inf],
                [-inf, 2.0], [nan, 1.0], [1e308, -1e308, 5e307], [inf], [-inf], [0.5, 2.0]]


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
@pytest.mark.parametrize("row", SOFTMAX_ROWS, ids=str)
def test_softmax_at_nonfinite_rows_matches_torch(name, row):
    w = np.linspace(0.3, 1.7, len(row))
    check(lambda M, a: getattr(M, name)(a, 0) * (torch.tensor(w) if M is torch else w),
          np.array(row))


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax_rows_with_an_inf_match_torch(name):
    x = np.array([[1.0, inf, 3.0], [1.0, 2.0, 3.0], [-inf, -inf, 0.0]])
    w = np.arange(9.0).reshape(3, 3)
    check(lambda M, a: getattr(M, name)(a, 1) * (torch.tensor(w) if M is torch else w), x)
    check(lambda M, a: getattr(M, name)(a, 0) * (torch.tensor(w) if M is torch else w), x.T.copy())


def exact(got, want):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


#: torch's relu and clamp are max(a, lo) and min(., hi) that keep a where it equals the
#: bound: relu(-0.0) and clamp(-0.0, min=0.0) are -0.0, and 1 / them -inf (relu gave 0.0
#: on every path, clamp on eager arrays through np.maximum: +inf)
ZERO_PROGRAMS = {
    "relu": lambda M, a: 1.0 / M.relu(a),
    "clamp_min": lambda M, a: 1.0 / M.clamp(a, min=0.0),
    "clamp_max": lambda M, a: 1.0 / M.clamp(a, max=0.0),
    "clamp_both": lambda M, a: 1.0 / M.clamp(a, min=0.0, max=0.0),
    "clamp_min_neg_zero": lambda M, a: 1.0 / M.clamp(a, min=-0.0),
    "clamp_crossed": lambda M, a: M.clamp(a, min=3.0, max=1.0),
}


@pytest.mark.parametrize("name", list(ZERO_PROGRAMS))
@pytest.mark.parametrize("n", [0, 1, 20])
def test_relu_and_clamp_keep_a_signed_zero_as_torch(name, n):
    f = ZERO_PROGRAMS[name]
    x = np.array([-0.0, 0.0, nan, -2.0, 2.0, inf, -inf])
    x = x if n == 0 else np.repeat(x, n)
    want = f(torch, torch.tensor(x)).numpy()
    for k in range(x.size if n == 0 else 1):  # 0-d tensors, then whole arrays
        xs = x[k] if n == 0 else x
        w = want[k] if n == 0 else want
        exact(f(tg, tg.tensor(xs)).numpy(), w)
        exact(tg.trace(lambda a: f(tg, a), np.ones_like(xs) * 0.5)(xs), w)


@pytest.mark.parametrize("name", ["relu", "clamp_min"])
def test_relu_and_clamp_gradient_at_signed_zeros_as_torch(name):
    f = {"relu": lambda M, a: M.relu(a), "clamp_min": lambda M, a: M.clamp(a, min=0.0)}[name]
    x = np.array([-0.0, 0.0, nan, -2.0, 2.0])
    xt = torch.tensor(x, requires_grad=True)
    want, = torch.autograd.grad(f(torch, xt).sum(), xt)
    xe = tg.tensor(x, requires_grad=True)
    got, = tg.autograd.grad(f(tg, xe).sum(), xe)
    exact(got.numpy(), want.numpy())
    exact(tg.trace(lambda a: f(tg, a).sum(), np.ones(5)).grad(x), want.numpy())


#: a sum starts from 0.0 in torch and NumPy: terms all -0.0 sum to 0.0; the traced rows'
#: tree of adds (or one term alone) gave -0.0, and 1 / sum -inf where torch's is inf
SUM_PROGRAMS = {
    "sum": lambda M, a: 1.0 / a.sum(),
    "sum_dim": lambda M, a: 1.0 / a.reshape(2, -1).sum(1),
    "sum_dim0_keep": lambda M, a: 1.0 / a.reshape(2, -1).sum(0, keepdim=True),
    "mean": lambda M, a: 1.0 / a.mean(),
    "mean_dim": lambda M, a: 1.0 / a.reshape(2, -1).mean(1),
}


@pytest.mark.parametrize("name", list(SUM_PROGRAMS))
@pytest.mark.parametrize("n", [2, 6, 40])
def test_a_sum_of_negative_zeros_is_zero_as_torch(name, n):
    f = SUM_PROGRAMS[name]
    x = np.full(n, -0.0)
    want = f(torch, torch.tensor(x)).numpy()
    exact(f(tg, tg.tensor(x)).numpy(), want)
    exact(tg.trace(lambda a: f(tg, a), np.ones(n))(x), want)
    y = np.linspace(-1.0, 2.0, n)  # and the same gradient elsewhere
    yt = torch.tensor(y, requires_grad=True)
    g, = torch.autograd.grad(f(torch, yt).sum(), yt)
    np.testing.assert_allclose(tg.trace(lambda a: f(tg, a).sum(), np.ones(n)).grad(y),
                               g.numpy(), rtol=1e-13)


@pytest.mark.parametrize("bound", ["min", "max"])
@pytest.mark.parametrize("n", [0, 1, 20])
def test_clamp_at_a_nan_tensor_bound_is_nan_as_torch(bound, n):
    # torch's bound tensor goes through max/min, which propagate its NaN; the rows kept a
    a = np.array([0.0, -1.0, 2.0, inf, nan, 1.0])
    b = np.array([nan, nan, nan, nan, nan, 0.5])
    if n:
        a, b = np.repeat(a, n), np.repeat(b, n)
    w = np.linspace(0.5, 1.5, a.size)

    def f(M, x, y):
        return M.clamp(x, **{bound: y})
    at, bt = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    yt = f(torch, at, bt)
    want = (yt.detach().numpy(),) + torch.autograd.grad((yt * torch.tensor(w)).sum(), (at, bt))
    want = [v if isinstance(v, np.ndarray) else v.numpy() for v in want]
    if n == 0:  # 0-d tensors, one by one
        for i in range(a.size):
            x, y = tg.tensor(a[i], requires_grad=True), tg.tensor(b[i], requires_grad=True)
            v = f(tg, x, y)
            gx, gy = tg.autograd.grad(v * w[i], (x, y))
            same([v.detach().numpy(), gx.numpy(), gy.numpy()], [u[i] for u in want])
        return
    x, y = tg.tensor(a, requires_grad=True), tg.tensor(b, requires_grad=True)
    v = f(tg, x, y)
    gx, gy = tg.autograd.grad((v * w).sum(), (x, y))
    same([v.detach().numpy(), gx.numpy(), gy.numpy()], want)
    P = tg.trace(lambda x, y: (f(tg, x, y) * w).sum(), np.ones(a.size), np.zeros(a.size))
    same(tg.trace(lambda x, y: f(tg, x, y), np.ones(a.size), np.zeros(a.size))(a, b), want[0])
    same(P.grad(a, b), want[1:])


@pytest.mark.parametrize("n", [0, 6])
def test_clamp_between_equal_tensor_bounds_gives_min_no_gradient_as_torch(n):
    # torch's min takes a gradient only where min < max; clamp(x, min=t, max=t) below t
    # gave it to t (the composed clamp_min then clamp_max)
    X = [0.0, 3.0, 1.0, 0.5, 0.0, nan]
    LO, HI = [1.0, 1.0, 1.0, 0.0, 2.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    w = np.arange(1.0, 7.0)

    def f(M, x, lo, hi):
        return M.clamp(x, min=lo, max=hi)
    args = [torch.tensor(v, requires_grad=True) for v in (X, LO, HI)]
    yt = f(torch, *args)
    want = [yt.detach().numpy()] + [g.numpy() for g in torch.autograd.grad(
        (yt * torch.tensor(w)).sum(), args)]
    if n == 0:
        for i in range(6):
            a = [tg.tensor(v[i], requires_grad=True) for v in (X, LO, HI)]
            y = f(tg, *a)
            same([y.detach().numpy()] + [g.numpy() for g in tg.autograd.grad(y * w[i], a)],
                 [u[i] for u in want])
        return
    a = [tg.tensor(v, requires_grad=True) for v in (X, LO, HI)]
    y = f(tg, *a)
    same([y.detach().numpy()] + [g.numpy() for g in tg.autograd.grad((y * w).sum(), a)], want)
    P = tg.trace(lambda x, lo, hi: (f(tg, x, lo, hi) * w).sum(), np.full(6, 0.3), np.zeros(6),
                 np.ones(6))
    same(P.grad(*map(np.array, (X, LO, HI))), want[1:])
