"""lse: LogSumExp from its primitives (max, then the shifted sum) and its gradient."""
import numpy as np

from ._common import check, as_float, as_list, grad, leaf, trace as _trace


def lse(M, x):
    a = M.max(x)
    return a + M.log(M.sum(M.exp(x - a)))


def prepare(function, input, M, trace):
    check('lse', function, ('primal', 'gradient'))
    x0 = np.asarray(input["x"], dtype=np.float64)
    if trace:
        import tapegrad
        prog = _trace(lambda x: lse(tapegrad, x), x0)
        if function == "primal":
            return (lambda: prog(x0)), as_float
        return (lambda: prog.grad(x0)), as_list
    if function == "primal":
        x = leaf(M, x0)
        return (lambda: lse(M, x)), as_float

    def gradient():
        x = leaf(M, x0)
        return grad(M, lse(M, x), (x,))[0]
    return gradient, as_list
