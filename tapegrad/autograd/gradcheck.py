"""``gradcheck`` and ``gradgradcheck``: analytical derivatives against central finite
differences, with torch's signatures and a report that says where they disagree."""
from __future__ import annotations

import warnings

import numpy as np

from ..tensor import Tensor, _plain, tensor
from ._engine import grad


class GradcheckError(RuntimeError):
    """Raised by gradcheck/gradgradcheck when analytical and numerical derivatives differ."""


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _differentiable(inputs):
    return [i for i, x in enumerate(inputs) if isinstance(x, Tensor) and x.requires_grad]


def _outputs(func, inputs):
    out = _as_tuple(func(*inputs))
    for i, o in enumerate(out):
        if not isinstance(o, Tensor):
            raise TypeError(f"gradcheck: output {i} of func is {type(o).__name__}, not a Tensor")
    return [o for o in out if o.dtype.is_floating_point]


def _numerical(func, inputs, i, eps):
    """d(outputs)/d(inputs[i]) by central differences: one (n_out, n_in) matrix per output."""
    x = inputs[i]
    data = np.asarray(x._d, dtype=np.float64)
    flat = data.reshape(-1).copy()
    cols = []
    for j in range(flat.size):
        vals = []
        for step in (eps, -eps):
            pert = flat.copy()
            pert[j] += step
            args = list(inputs)
            args[i] = tensor(pert.reshape(data.shape), dtype=x.dtype, requires_grad=True)
            vals.append([np.asarray(o._d, dtype=np.float64).reshape(-1)
                         for o in _outputs(func, args)])
        cols.append([(p - m) / (2 * eps) for p, m in zip(*vals)])
    n_out = len(cols[0]) if cols else len(_outputs(func, inputs))
    return [np.stack([c[k] for c in cols], axis=1) if cols else np.zeros((0, 0))
            for k in range(n_out)]


def _analytical(func, inputs, idx):
    """Rows of the Jacobians by one vjp per output element: {(out k, input i): matrix}."""
    outs = _outputs(func, inputs)
    jac = {}
    for k, o in enumerate(outs):
        n = o.numel()
        for i in idx:
            jac[k, i] = np.zeros((n, inputs[i].numel()))
        if not o.requires_grad:
            continue
        for r in range(n):
            seed = np.zeros(n)
            seed[r] = 1.0
            g = grad(o, [inputs[i] for i in idx],
                     grad_outputs=_plain(seed.reshape(o.shape).astype(o.dtype.np)
                                         if o.shape else float(seed[0])),
                     retain_graph=True, allow_unused=True)
            for i, gi in zip(idx, g):
                if gi is not None:
                    jac[k, i][r] = np.asarray(gi._d, dtype=np.float64).reshape(-1)
    return outs, jac


def gradcheck(func, inputs, *, eps=1e-6, atol=1e-5, rtol=1e-3, raise_exception=True,
              nondet_tol=0.0, check_undefined_grad=True, check_grad_dtypes=False,
              check_batched_grad=False, check_batched_forward_grad=False,
              check_forward_ad=False, check_backward_ad=True, fast_mode=False, masked=None):
    """Check ``func``'s gradients against finite differences (torch's signature).

    Returns True, or raises ``GradcheckError`` (returns False with
    ``raise_exception=False``) naming the output, input and entries that disagree.

    Examples
    --------
    >>> import tapegrad
    >>> x = tapegrad.tensor([0.3, 1.2], requires_grad=True)
    >>> tapegrad.autograd.gradcheck(lambda t: (t.sin() * t).sum(), (x,))
    True
    """
    if check_forward_ad or check_batched_forward_grad or check_batched_grad:
        raise NotImplementedError("gradcheck: forward-mode and batched checks are not "
                                  "available in tapegrad; use the default backward check")
    inputs = _as_tuple(inputs)
    idx = _differentiable(inputs)
    if not idx:
        raise ValueError("gradcheck expects at least one input tensor to require gradient, but "
                         "none of them have requires_grad=True.")
    for i in idx:
        if inputs[i].dtype.np != np.float64:
            warnings.warn(f"Input #{i} requires gradient and is not a double precision floating "
                          "point. This check will likely fail if all the inputs are not of "
                          "double precision floating point.", UserWarning, stacklevel=2)
    outs, jac = _analytical(func, inputs, idx)
    for i in idx:
        numeric = _numerical(func, inputs, i, eps)
        for k in range(len(outs)):
            a, n = jac[k, i], numeric[k]
            if a.shape != n.shape or not np.allclose(a, n, rtol=rtol, atol=atol,
                                                      equal_nan=True):
                msg = (f"Jacobian mismatch for output {k} with respect to input {i},\n"
                       f"numerical:{n}\nanalytical:{a}\n")
                if a.shape == n.shape:
                    bad = np.argwhere(~np.isclose(a, n, rtol=rtol, atol=atol, equal_nan=True))
                    r, c = bad[0]
                    msg += (f"first disagreement at d(output {k})[{r}] / d(input {i})[{c}]: "
                            f"analytical {float(a[r, c])!r}, numerical {float(n[r, c])!r}\n")
                if raise_exception:
                    raise GradcheckError(msg)
                return False
    return True


def gradgradcheck(func, inputs, grad_outputs=None, *, eps=1e-6, atol=1e-5, rtol=1e-3,
                  gen_non_contig_grad_outputs=False, raise_exception=True, nondet_tol=0.0,
                  check_undefined_grad=True, check_grad_dtypes=False, check_batched_grad=False,
                  check_fwd_over_rev=False, check_rev_over_rev=True, fast_mode=False,
                  masked=False):
    """Check second derivatives: gradcheck of the vjp of ``func`` (torch's signature)."""
    inputs = _as_tuple(inputs)
    idx = _differentiable(inputs)
    if grad_outputs is None:
        rng = np.random.default_rng(0)
        grad_outputs = tuple(
            tensor(rng.standard_normal(o.shape) if o.shape else float(rng.standard_normal()),
                   dtype=o.dtype, requires_grad=True)
            for o in _outputs(func, inputs))
    grad_outputs = _as_tuple(grad_outputs)
    n_in = len(inputs)

    def vjp(*args):
        xs, gos = args[:n_in], args[n_in:]
        outs = _outputs(func, xs)
        diff = [xs[i] for i in idx]
        gs = grad(outs, diff, grad_outputs=list(gos), create_graph=True, allow_unused=True)
        return tuple(g for g in gs if g is not None)

    return gradcheck(vjp, tuple(inputs) + tuple(grad_outputs), eps=eps, atol=atol, rtol=rtol,
                     raise_exception=raise_exception)
