"""A program's derivative rows read ``x`` where eager mode records ``x ** 1.0`` (x ** 2's rule,
``2 * x ** 1``, kept a graph as torch's for its third derivative): the same values, bit for
bit, and no row."""
import numpy as np
import pytest

import tapegrad as tg

torch = pytest.importorskip("torch")


def _f(M, x):
    s = 0.0
    for i in range(x.shape[0] - 1):
        s = s + 100.0 * (x[i + 1] - x[i] ** 2) ** 2 + (1.0 - x[i]) ** 2
    return s


X = [np.linspace(-1.5, 2.0, 6),
     np.array([0.0, -0.0, 1e200, -1e-310, 3.0, -2.0]),
     np.array([np.inf, 1.0, -0.0, np.nan, 2.0, 0.5])]


def _powc_ones(prog):
    rows = prog._code.rows
    return int(((rows[:, 0] == tg.ops.BY_NAME["powc"].code) & (rows[:, 4] == 1.0)).sum())


@pytest.mark.parametrize("x", X, ids=["plain", "zeros_huge_tiny", "inf_nan"])
def test_derivative_programs_of_squares_read_x_itself(x):
    P = tg.trace(lambda x: _f(tg, x), np.linspace(0.1, 0.6, 6))
    G = P.grad_program()
    assert _powc_ones(G) == 0
    v = np.linspace(0.5, 1.5, 6)
    g, (val, hv) = P.grad(x), P.hvp((x,), (v,))
    np.testing.assert_array_equal(np.asarray(val).ravel(), np.asarray(P(x)).ravel())
    # eager tapegrad records x ** 1.0 and its rule: the same bits
    xe = tg.tensor(x, requires_grad=True)
    ge, = tg.autograd.grad(_f(tg, xe), xe, create_graph=True)
    he, = tg.autograd.grad(ge, xe, grad_outputs=tg.tensor(v))
    gp = np.asarray(G(x))
    ok = ~np.isnan(g)  # (a NaN's sign differs between the two paths, as before)
    assert gp[ok].tobytes() == g[ok].tobytes() and np.isnan(gp[~ok]).all()
    np.testing.assert_array_equal(g, ge.detach().numpy())
    np.testing.assert_array_equal(hv, he.numpy())
    xt = torch.tensor(x, requires_grad=True)
    gt, = torch.autograd.grad(_f(torch, xt), xt, create_graph=True)
    ht, = torch.autograd.grad(gt, xt, grad_outputs=torch.tensor(v))
    np.testing.assert_allclose(g, gt.detach().numpy(), rtol=1e-13, atol=0)
    np.testing.assert_allclose(hv, ht.numpy(), rtol=1e-13, atol=0)


def test_third_derivative_of_a_square_is_zero_in_a_program():
    """The eager graph's reason for x ** 1 (torch: the third derivative of x ** 2 is 0, not
    an error) holds in a program as values: the hvp of the gradient's first coordinate."""
    P = tg.trace(lambda x: (x[0] ** 2) * 1.0, np.array([3.0]))
    G = P.grad_program()
    H = G.grad_program()
    x = np.array([-0.0])
    assert np.asarray(G(x)).ravel().tolist() == [-0.0]
    assert np.asarray(H(x)).ravel().tolist() == [2.0]
    assert np.asarray(H.grad_program()(x)).ravel().tolist() == [0.0]
