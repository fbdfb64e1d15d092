"""``fma(a, b, c)``: ``a * b + c`` with one rounding (LLVM's ``llvm.fma``), for torch's cross.

torch's CPU cross computes each component as ``fma(a_p, b_q, -(a_q * b_p))`` (its compiler
fuses the first product into the subtraction), so a cross rounded twice, as ``a_p * b_q -
a_q * b_p`` is, differs from torch's by an ulp, and a tie downstream (a max, a where, a sort)
then routes the gradient otherwise. Python 3.11 has no ``math.fma`` and NumPy and Numba offer
none: ``fma`` is the intrinsic, compiled (cached), and ``fms`` (fused multiply-subtract,
``fma(a, b, -c)``, the registry's op of that name) its forms on Python floats and arrays.
"""
from __future__ import annotations

import numpy as np
from numba.core import types
from numba.extending import intrinsic

from ._jit import njit_cached


@intrinsic
def _llvm_fma(typingctx, a, b, c):
    """``llvm.fma`` on three floats of one type (float32 or float64)."""
    if not (isinstance(a, types.Float) and a == b == c):
        return None

    def codegen(context, builder, sig, args):
        return builder.fma(*args)

    return a(a, b, c), codegen


@njit_cached(inline="always")
def fma(a, b, c):
    """``a * b + c`` rounded once (float32 or float64, all three of one type)."""
    return _llvm_fma(a, b, c)


@njit_cached
def _fms_scalar(a, b, c):
    return _llvm_fma(a, b, -c)


@njit_cached
def _fms_flat(a, b, c, out):
    for i in range(out.size):
        out[i] = _llvm_fma(a[i], b[i], -c[i])


def fms_py(a, b, c):
    """``fma(a, b, -c)`` on Python floats (float64)."""
    return float(_fms_scalar(float(a), float(b), float(c)))


def fms_np(a, b, c):
    """``fma(a, b, -c)`` elementwise, broadcasting like NumPy; float32 when all three are
    float32 arrays (torch's float32 cross fuses in float32), float64 otherwise."""
    dt = np.result_type(a, b, c)
    dt = np.dtype(np.float32) if dt == np.float32 else np.dtype(np.float64)
    a, b, c = np.broadcast_arrays(*(np.asarray(x, dtype=dt) for x in (a, b, c)))
    out = np.empty(a.shape, dtype=dt)
    if out.size:
        _fms_flat(np.ascontiguousarray(a).reshape(-1), np.ascontiguousarray(b).reshape(-1),
                  np.ascontiguousarray(c).reshape(-1), out.reshape(-1))
    return out
