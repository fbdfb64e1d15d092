"""det: the determinant by expansion along the first row of each minor (every term a scalar
operation; the eval's point is the count of floating-point operations)."""
import numpy as np

from ._common import check, as_float, as_list, grad, leaf, trace as _trace


def det_minor(a, n, rows, cols):
    """Determinant of the minor of ``a`` (n * n scalars, row-major) on ``rows`` x ``cols``."""
    if len(rows) == 1:
        return a[rows[0] * n + cols[0]]
    r0, sub = rows[0], rows[1:]
    det, sign = 0.0, 1
    for j, c in enumerate(cols):
        term = a[r0 * n + c] * det_minor(a, n, sub, cols[:j] + cols[j + 1:])
        det = det + term if sign > 0 else det - term
        sign = -sign
    return det


def det(A, ell):
    a = [A[i] for i in range(ell * ell)]
    return det_minor(a, ell, list(range(ell)), list(range(ell)))


def prepare(function, input, M, trace):
    check('det', function, ('primal', 'gradient'))
    A0, ell = np.asarray(input["A"], dtype=np.float64), int(input["ell"])
    if trace:
        prog = _trace(lambda A: det(A, ell), A0)
        if function == "primal":
            return (lambda: prog(A0)), as_float
        return (lambda: prog.grad(A0)), as_list
    if function == "primal":
        A = leaf(M, A0)
        return (lambda: det(A, ell)), as_float

    def gradient():
        A = leaf(M, A0)
        return grad(M, det(A, ell), (A,))[0]
    return gradient, as_list
