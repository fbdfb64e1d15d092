"""Tensor dtypes (torch's names over NumPy's) and torch's type promotion between them."""
from __future__ import annotations

import numpy as np


class dtype:
    """A tensor element type (wraps a NumPy dtype; prints like torch's)."""

    __slots__ = ("name", "np", "is_floating_point", "is_complex", "itemsize")

    def __init__(self, name, np_dtype):
        self.name = name
        self.np = np.dtype(np_dtype)
        self.is_floating_point = self.np.kind == "f"
        self.is_complex = self.np.kind == "c"
        self.itemsize = self.np.itemsize

    def __repr__(self):
        return f"tapegrad.{self.name}"

    def __reduce__(self):
        return (_dtype_by_name, (self.name,))


float16 = dtype("float16", np.float16)
float32 = dtype("float32", np.float32)
float64 = dtype("float64", np.float64)
complex64 = dtype("complex64", np.complex64)
complex128 = dtype("complex128", np.complex128)
uint8 = dtype("uint8", np.uint8)
int8 = dtype("int8", np.int8)
int16 = dtype("int16", np.int16)
int32 = dtype("int32", np.int32)
int64 = dtype("int64", np.int64)
bool_ = dtype("bool", np.bool_)

_DTYPES = {d.np: d for d in (float16, float32, float64, complex64, complex128, uint8, int8,
                             int16, int32, int64, bool_)}
_pyfloat, _pyint, _pybool = float, int, bool
# dtypes a repr leaves unsaid, as torch's (with float64 as the default dtype)
_REPR_DEFAULT = (np.dtype(np.float64), np.dtype(np.int64), np.dtype(np.bool_))
_F64 = np.dtype(np.float64)


def _dtype_by_name(name):
    return _DTYPES[np.dtype(name)]


def _np_dtype(d):
    """NumPy dtype for a tapegrad/NumPy/Python dtype argument, or a TypeError."""
    if d is None:
        return None
    if isinstance(d, dtype):
        nd = d.np
    else:
        try:
            nd = np.dtype(d)
        except TypeError:
            raise TypeError(f"dtype must be a tapegrad dtype such as tapegrad.float64, "
                            f"got {d!r}") from None
    if nd not in _DTYPES:
        raise TypeError(f"tapegrad does not support dtype {nd}; use float64, float32, an "
                        "integer type or bool")
    if nd.kind == "c":
        raise TypeError("complex tensors are not supported by tapegrad yet; use float64 or "
                        "float32 (complex support is planned)")
    return nd


def _tg_dtype(nd):
    return _DTYPES[nd]


def _cat(nd):
    k = nd.kind
    return 0 if k == "b" else 1 if k in "iu" else 2 if k == "f" else 3


def promote_types(a, b):
    """torch.promote_types on NumPy dtypes: within a category (bool, integer, floating,
    complex) as NumPy; across categories the higher one's dtype (int64 with float32 is
    float32, where NumPy gives float64), complex widened to the float's precision."""
    if a is b or a == b:
        return a
    ca, cb = _cat(a), _cat(b)
    if ca == cb or ca + cb == 5:  # complex with float: NumPy's rule is torch's
        return np.result_type(a, b)
    return a if ca > cb else b


#: dtypes by name as torch's error messages spell them
TORCH_NAMES = {"bool": "Bool", "uint8": "Byte", "int8": "Char", "int16": "Short",
               "int32": "Int", "int64": "Long", "float16": "Half", "float32": "Float",
               "float64": "Double", "complex64": "ComplexFloat", "complex128": "ComplexDouble"}
