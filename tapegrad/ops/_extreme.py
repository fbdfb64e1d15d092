"""``max(x, dim)`` / ``min(x, dim)`` in one compiled pass: the values and torch's indices."""
from __future__ import annotations

from math import prod

import numpy as np

from .._jit import njit_cached

_F64 = np.dtype(np.float64)


@njit_cached(nogil=True)
def _first_extreme(a, is_max, vals, idx):  # pragma: no cover (compiled)
    # a: (pre, n, post); vals, idx: (pre, post). Per slice the first extreme, or the first
    # NaN (NaN wins, as torch): a strict comparison keeps the first of ties, and once the
    # best is NaN nothing replaces it. Rows of `post` run innermost, contiguous.
    pre, n, post = a.shape
    for p in range(pre):
        for q in range(post):
            vals[p, q] = a[p, 0, q]
            idx[p, q] = 0
        for j in range(1, n):
            for q in range(post):
                x = a[p, j, q]
                b = vals[p, q]
                if b == b and ((x > b if is_max else x < b) or x != x):
                    vals[p, q] = x
                    idx[p, q] = j


def first_extreme(a, d, is_max):
    """(values, indices) of the max (``is_max``) or min of ``a`` along axis ``d`` (keepdim
    False), as NumPy's arg-reduction and a gather give them, bit for bit; None where the
    compiled pass does not apply (not a C-contiguous float64 array), for the NumPy path.
    NumPy's argmin/argmax over a leading axis copies the input, and a separate NaN pass
    followed: a tenth of that time for k-means' (k, n) distances."""
    if a.__class__ is not np.ndarray or a.dtype is not _F64 or not a.flags.c_contiguous \
            or a.size == 0:
        return None
    shape = a.shape
    n = shape[d]
    pre, post = prod(shape[:d]), prod(shape[d + 1:])
    vals = np.empty((pre, post), dtype=_F64)
    idx = np.empty((pre, post), dtype=np.int64)
    _first_extreme(a.reshape(pre, n, post), bool(is_max), vals, idx)
    out = shape[:d] + shape[d + 1:]
    # over the only dim of a 1-d input the index is a NumPy integer, as argmin gives it
    return vals.reshape(out), (idx.reshape(out) if out else idx[0, 0])


@njit_cached(nogil=True)
def _mark_picked(idx, mask):  # pragma: no cover (compiled)
    pre, n, post = mask.shape
    for p in range(pre):
        for q in range(post):
            mask[p, idx[p, q], q] = True


def picked(shape, d, index):
    """The bool mask of ``shape`` that is True at ``index`` (the indices of max/min over
    axis ``d``, shaped as the reduced array, or one integer for a 1-d input): the entries
    that take the gradient, written directly (a broadcast comparison took several times
    longer)."""
    n = shape[d]
    pre, post = prod(shape[:d]), prod(shape[d + 1:])
    mask = np.zeros((pre, n, post), dtype=np.bool_)
    if index.__class__ is not np.ndarray or index.dtype != np.int64 \
            or not index.flags.c_contiguous or index.shape != shape[:d] + shape[d + 1:]:
        index = np.ascontiguousarray(np.broadcast_to(index, shape[:d] + shape[d + 1:]),
                                     dtype=np.int64)
    idx = index.reshape(pre, post)
    _mark_picked(idx, mask)
    return mask.reshape(shape)
