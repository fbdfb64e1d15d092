"""Reading and writing an optimizer parameter's value in place, without recording."""
from __future__ import annotations

import numpy as np

from ..tape import bump
from ..tensor import Tensor, tensor

_pyfloat = float

def _open(t):
    """``(flat, shared)``: ``t``'s value as a 1-d contiguous array to update in place.

    ``shared`` says whether ``flat`` is ``t``'s own storage (a writable contiguous
    array of a tensor off the tape); otherwise ``flat`` is a copy that ``_close``
    writes back.
    """
    d = t._d
    if d.__class__ is _pyfloat:
        return np.array([d]), False
    if t._tape is None and d.flags.writeable and d.flags.c_contiguous:
        return d.reshape(-1), True
    return d.flatten(), False


def _close(t, flat, shared):
    """Finish an in-place update of ``t`` opened with ``_open``: write ``flat`` back when
    it is a copy, and count the change as an in-place op does (version bump, cached tape
    entry dropped, so a backward through an older use of ``t`` reports it)."""
    d = t._d
    if shared:
        box = getattr(t, "_ver", None)
        if box is None:
            t._ver = [0]
        else:
            bump(box)
    elif d.__class__ is _pyfloat:
        t._d = _pyfloat(flat[0])
        box = getattr(t, "_ver", None)
        if box is not None:
            bump(box)
        if t._tape is not None:
            t._tape.dirty[t._slot] = len(t._tape)
    elif t._tape is None and d.flags.writeable:
        np.copyto(d, flat.reshape(d.shape))
        bump(t._ver)
    else:  # a non-leaf (its tape keeps the old array) or a read-only array: a new array
        if t._tape is not None:
            t._tape.dirty[t._slot] = len(t._tape)
        t._d = flat.reshape(d.shape)
        t._ver = [0]
    t._sid = -1


def _read(t, dtype):
    """``t``'s value as a 1-d contiguous array of ``dtype`` (a view when it can be)."""
    d = t._d
    if d.__class__ is _pyfloat:
        return np.array([d], dtype=dtype)
    return np.ascontiguousarray(d, dtype=dtype).reshape(-1)


def _np_dtype_of(t):
    d = t._d
    return np.dtype(np.float64) if d.__class__ is _pyfloat else d.dtype


def _scalar(x):
    """A hyperparameter as a Python float (1-element tensors included)."""
    if isinstance(x, Tensor):
        if x.numel() != 1:
            raise ValueError(f"a tensor hyperparameter must have 1 element, got shape "
                             f"{tuple(x.shape)}")
        return _pyfloat(np.asarray(x._d).reshape(-1)[0])
    return _pyfloat(x)


def _typename(obj):
    if isinstance(obj, Tensor):
        return f"tapegrad.Tensor (dtype {obj.dtype})"
    cls = type(obj)
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _copy_tensor(value, nd=None):
    """A new tensor with ``value``'s data (cast to NumPy dtype ``nd`` when given)."""
    a = np.array(value._d, dtype=nd)
    return tensor(a, requires_grad=bool(value._rg and a.dtype.kind == "f"))

