"""Forward-only compiled passes NumPy runs slowly on (k, d, n) work: a float64 ``+ - *``
with one operand broadcast along the innermost axis, and a sum over the middle axis.
Each gives NumPy's result bit for bit (one correctly rounded operation per element, the
sum in NumPy's order) or None where it does not apply, for the NumPy path."""
from __future__ import annotations

import numpy as np

from .._jit import njit_cached

_F64 = np.dtype(np.float64)
#: below this many result elements the call costs more than NumPy's slow loop
_MIN_SIZE = 16384
#: opcodes of the broadcast pass: the rows' operand r (a whole row of n), the column's c
ADD, SUB, RSUB, MUL = 0, 1, 2, 3


@njit_cached(nogil=True)
def _rows_op(r, c, op, out):  # pragma: no cover (compiled)
    # r: (ar, br, n), c: (ac, bc, 1), each axis of length 1 or the result's; out: (a, b, n).
    # NumPy's inner loop with a zero-stride operand is a scalar loop; here each row of n
    # is a contiguous loop the compiler vectorizes
    a, b, n = out.shape
    for i in range(a):
        ir = i if r.shape[0] > 1 else 0
        ic = i if c.shape[0] > 1 else 0
        for j in range(b):
            row = r[ir, j if r.shape[1] > 1 else 0]
            s = c[ic, j if c.shape[1] > 1 else 0, 0]
            o = out[i, j]
            if op == ADD:
                for q in range(n):
                    o[q] = row[q] + s
            elif op == SUB:
                for q in range(n):
                    o[q] = row[q] - s
            elif op == RSUB:
                for q in range(n):
                    o[q] = s - row[q]
            else:
                for q in range(n):
                    o[q] = row[q] * s


def _as3(v):
    return v.reshape((1,) * (3 - v.ndim) + v.shape)


def rows_op(op, x, y):
    """``x op y`` (op: ``ADD``, ``SUB`` or ``MUL``; x, y float64 arrays), NumPy's result bit
    for bit, when one operand runs along the innermost axis (length n >= 64, contiguous)
    and the other is broadcast along it (length 1 there): kmeans' and gmm's
    ``P[None] - C[:, :, None]``, 1.5 to 2x NumPy's time. None otherwise."""
    if x.__class__ is not np.ndarray or y.__class__ is not np.ndarray \
            or x.dtype is not _F64 or y.dtype is not _F64:
        return None
    nd = max(x.ndim, y.ndim)
    if nd < 2 or nd > 3 or x.ndim == 0 or y.ndim == 0:
        return None
    nx, ny = x.shape[-1], y.shape[-1]
    if ny == 1 and nx >= 64:
        r, c = x, y
    elif nx == 1 and ny >= 64:
        r, c = y, x
        if op == SUB:
            op = RSUB
    else:
        return None
    try:
        shape = np.broadcast_shapes(x.shape, y.shape)
    except ValueError:
        return None
    if shape[-1] * (shape[-2] if nd > 1 else 1) * (shape[0] if nd > 2 else 1) < _MIN_SIZE:
        return None
    r3, c3 = _as3(r), _as3(c)
    if not r3.flags.c_contiguous:
        return None  # (a copy would cost what the pass saves)
    if not c3.flags.c_contiguous:
        c3 = np.ascontiguousarray(c3)  # (the small operand)
    out = np.empty(_as3_shape(shape), dtype=_F64)
    _rows_op(r3, c3, op, out)
    return out.reshape(shape)


def _as3_shape(shape):
    return (1,) * (3 - len(shape)) + tuple(shape)


@njit_cached(nogil=True)
def _sum_middle(a, out):  # pragma: no cover (compiled)
    # a: (p, m, n) -> out: (p, n): 0.0 plus the m rows in order, NumPy's add.reduce over a
    # non-innermost axis (its identity first: a sum of -0.0s is +0.0)
    p, m, n = a.shape
    for i in range(p):
        o = out[i]
        for q in range(n):
            o[q] = 0.0
        for j in range(m):
            row = a[i, j]
            for q in range(n):
                o[q] += row[q]


def sum_middle(a, axis, keepdims):
    """``np.sum(a, axis, keepdims=keepdims)`` bit for bit, for a C-contiguous float64 ``a``
    of 2 or 3 dims summed over its second-to-last axis with rows of n >= 64 (gmm's and
    kmeans' sums over the coordinates, laid out (k, d, n)): one pass, about 0.6x NumPy's
    time. None otherwise."""
    if a.__class__ is not np.ndarray or a.dtype is not _F64 or not 2 <= a.ndim <= 3:
        return None
    if axis.__class__ is tuple:
        if len(axis) != 1:
            return None
        axis = axis[0]
    if axis.__class__ is not int or axis % a.ndim != a.ndim - 2:
        return None
    n = a.shape[-1]
    if n < 64 or a.size < _MIN_SIZE or not a.flags.c_contiguous:
        return None
    a3 = _as3(a)
    out = np.empty((a3.shape[0], n), dtype=_F64)
    _sum_middle(a3, out)
    shape = a.shape[:-2] + ((1,) if keepdims else ()) + (n,)
    return out.reshape(shape)
