"""Matrix products and diagonals: matmul, dot, inner, outer, diag."""
from __future__ import annotations


import numpy as np

from ._fn_elementwise import _t
from .ops import BY_NAME as _O
from .ops._kernels import matmul as _matmul
from .tensor import array_op, quiet

def matmul(input, other):
    """Matrix product with NumPy/torch rank rules (1-D, 2-D, batched with broadcasting)."""
    x, y = _t(input), _t(other, "other")
    a, b = np.asarray(x._d), np.asarray(y._d)
    if a.ndim == 0 or b.ndim == 0:
        raise RuntimeError(f"both arguments to matmul need to be at least 1D, but they are "
                           f"{a.ndim}D and {b.ndim}D")
    if a.dtype != b.dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {x.dtype} != "
                           f"{y.dtype}")
    ka = a.shape[-1]
    kb = b.shape[0] if b.ndim == 1 else b.shape[-2]
    if ka != kb:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied "
                           f"({'x'.join(map(str, a.shape))} and "
                           f"{'x'.join(map(str, b.shape))}): the inner sizes {ka} and {kb} "
                           "differ")
    try:
        v = quiet(_matmul, a, b)  # (a large batch on threads) torch gives inf and nan quietly
    except ValueError as e:
        raise RuntimeError(f"matmul: batch dimensions do not broadcast: {e}") from None
    return array_op(_O["matmul"], [x, y], v, None)


def dot(input, other):
    """Inner product of two 1-D tensors."""
    x, y = _t(input), _t(other, "other")
    if x.ndim != 1 or y.ndim != 1:
        raise RuntimeError(f"1D tensors expected, but got {x.ndim}D and {y.ndim}D tensors")
    if x.shape != y.shape:
        raise RuntimeError(f"inconsistent tensor size, expected tensor [{x.shape[0]}] and src "
                           f"[{y.shape[0]}] to have the same number of elements, but got "
                           f"{x.shape[0]} and {y.shape[0]} elements respectively")
    return matmul(x, y)


inner = dot


def outer(input, vec2):
    """Outer product of two 1-D tensors."""
    x, y = _t(input), _t(vec2, "vec2")
    if x.ndim != 1 or y.ndim != 1:
        raise RuntimeError(f"outer: expected 1-D tensors, got {x.ndim}D and {y.ndim}D")
    if x.dtype is not y.dtype:
        raise RuntimeError(f"expected both arguments to have the same dtype, got {x.dtype} "
                           f"and {y.dtype}")
    v = quiet(np.multiply.outer, np.asarray(x._d), np.asarray(y._d))
    return array_op(_O["outer"], [x, y], v, None)


ger = outer


def diag(input, diagonal=0):
    """1-D -> matrix with it on a diagonal; 2-D -> that diagonal."""
    x = _t(input)
    if x.ndim not in (1, 2):
        raise RuntimeError(f"diag(): Supports 1D or 2D tensors. Got {x.ndim}D")
    a = np.asarray(x._d)
    v = np.diag(a, diagonal).copy()
    return array_op(_O["diag"], [x], v, (int(diagonal),))
