"""Derivatives of several orders at singular points (0, -0.0) against torch: inf where torch
gives inf, not nan from a 0 * inf inside a rule (the rules of div and c / x are torch's)."""
import contextlib
import math

import numpy as np
import pytest

import tapegrad

torch = pytest.importorskip("torch")

CASES = [("1 / x", lambda M, x: 1.0 / x, [0.0, -0.0, 2.0, -3.0]),
         ("3 / x", lambda M, x: 3.0 / x, [0.0, -0.0, 0.5]),
         ("x / y", lambda M, x: x[:2] / x[2:], [1.0, -2.0, 0.0, -0.0]),
         ("sqrt", lambda M, x: M.sqrt(x), [0.0, 1.0, 4.0]),
         ("log", lambda M, x: M.log(x), [0.0, 1.0, 0.5]),
         ("reciprocal", lambda M, x: M.reciprocal(x), [0.0, -0.0, 2.0]),
         ("x ** -1", lambda M, x: x ** -1.0, [0.0, 2.0])]


def _orders(M, f, xv, n=3):
    x = M.tensor(xv, dtype=M.float64, requires_grad=True)
    g, out = f(M, x).sum(), []
    for _ in range(n):
        (g,) = M.autograd.grad(g.sum(), x, create_graph=True)
        out.append(g.detach().numpy().copy())
    return out


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_orders_at_singular_points_against_torch(name):
    _, f, xv = next(c for c in CASES if c[0] == name)
    for a, b in zip(_orders(tapegrad, f, xv), _orders(torch, f, xv)):
        np.testing.assert_allclose(a, b, rtol=1e-14)  # inf and its sign, nan where torch's
        signs = [[math.copysign(1, v) for v in r if not math.isnan(v)] for r in (a, b)]
        assert signs[0] == signs[1]  # -0.0 and -inf as torch's (a nan's sign bit is noise)


def test_atan2_at_the_origin_second_order_against_torch():
    """atan2(c, c) * x with c zeroed where x > 0: the Hessian there is 0 (torch's); the
    origin's branch of atan2's rule once divided 0 by 0, and the next order got 0 * nan."""
    res = []
    for M in (tapegrad, torch):
        x = M.tensor([0.5, -1.0, 2.0], dtype=M.float64, requires_grad=True)
        c = x.clone()
        c[x > 0] = 0.0
        (g,) = M.autograd.grad((M.atan2(c, c) * x).sum(), x, create_graph=True)
        (h,) = M.autograd.grad(g.sum(), x)
        a = M.tensor([0.0, 1.0], dtype=M.float64, requires_grad=True)
        b = M.tensor([0.0, 2.0], dtype=M.float64, requires_grad=True)
        ga, gb = M.autograd.grad(M.atan2(a, b).sum(), (a, b), create_graph=True)
        hs = M.autograd.grad((ga * ga + gb).sum(), (a, b))
        res.append([t.detach().numpy() for t in (g, h, ga, gb, *hs)])
    for p, q in zip(*res):
        np.testing.assert_allclose(p, q, rtol=1e-14)


def _bits(v):
    """Values with the sign of their zeros and infinities (a nan's sign bit is noise)."""
    return [(float(x), math.copysign(1.0, x)) for x in np.ravel(v) if not math.isnan(x)]


