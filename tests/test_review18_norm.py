"""A norm over one element is its absolute value, as torch's: x * x overflowed at 1e200
(inf, gradient 0) and underflowed at 1e-310 (0), eager and traced; its gradient at a
subnormal is torch's grad * (x / norm) (x * (grad / norm) overflowed to inf)."""
import numpy as np
import pytest

import tapegrad as tg

torch = pytest.importorskip("torch")

X = np.array([[1e200], [3.0], [-1e-310], [0.0], [-7.3], [-1e200]])
CASES = [(p, dim) for p in (2.0, "fro", 1.0, 3.0, 0.5, float("inf")) for dim in (1, (1,), None)]


def _norms(M, x, p, dim):
    if dim is None:  # every row alone: a norm over all of a one-element tensor
        return M.stack([M.norm(x[i], p=p) for i in range(x.shape[0])])
    return M.norm(x, p=p, dim=dim)


@pytest.mark.parametrize("p,dim", CASES)
def test_eager_values_and_gradients_match_torch(p, dim):
    res = []
    for M in (tg, torch):
        x = M.tensor(X, dtype=M.float64, requires_grad=True)
        n = _norms(M, x, p, dim)
        g, = M.autograd.grad(n.sum(), x)
        res.append((n.detach().numpy(), g.numpy()))
    np.testing.assert_array_equal(res[0][0], res[1][0])
    ok = np.isfinite(res[1][1])  # (torch's NaN at 1e200 for p = 3: inf / inf)
    np.testing.assert_allclose(res[0][1][ok], res[1][1][ok], rtol=1e-15)


@pytest.mark.parametrize("p", [2.0, 3.0, 1.0])
def test_traced_values_and_gradients_match_torch(p):
    def f(M, x):
        return (M.norm(x, p=p, dim=1) * M.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
                                                  dtype=M.float64)).sum() + M.norm(x[2], p=p)
    P = tg.trace(lambda x: f(tg, x), np.ones_like(X))
    xt = torch.tensor(X, requires_grad=True)
    want_v = f(torch, xt)
    want_g, = torch.autograd.grad(want_v, xt)
    v, g = P.value_and_grad(X)
    assert v == want_v.item()
    ok = np.isfinite(want_g.numpy())
    np.testing.assert_allclose(g[ok], want_g.numpy()[ok], rtol=1e-15)
    vb, gb = P.value_and_grad(np.stack([X, -X]))
    assert vb[0] == want_v.item() and vb[1] == want_v.item()
    np.testing.assert_allclose(gb[0][ok], want_g.numpy()[ok], rtol=1e-15)
