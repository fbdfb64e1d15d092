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
