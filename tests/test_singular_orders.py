"""Derivatives of several orders at singular points (0, -0.0) against torch: inf where torch
gives inf, not nan from a 0 * inf inside a rule (the rules of div and c / x are torch's)."""
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