@pytest.mark.parametrize("e", [0.5, -0.5, 1.5, 3.0, -2.0, -1.0, 2.0])
def test_pow_of_a_constant_at_negative_zero_against_torch(e):
    # torch computes x ** 0.5 as sqrt and x ** -0.5 as rsqrt: at -0.0, -0.0 and -inf where
    # pow gives 0.0 and inf (tapegrad gave +inf for (-0.0) ** -0.5); its derivative is
    # e * x ** (e - 1) with the same special cases
    res = []
    for M in (tapegrad, torch):
        x = M.tensor([-0.0, 0.0, 4.0, 0.3], dtype=M.float64, requires_grad=True)
        y = x ** e
        (g,) = M.autograd.grad(y.sum(), x)
        s = M.tensor(-0.0, dtype=M.float64, requires_grad=True)
        ys = s ** e
        (gs,) = M.autograd.grad(ys, s)
        res.append([y.detach().numpy(), g.numpy(), ys.item(), gs.item()])
    for i, (a, b) in enumerate(zip(*res)):
        np.testing.assert_allclose(a, b, rtol=1e-15)
        if i != 1:  # (an array's adjoint at -0.0: see docs/differences.md)
            assert _bits(a) == _bits(b)


def test_pow_of_a_constant_is_torchs_to_the_last_bit():
    # x ** 3 is x * x * x, x ** -2 is 1 / (x * x), x ** -0.5 is 1 / sqrt(x) in torch: pow
    # differs from them by an ulp on about a quarter of inputs
    v = np.random.default_rng(0).uniform(0.1, 10.0, 2000)
    for e in (3.0, -2.0, -0.5):
        a = (tapegrad.tensor(v) ** e).numpy()
        b = (torch.tensor(v) ** e).numpy()
        np.testing.assert_array_equal(a, b)
        for s in v[:50]:
            t = torch.tensor(s, dtype=torch.float64)
            assert (tapegrad.tensor(s) ** e).item() == (t ** e).item()


def test_a_negative_zero_seed_keeps_its_sign():
    # the 0-d adjoints started at +0.0, and 0.0 + -0.0 is +0.0: torch's -0.0 was lost
    from tapegrad.autograd import paths
    for path in ("sweep", "checked"):
        res = []
        for M in (tapegrad, torch):
            x = M.tensor(1.5, dtype=M.float64, requires_grad=True)
            go = M.tensor(-0.0, dtype=M.float64)
            ctx = paths.force(path) if M is tapegrad else contextlib.nullcontext()
            with ctx:
                (g,) = M.autograd.grad(x * 2.0, x, go)
            res.append(g.item())
        assert _bits(res[0]) == _bits(res[1]) == [(0.0, -1.0)], path


POW_ORDERS = {"x ** 2": lambda M, x: x ** 2, "x ** 2.0": lambda M, x: x ** 2.0,
              "x ** 3": lambda M, x: x ** 3.0, "square": lambda M, x: M.square(x),
              "x ** 1": lambda M, x: x ** 1.0, "x ** 0": lambda M, x: x ** 0.0,
              "x * x": lambda M, x: x * x, "clamp": lambda M, x: M.clamp(x, -1.0, 1.0),
              "abs": lambda M, x: M.abs(x), "2 * x": lambda M, x: 2.0 * x}


def _chain(M, f, v, n=5):
    """Successive create_graph derivatives until one does not require grad (torch's
    error then): the values, and whether each requires grad."""
    x = M.tensor(v, dtype=M.float64, requires_grad=True)
    y, out = f(M, x).sum(), []
    for _ in range(n):
        try:
            (y,) = M.autograd.grad(y, x, create_graph=True)
        except RuntimeError as e:
            assert "does not require grad" in str(e)
            out.append("raises")
            break
        z = y._is_zerotensor() if M is torch else False
        out.append((np.zeros(tuple(y.shape)) if z else y.detach().numpy()).tolist())
        out.append(y.requires_grad)
        y = y.sum()
    return out


@pytest.mark.parametrize("name", sorted(POW_ORDERS))
def test_derivative_orders_of_constant_chains_as_torch(name):
    # torch's d/dx x ** 2 is 2 * x ** 1, then 2 * x ** 0, still a graph, so a third
    # derivative is 0, where tapegrad's 2 * x said "does not require grad" an order early
    f = POW_ORDERS[name]
    for v in (0.7, [0.7, -1.5]):
        assert _chain(tapegrad, f, v) == _chain(torch, f, v)
