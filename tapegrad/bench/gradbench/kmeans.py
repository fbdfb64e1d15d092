"""kmeans: cost sum_i min_j |C_j - P_i|^2, and the Newton direction J / diag(H) (the
Hessian in C is diagonal, so H @ ones is its diagonal: one Hessian-vector product)."""
import numpy as np

from ._common import check, T, as_float, as_list, grad, leaf, trace as _trace


def cost(M, C, PT):
    """``PT``: the points as the columns of a (d, n) matrix. The differences are laid out
    (k, d, n), the points on the last axis, so every broadcast (of a centroid over the
    points, of a distance's gradient over the coordinates) runs along whole rows of n, in
    both libraries."""
    diff = PT[None, :, :] - C[:, :, None]
    return M.sum(M.min(M.sum(diff * diff, 1), 0).values)


def prepare(function, input, M, trace):
    check('kmeans', function, ('cost', 'dir'))
    PT0 = np.ascontiguousarray(np.asarray(input["points"], dtype=np.float64).T)
    C0 = np.asarray(input["centroids"], dtype=np.float64)
    if trace:
        import tapegrad
        Pt = T(tapegrad, PT0)
        prog = _trace(lambda C: cost(tapegrad, C, Pt), C0)
        if function == "cost":
            return (lambda: prog(C0)), as_float
        ones = np.ones_like(C0)

        def direction_replay():  # (the gradient and H v of one run: one forward)
            _, J, H = prog.grad_and_hvp((C0,), (ones,))
            return J / H
        return direction_replay, as_list
    P = T(M, PT0)
    if function == "cost":
        C = T(M, C0)
        return (lambda: cost(M, C, P)), as_float

    def direction():
        C = leaf(M, C0)
        J = grad(M, cost(M, C, P), (C,), create_graph=True)[0]
        H = grad(M, J, (C,), grad_outputs=(M.ones_like(J),))[0]
        return J.detach() / H
    return direction, as_list
