"""``Parameter``: a leaf tensor that requires grad by default (torch.nn.Parameter)."""
from __future__ import annotations

from ..tensor import Tensor, _leaf, _pyfloat


class _ParameterMeta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, Tensor) and getattr(obj, "_param", False)


class Parameter(metaclass=_ParameterMeta):
    """A leaf tensor sharing ``data``'s values that requires grad unless told otherwise.

    tapegrad's tensors are one class, so ``Parameter(x)`` returns a ``Tensor``; it prints as
    torch's and ``isinstance(p, tapegrad.nn.Parameter)`` holds.

    Examples
    --------
    >>> import tapegrad
    >>> w = tapegrad.nn.Parameter(tapegrad.zeros(2))
    >>> w.requires_grad, w.is_leaf
    (True, True)
    """

    def __new__(cls, data=None, requires_grad=True):
        from .. import tensor as _tensor_mod
        if data is None:
            data = _tensor_mod.zeros(0)
        if not isinstance(data, Tensor):
            raise TypeError(f"Parameter expects a Tensor, got {type(data).__name__}")
        d = data._d
        t = _leaf(d if d.__class__ is _pyfloat else d.view(), False)
        if d.__class__ is not _pyfloat:
            t._ver = data._ver  # shares memory, and so the version counter
        t.requires_grad_(requires_grad)
        t._param = True
        return t
