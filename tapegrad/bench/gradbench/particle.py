"""particle: the control w that makes a charged particle, pushed by two fixed charges at
(10, 10 - w) and (10, 0), cross the x-axis at the origin. Euler steps of 0.1 integrate the
path, the force being minus the gradient of the potential in x (taken with create_graph so
that the outer gradient in w differentiates through it: nested reverse mode), and the
eval's gradient descent finds w.

All four variants (ff, fr, rf, rr) run reverse over reverse: tapegrad has no forward mode
of its own, and they must give the same result.
"""
from ._common import check, argmin, as_float, host, leaf


def potential(M, x, charges):
    total = 0.0
    for cx, cy in charges:
        total = total + 1 / M.sqrt((cx - x[0]) ** 2 + (cy - x[1]) ** 2)
    return total


def naive_euler(M, w, create_graph=True):
    charges = [(10.0, 10.0 - w), (10.0, 0.0)]
    x = [0.0 * w, 0.0 * w + 8.0]
    xdot = [0.0 * w + 0.75, 0.0 * w]
    dt = 0.1
    while True:
        # x depends on w (from 0 * w on): the force keeps its graph to w
        gx = M.autograd.grad(potential(M, x, charges), x, create_graph=create_graph)
        xddot = [-g for g in gx]
        x = [x[0] + dt * xdot[0], x[1] + dt * xdot[1]]
        if float(host(x[1])) <= 0:
            dt_f = -x[1] / xdot[1]
            x_tf = x[0] + dt_f * xdot[0]
            return x_tf * x_tf
        xdot = [xdot[0] + dt * xddot[0], xdot[1] + dt * xddot[1]]


def solve(M, w0):
    def objective(w):
        # the value alone: the force needs no graph to w
        return naive_euler(M, leaf(M, float(host(w))), False).detach()

    def gradient(w):
        wt = leaf(M, float(host(w)))
        return M.autograd.grad(naive_euler(M, wt), (wt,))[0]
    return argmin(objective, gradient, leaf(M, w0).detach())


def prepare(function, input, M, trace):
    check('particle', function, ('ff', 'fr', 'rf', 'rr'))
    w0 = float(input["w"])
    return (lambda: solve(M, w0)), as_float
