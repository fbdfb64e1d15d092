"""Helpers shared by the eval modules: tensors of float64 under either module, gradients,
JSON conversion, and the gradient-descent solver that particle and saddle specify."""
import warnings

import numpy as np


def T(M, data, requires_grad=False):
    """A float64 tensor of ``data`` under module ``M`` (torch defaults to float32)."""
    return M.tensor(np.asarray(data, dtype=np.float64), dtype=M.float64,
                    requires_grad=requires_grad)


def leaf(M, data):
    return T(M, data, requires_grad=True)


def grad(M, out, inputs, create_graph=False, grad_outputs=None, retain_graph=None):
    return M.autograd.grad(out, inputs, grad_outputs=grad_outputs, create_graph=create_graph,
                           retain_graph=retain_graph)


def host(t):
    """A NumPy array (or float) of a tensor, array or number."""
    if hasattr(t, "detach"):
        t = t.detach().numpy()
    return np.asarray(t, dtype=np.float64)


def as_list(t):
    return host(t).tolist()


def as_float(t):
    return float(host(t))


def trace(fn, *inputs):
    """A traced tapegrad Program of ``fn`` at ``inputs`` (imported lazily: eager runs never
    pay for the replay machinery)."""
    import tapegrad
    with warnings.catch_warnings():  # a value read while tracing (a branch on a rotation
        # angle) is guarded at replay: the warning says so, the tool knows
        warnings.simplefilter("ignore", tapegrad.TraceWarning)
        return tapegrad.trace(fn, *[np.asarray(x, dtype=np.float64) for x in inputs])


def check(module, function, names):
    if function not in names:
        raise ValueError(f"{module} has functions {', '.join(names)}, not {function!r}")


def norm(v):
    return float(np.sqrt(np.sum(host(v) ** 2)))


def argmin(objective, gradient, x):
    """GradBench's gradient-descent argmin (the eval's C++ ``multivariate_argmin``): steps
    of ``eta`` from 1e-5, doubled after 10 accepted steps in a row and halved on a step
    that does not decrease; stops when the gradient or the step is under 1e-5. ``x`` and
    what the callbacks return may be tensors that carry a graph (nested AD): only their
    values steer the loop."""
    fx = objective(x)
    gx = gradient(x)
    i, eta = 0, 1e-5
    while True:
        if norm(gx) <= 1e-5:
            return x
        if i == 10:
            eta *= 2
            i = 0
            continue
        xp = x - eta * gx
        if norm(host(x) - host(xp)) <= 1e-5:
            return x
        fxp = objective(xp)
        if as_float(fxp) < as_float(fx):
            x, fx = xp, fxp
            gx = gradient(x)
            i += 1
        else:
            eta /= 2
            i = 0


def argmax(objective, gradient, x):
    return argmin(lambda z: -objective(z), lambda z: -gradient(z), x)
