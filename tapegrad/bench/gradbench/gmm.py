"""gmm: log posterior of a Gaussian mixture with a Wishart prior on the precisions (the
eval's simplified form: Q from exp(q) on the diagonal and l below it, column by column)."""
import math

import numpy as np

from ._common import check, T, as_float, host, leaf, trace as _trace

PARAMS = ("alpha", "mu", "q", "l")


def multigammaln(a, p):
    """log of the multivariate gamma function Gamma_p(a) (a constant here)."""
    return p * (p - 1) / 4 * math.log(math.pi) + sum(math.lgamma(a + (1 - j) / 2)
                                                       for j in range(1, p + 1))


def lower_index(d):
    """For each of the d * d entries of Q (row-major): 0, or 1 + the index into l of the
    strictly-lower entry it holds (l fills Q column by column)."""
    idx = np.zeros((d, d), dtype=np.int64)
    k = 1
    for j in range(d):
        for i in range(j + 1, d):
            idx[i, j] = k
            k += 1
    return idx.reshape(-1)


def objective(M, alpha, mu, q, l, xT, m, gamma):
    """``xT``: the points as the columns of a (d, n) matrix. The work is laid out (k, d, n),
    the points on the last axis: one (d, d) @ (d, n) product per component, and every
    broadcast (of a centre over the points, of a point's sum over the coordinates) runs
    along whole rows of n, in both libraries."""
    d, n = xT.shape
    k = mu.shape[0]
    lpad = M.cat([M.zeros((k, 1), dtype=M.float64), l], 1)
    Q = (lpad[:, lower_index(d)].reshape(k, d, d)
         + M.exp(q)[:, :, None] * M.eye(d, dtype=M.float64))
    xc = xT[None, :, :] - mu[:, :, None]                      # (k, d, n)
    Qxc = M.matmul(Q, xc)                                      # (k, d, n)
    beta = (alpha + M.sum(q, 1))[:, None] - 0.5 * M.sum(Qxc * Qxc, 1)  # (k, n)
    loglik = (-n * (d / 2 * math.log(2 * math.pi) + M.logsumexp(alpha, 0))
              + M.sum(M.logsumexp(beta, 0)))
    dof = d + m + 1
    frob = M.sum(M.exp(q) ** 2) + M.sum(l * l)
    prior = (k * (dof * d * math.log(gamma / math.sqrt(2)) - multigammaln(dof / 2, d))
             - gamma * gamma / 2 * frob + m * M.sum(q))
    return loglik + prior


def _inputs(input):
    d, k = int(input["d"]), int(input["k"])
    arrays = [np.asarray(input["alpha"], dtype=np.float64),
              np.asarray(input["mu"], dtype=np.float64).reshape(k, d),
              np.asarray(input["q"], dtype=np.float64).reshape(k, d),
              np.asarray(input["l"], dtype=np.float64).reshape(k, d * (d - 1) // 2)]
    xT = np.ascontiguousarray(np.asarray(input["x"], dtype=np.float64).reshape(-1, d).T)
    return arrays, xT, int(input["m"]), float(input["gamma"])


def _post_grad(gs):
    return {name: host(g).tolist() for name, g in zip(PARAMS, gs)}


def prepare(function, input, M, trace):
    check('gmm', function, ('objective', 'jacobian'))
    arrays, xT, m, gamma = _inputs(input)
    if trace:
        import tapegrad
        xt = T(tapegrad, xT)
        prog = _trace(lambda *p: objective(tapegrad, *p, xt, m, gamma), *arrays)
        if function == "objective":
            return (lambda: prog(*arrays)), as_float
        return (lambda: prog.grad(*arrays)), _post_grad
    xt = T(M, xT)
    if function == "objective":
        ps = [T(M, a) for a in arrays]
        return (lambda: objective(M, *ps, xt, m, gamma)), as_float

    def jacobian():
        ps = [leaf(M, a) for a in arrays]
        return M.autograd.grad(objective(M, *ps, xt, m, gamma), ps)
    return jacobian, _post_grad
