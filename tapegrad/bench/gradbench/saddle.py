"""saddle: min over x of max over y of f(x, y) = |x|^2 - |y|^2 by the eval's gradient
descent, nested: the outer gradient differentiates through every step of the inner ascent
(its gradients taken with create_graph). Returns x and then y = argmax f(x, .).

All four variants (ff, fr, rf, rr) run reverse over reverse (see particle)."""
from ._common import check, T, argmax, argmin, as_list, host, leaf


def f(M, p1, p2):
    return (p1[0] * p1[0] + p1[1] * p1[1]) - (p2[0] * p2[0] + p2[1] * p2[1])


def inner_max(M, p1, start, create_graph):
    """max over p2 of f(p1, p2) from ``start``, as a tensor that keeps its graph to p1."""
    def gradient(p2):
        p2 = p2 if p2.requires_grad else p2.detach().requires_grad_()
        return M.autograd.grad(f(M, p1, p2), (p2,), create_graph=create_graph)[0]
    p2 = argmax(lambda p2: f(M, p1, p2), gradient, T(M, start))
    return f(M, p1, p2)


def solve(M, start):
    def objective(p1):
        return inner_max(M, p1.detach(), start, False).detach()

    def gradient(p1):
        p = leaf(M, host(p1))
        return M.autograd.grad(inner_max(M, p, start, True), (p,))[0]
    x = argmin(objective, gradient, T(M, start))

    def inner_grad(p2):
        p2 = leaf(M, host(p2))
        return M.autograd.grad(f(M, x, p2), (p2,))[0]
    y = argmax(lambda p2: f(M, x, p2), inner_grad, T(M, start))
    return M.cat([x.detach(), y.detach()])


def prepare(function, input, M, trace):
    check('saddle', function, ('ff', 'fr', 'rf', 'rr'))
    start = [float(v) for v in input["start"]]
    return (lambda: solve(M, start)), as_list
