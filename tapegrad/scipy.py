"""A traced :class:`~tapegrad.Program` as ``fun``/``jac``/``hessp`` for ``scipy.optimize``.

Needs scipy (``pip install tapegrad[scipy]``) for :func:`minimize` only; :func:`objective`
works without it.
"""
from __future__ import annotations

import numpy as np

__all__ = ["Objective", "objective", "minimize"]


class Objective:
    """The callables ``scipy.optimize.minimize`` takes, over one flat float64 vector.

    ``fun(x)`` returns ``(value, gradient)`` (pass ``jac=True``); ``value``, ``jac`` and
    ``hessp`` are the separate forms. A program with several inputs, or inputs that are not
    1-d, sees the flat vector split and reshaped into its inputs.
    """

    def __init__(self, program):
        from .replay import Program
        if not isinstance(program, Program):
            raise TypeError(f"objective() takes a tapegrad.Program (from tapegrad.trace), "
                            f"got {type(program).__name__}")
        if program.output_shapes != [()] or program._code.kind != "single":
            raise ValueError(f"scipy.optimize minimizes a scalar: this program returns "
                             f"outputs of shapes {program.output_shapes}")
        self.program = program
        self.shapes = program.input_shapes
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.size = sum(self.sizes)
        self.nfev = 0

    def _split(self, x):
        x = np.asarray(x, dtype=np.float64)
        if x.shape != (self.size,):
            raise ValueError(f"expected a flat vector of {self.size} values, got shape "
                             f"{list(x.shape)}")
        parts, i = [], 0
        for shape, n in zip(self.shapes, self.sizes):
            parts.append(x[i:i + n].reshape(shape))
            i += n
        return parts

    def _flat(self, g):
        gs = g if isinstance(g, tuple) else (g,)
        return np.concatenate([np.asarray(a, dtype=np.float64).reshape(-1) for a in gs])

    def fun(self, x):
        """(value, gradient) at ``x``: use with ``jac=True``."""
        self.nfev += 1
        v, g = self.program.value_and_grad(*self._split(x))
        return float(v), self._flat(g)

    __call__ = fun

    def value(self, x):
        self.nfev += 1
        return float(self.program(*self._split(x)))

    def jac(self, x):
        return self._flat(self.program.grad(*self._split(x)))

    def hessp(self, x, p):
        """Hessian of the value at ``x`` times ``p`` (compiled double sweep)."""
        xs = self._split(x)
        ps = self._split(p)
        return self._flat(self.program.hvp(tuple(xs), tuple(ps))[1])

    def hess(self, x):
        """The full Hessian at ``x`` (size x size)."""
        H = self.program.hessian(*self._split(x))
        if len(self.shapes) == 1:
            return np.asarray(H).reshape(self.size, self.size)
        return np.block([[np.asarray(H[i][j]).reshape(self.sizes[i], self.sizes[j])
                          for j in range(len(self.shapes))] for i in range(len(self.shapes))])


def objective(program):
    """Wrap a scalar-valued :class:`~tapegrad.Program` for ``scipy.optimize``.

    Examples
    --------
    >>> import numpy as np, scipy.optimize, tapegrad
    >>> prog = tapegrad.trace(lambda x: ((x - 1.0) ** 2).sum(), np.zeros(3))
    >>> obj = tapegrad.scipy.objective(prog)
    >>> res = scipy.optimize.minimize(obj.fun, np.zeros(3), jac=True, method="BFGS")
    >>> bool(np.allclose(res.x, 1.0))
    True
    """
    return Objective(program)


_HESSP = {"newton-cg", "trust-ncg", "trust-krylov", "trust-constr"}
_HESS = {"dogleg", "trust-exact"}


def minimize(program, x0, method="L-BFGS-B", **kwargs):
    """``scipy.optimize.minimize`` of a traced program from ``x0`` (flat, or shaped like
    the single input), with the compiled gradient (``jac=True``) and, for the methods that
    take them, the Hessian-vector product or the Hessian."""
    try:
        import scipy.optimize
    except ImportError:
        raise ImportError("tapegrad.scipy.minimize needs scipy: pip install "
                          "'tapegrad[scipy]'") from None
    obj = Objective(program)
    m = method.lower() if isinstance(method, str) else method
    if m in _HESSP and "hess" not in kwargs:
        kwargs.setdefault("hessp", obj.hessp)
    if m in _HESS:
        kwargs.setdefault("hess", obj.hess)
    x0 = np.asarray(x0, dtype=np.float64).reshape(-1)
    return scipy.optimize.minimize(obj.fun, x0, jac=True, method=method, **kwargs)
