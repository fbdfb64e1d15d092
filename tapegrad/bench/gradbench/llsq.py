"""llsq: 1/2 sum_i (s_i - sum_j x_j t_i^j)^2 with t_i = -1 + 2i/(n-1) and s_i = sign(t_i)."""
import numpy as np

from ._common import check, T, as_float, as_list, grad, leaf, trace as _trace


def design(n, m):
    """(powers of t as an n x m matrix, s): constants, built by repeated products as the
    eval's reference does."""
    t = -1 + np.arange(n, dtype=np.float64) * 2 / (n - 1)
    P = np.ones((n, m))
    for j in range(1, m):
        P[:, j] = P[:, j - 1] * t
    return P, np.sign(t)


def primal(M, x, P, s):
    r = s - M.matmul(P, x)
    return M.sum(r * r) / 2


def prepare(function, input, M, trace):
    check('llsq', function, ('primal', 'gradient'))
    x0 = np.asarray(input["x"], dtype=np.float64)
    P, s = design(int(input["n"]), len(x0))
    if trace:
        import tapegrad
        Pt, st = T(tapegrad, P), T(tapegrad, s)
        prog = _trace(lambda x: primal(tapegrad, x, Pt, st), x0)
        if function == "primal":
            return (lambda: prog(x0)), as_float
        return (lambda: prog.grad(x0)), as_list
    Pt, st = T(M, P), T(M, s)
    if function == "primal":
        x = leaf(M, x0)
        return (lambda: primal(M, x, Pt, st)), as_float

    def gradient():
        x = leaf(M, x0)
        return grad(M, primal(M, x, Pt, st), (x,))[0]
    return gradient, as_list
