"""Public tensor functions (torch names) and the Tensor operators and methods that use them.

Each function checks its arguments, computes the forward and records through the
recorder in ``_recorder.py``; nothing reaches the tape before the checks pass. The functions
whose arguments need parsing live by family in ``_fn_elementwise``, ``_fn_reductions``,
``_fn_linalg``, ``_fn_shapes`` and ``_fn_extras``; this module gathers them. Which names are
public (``tapegrad.<name>``, ``Tensor.<name>``, ``__all__``) comes from each op's
``register(...)`` call (see "the public surface" below); an elementwise op needs no code here.
"""
from __future__ import annotations

import numbers

import numpy as np

from . import _generated_eager as _eager
from ._fn_elementwise import _binary_fn, clamp, clamp_max, clamp_min, clone, pow, softplus, where
from ._fn_linalg import diag, dot, ger, inner, matmul, outer
from ._fn_reductions import (amax, amin, argmax, argmin, log_softmax, logsumexp, max, mean,
                             min, norm, prod, softmax, sum)
from ._fn_shapes import (_inplace, _rebind, _shape_arg, broadcast_to, cat, flatten, getitem,
                         permute, reshape, setitem, squeeze, stack, swapaxes, swapdims, t,
                         transpose, unsqueeze)
from ._recorder import _NUMBER
from .ops import BINARY, OPS, UNARY
from .ops import BY_NAME as _O
from .tape import STATE
from .tensor import (TORCH_NAMES, Tensor, _hint, _np_dtype, _plain, _to_dtype, _to_tensor, binary,
                     check_device, result_dtype, unary, unary_fallback)


# --- Tensor operators and methods ----------------------------------------------------------------

_ADD, _SUB, _MUL, _DIV, _POW = _O["add"], _O["sub"], _O["mul"], _O["div"], _O["pow"]
_NEG, _ABS = _O["neg"], _O["abs"]


def _binop(op):
    name = op.name
    return getattr(_eager, f"__{name}__"), getattr(_eager, f"__r{name}__")


Tensor.__add__, Tensor.__radd__ = _binop(_ADD)
Tensor.__sub__, Tensor.__rsub__ = _binop(_SUB)
Tensor.__mul__, Tensor.__rmul__ = _binop(_MUL)
Tensor.__truediv__, Tensor.__rtruediv__ = _binop(_DIV)
Tensor.__pow__, Tensor.__rpow__ = _binop(_POW)
Tensor.__neg__ = _eager.neg
Tensor.__pos__ = lambda self: self
Tensor.__abs__ = lambda self: unary(_ABS, self)
Tensor.__matmul__ = lambda self, other: matmul(self, _to_tensor(other))
Tensor.__rmatmul__ = lambda self, other: matmul(_to_tensor(other), self)
Tensor.__iadd__ = _inplace(lambda s, o: binary(_ADD, s, o))
Tensor.__isub__ = _inplace(lambda s, o: binary(_SUB, s, o))
Tensor.__imul__ = _inplace(lambda s, o: binary(_MUL, s, o))
Tensor.__itruediv__ = _inplace(lambda s, o: binary(_DIV, s, o))
Tensor.add_ = lambda self, other, *, alpha=1: Tensor.__iadd__(
    self, other if alpha == 1 else other * alpha)
Tensor.sub_ = lambda self, other, *, alpha=1: Tensor.__isub__(
    self, other if alpha == 1 else other * alpha)
Tensor.mul_ = Tensor.__imul__
Tensor.div_ = Tensor.__itruediv__
Tensor.pow_ = _inplace(lambda s, o: binary(_POW, s, o))
def _zeroed(s):
    """Zeros shaped like ``s``, recorded as depending on it (gradient 0) so that an
    overwritten non-leaf keeps requiring grad, as torch; not ``s * 0``, which is NaN where
    ``s`` is inf or NaN."""
    return where(np.ones(s.shape, dtype=np.bool_), 0.0, s)


Tensor.copy_ = _inplace(lambda s, o: binary(_ADD, _zeroed(s), o) if isinstance(o, Tensor)
                        else _plain(np.broadcast_to(np.asarray(o), s.shape)))
Tensor.zero_ = lambda self: _inplace(lambda s, o: _zeroed(s))(self, 0.0)
Tensor.fill_ = lambda self, v: _inplace(lambda s, o: _zeroed(s) + o)(self, v)
Tensor.__getitem__ = getitem
Tensor.__setitem__ = setitem


def _compare(npop, name):
    def f(self, other):
        if other.__class__ is Tensor:
            o = other._d
        elif other.__class__ in _NUMBER or isinstance(other, (numbers.Number, np.ndarray,
                                                                list)):
            o = other if not isinstance(other, list) else np.asarray(other)
        else:
            return NotImplemented
        try:
            v = npop(np.asarray(self._d), o)
        except ValueError:
            raise RuntimeError(f"The size of tensor a ({list(self.shape)}) must match the size "
                               f"of tensor b ({list(np.shape(o))}) in comparison {name}") \
                from None
        t = _plain(np.asarray(v))
        tr = STATE.trace
        if tr is not None:  # tracing: the comparison is recomputed at replay
            tr.on_logic(name, t, self, other)
        return t
    return f


Tensor.__eq__ = _compare(np.equal, "eq")
Tensor.__ne__ = _compare(np.not_equal, "ne")
Tensor.__lt__ = _compare(np.less, "lt")
Tensor.__le__ = _compare(np.less_equal, "le")
Tensor.__gt__ = _compare(np.greater, "gt")
Tensor.__ge__ = _compare(np.greater_equal, "ge")
Tensor.__hash__ = lambda self: id(self)
Tensor.eq, Tensor.ne, Tensor.lt = Tensor.__eq__, Tensor.__ne__, Tensor.__lt__
Tensor.le, Tensor.gt, Tensor.ge = Tensor.__le__, Tensor.__gt__, Tensor.__ge__


def _logical(npop, bitwise=None):
    def f(self, other=None):
        o = other._d if isinstance(other, Tensor) else other
        unary = other is None and npop is np.logical_not
        if bitwise is not None:
            rd = result_dtype(self, other if isinstance(other, Tensor) or
                              other.__class__ in _NUMBER else _to_tensor(other))
            if rd.kind != "b":  # torch: bitwise on integers, on floats not at all
                return _bitwise(bitwise, rd, self, other, o)
        v = npop(np.asarray(self._d)) if unary else npop(np.asarray(self._d), o)
        t = _plain(np.asarray(v))
        tr = STATE.trace
        if tr is not None:
            tr.on_logic(npop.__name__, t, self, *(() if unary else (other,)))
        return t
    return f


def _bitwise(npop, rd, x, y, yv):
    name = npop.__name__
    if rd.kind != "i" and rd.kind != "u":
        raise NotImplementedError(f"\"{name}_cpu\" not implemented for '{TORCH_NAMES[rd.name]}'")
    tr = STATE.trace
    if tr is not None and any(isinstance(t, Tensor) and tr.ref(t) is not None for t in (x, y)):
        raise NotImplementedError(f"{name} of traced integer tensors cannot be replayed yet; "
                                  "compute it outside the traced function")
    yv = np.asarray(yv).astype(rd) if isinstance(y, Tensor) else yv
    return _plain(np.asarray(npop(np.asarray(x._d).astype(rd), yv), dtype=rd))


def _invert(self):
    t = _plain(np.asarray(~np.asarray(self._d)))
    tr = STATE.trace
    if tr is not None and t._d.dtype == np.bool_:
        tr.on_logic("logical_not", t, self)
    elif tr is not None:
        tr.untraceable(t, "~ (bitwise not) of a traced integer", self)
    return t


Tensor.__invert__ = _invert
Tensor.__and__ = _logical(np.logical_and, np.bitwise_and)
Tensor.__or__ = _logical(np.logical_or, np.bitwise_or)
Tensor.__xor__ = _logical(np.logical_xor, np.bitwise_xor)
Tensor.logical_not = _logical(np.logical_not)
def _predicate(npfn, traced):
    """A boolean method; while tracing, on a traced tensor, ``traced(self, ...)``: the same
    value built from recorded comparisons and sums, so a program recomputes it."""
    def f(self, *args, **kwargs):
        tr = STATE.trace
        if tr is not None and tr.traced(self):
            return traced(self, *args, **kwargs)
        return _plain(np.asarray(npfn(np.asarray(self._d), *args, **kwargs)))
    return f


# all: no element is 0; any: some element is not (NaN counts as true, as in NumPy)
Tensor.any = _predicate(lambda a, dim=None, keepdim=False: np.any(a, axis=dim,
                                                                  keepdims=keepdim),
                        lambda s, dim=None, keepdim=False: (s != 0).sum(dim, keepdim) > 0)
Tensor.all = _predicate(lambda a, dim=None, keepdim=False: np.all(a, axis=dim,
                                                                  keepdims=keepdim),
                        lambda s, dim=None, keepdim=False: (s == 0).sum(dim, keepdim) == 0)
Tensor.isnan = _predicate(np.isnan, lambda s: s != s)
Tensor.isfinite = _predicate(np.isfinite, lambda s: (s - s) == 0)
Tensor.argmax = argmax
Tensor.argmin = argmin


def _method(fn):
    def m(self, *args, **kwargs):
        return fn(self, *args, **kwargs)
    m.__name__ = fn.__name__
    m.__doc__ = fn.__doc__
    return m


# --- the public surface, from the registry -------------------------------------------------
# Each op's register(...) call names its public functions (api, aliases) and whether they
# are Tensor methods. The function of a name is the one written above under that name (where
# the arguments need parsing; an alias: its op's first api name's), else, for an
# elementwise op, made here: the generated eager fast path (unary) or broadcasting binary.
# So adding an elementwise op to the API is its register(...) call alone.

#: functions that are not one op: (name, in __all__, a Tensor method)
_COMPOSITES = (("flatten", True, True), ("squeeze", True, True), ("unsqueeze", True, True),
               ("t", True, True), ("broadcast_to", True, True), ("dot", True, True))


def _unary_fn(op):
    def fn(input):
        return unary_fallback(op, input)
    fn.__name__ = op.name
    return fn


def _op_function(op, name):
    fn = globals().get(name)
    if fn is not None:
        return fn
    if op.kind == UNARY:
        # the generated eager fast path; before the generator has run for a new op (it
        # imports the package), the recorder's general path
        return getattr(_eager, op.name, None) or _unary_fn(op)
    if op.kind == BINARY:
        return _binary_fn(op)
    raise TypeError(f"op {op.name!r} declares api name {name!r} but tapegrad/functions.py "
                    f"has no function {name}: write one (its arguments need parsing)")


def _surface():
    """{public name: function}, the names in ``__all__``, and the Tensor methods."""
    public, listed, methods = {}, [], {}
    for op in OPS:
        for i, name in enumerate(op.api):  # a later api name with no function of its own
            public[name] = _op_function(op, name) if i == 0 or name in globals() \
                else public[op.api[0]]  # (clip, concat) is the first's, as an alias
            listed.append(name)
        for name in op.aliases:  # the same function as the op's first name
            public[name] = public[op.api[0]]
        if op.method:
            methods.update((name, public[name]) for name in op.api + op.aliases)
    for name, in_all, method in _COMPOSITES:
        public[name] = globals()[name]
        if in_all:
            listed.append(name)
        if method:
            methods[name] = public[name]
    return public, listed, methods


_PUBLIC, _LISTED, _METHODS = _surface()
globals().update(_PUBLIC)
for _name, _fn in _METHODS.items():
    setattr(Tensor, _name, _method(_fn))
Tensor.expand_as = lambda self, other: broadcast_to(self, other.shape)


def _reshape_method(self, *shape):
    return reshape(self, *shape)


Tensor.reshape = _reshape_method


def _view_method(self, *shape):
    a = self._d
    # a view's layout is torch's (transpose, permute, expand, slices); other results' are
    # NumPy's (a ufunc of an expanded input may come out in Fortran order): reshape there
    if a.__class__ is np.ndarray and not a.flags.c_contiguous \
            and getattr(self, "_alias", None) is not None:
        try:  # torch's view never copies: refuse where reshape would
            a.view().shape = _shape_arg(shape)
        except AttributeError:
            raise RuntimeError("view size is not compatible with input tensor's size and "
                               "stride (at least one dimension spans across two contiguous "
                               "subspaces). Use .reshape(...) instead.") from None
        except ValueError:
            pass  # (reshape raises torch's message)
    return reshape(self, *shape)


Tensor.view = _view_method
Tensor.view_as = lambda self, other: reshape(self, other.shape)
Tensor.reshape_as = Tensor.view_as
Tensor.expand = lambda self, *size: broadcast_to(self, tuple(
    s if n == -1 else n for n, s in zip(_shape_arg(size), (1,) * (len(_shape_arg(size)) -
                                                                 self.ndim) + self.shape)))
Tensor.T = property(lambda self: self if self.ndim < 2 else permute(
    self, tuple(range(self.ndim - 1, -1, -1))))
Tensor.mT = property(lambda self: transpose(self, -2, -1))


def _cast(nd):
    return lambda self: _to_dtype(self, np.dtype(nd))


Tensor.double = _cast(np.float64)
Tensor.float = _cast(np.float32)
Tensor.long = _cast(np.int64)
Tensor.int = _cast(np.int32)
Tensor.bool = _cast(np.bool_)


def _to(self, *args, dtype=None, device=None, copy=False, non_blocking=False):
    for a in args:
        if isinstance(a, str) or hasattr(a, "type") and hasattr(a, "index"):  # torch.device
            device = a
        elif isinstance(a, Tensor):
            dtype = a.dtype
        else:
            dtype = a
    check_device(device, "to")
    out = self if dtype is None else _to_dtype(self, _np_dtype(dtype))
    return out.clone() if copy and out is self else out


Tensor.to = _to
Tensor.type = lambda self, dtype=None: self.dtype if dtype is None else _to(self, dtype)
Tensor.cpu = lambda self: self


def _contiguous(self):
    """torch's contiguous() of a non-contiguous tensor is a copy (recorded): writes into it
    leave the tensor as it was."""
    d = self._d
    if d.__class__ is not np.ndarray or d.flags.c_contiguous:
        return self
    out = clone(self)  # (NumPy's copy keeps the layout, as torch's clone)
    c = np.ascontiguousarray(out._d)
    tape = out._tape
    if tape is not None and tape.arrays.get(out._slot) is out._d:
        tape.arrays[out._slot] = c
    out._d = c
    return out


Tensor.contiguous = _contiguous
Tensor.clamp_ = lambda self, min=None, max=None: _inplace(
    lambda s, o: clamp(s, min, max))(self, 0.0)


def _unary_(fn):
    """A unary in-place method (``x.exp_()``: no argument, as torch's)."""
    write = _inplace(lambda s, o: fn(s))
    return lambda self: write(self, 0.0)


Tensor.abs_ = _unary_(lambda s: s.abs())
Tensor.sqrt_ = _unary_(lambda s: s.sqrt())
Tensor.exp_ = _unary_(lambda s: s.exp())
Tensor.neg_ = _unary_(lambda s: s.neg())
del _name, _fn

# gathered after the surface is built, as where they were written: _surface reads this
# module's globals() for the ops' functions, and these are not ops' functions
from ._fn_extras import (_index_added, _lgamma_np, _polygamma_np, argsort, cross,  # noqa: E402
                         einsum, empty, equal, floor_divide, fmod, linalg_cross, linalg_norm, mm,
                         remainder, repeat_interleave, sort, special_multigammaln,
                         zeros_like_t)


Tensor.repeat_interleave = _method(repeat_interleave)
Tensor.cross = lambda self, other, dim=None: cross(self, other, dim)
Tensor.floor_divide = Tensor.__floordiv__ = floor_divide
Tensor.__rfloordiv__ = lambda self, other: floor_divide(other, self)
Tensor.remainder = Tensor.__mod__ = remainder
Tensor.__rmod__ = lambda self, other: remainder(other, self)
Tensor.fmod = fmod


#: public but outside ``__all__`` (as in torch's top-level namespace, these are not ops)
_EXTRAS = ("argmax", "argmin", "argsort", "equal", "index_add", "mm", "sort", "cross",
           "einsum", "empty", "repeat_interleave", "floor_divide", "remainder", "fmod")
__all__ = list(_LISTED)


def public():
    """{name: function} for the ``tapegrad`` namespace: ``__all__``, the ops' aliases and the
    extras."""
    return {**_PUBLIC, **{n: globals()[n] for n in _EXTRAS}}


def index_add(input, dim, index, source, *, alpha=1):
    """Out-of-place ``index_add_``."""
    r = _PUBLIC["add"](input, _index_added(input, dim, index, source, alpha))
    return _hint(r, "IndexAddBackward0") if r._tape is not None else r


def _index_add_(self, dim, index, source, *, alpha=1):
    scattered = _index_added(self, dim, index, source, alpha)
    _inplace(lambda s, o: binary(_ADD, s, o))(self, scattered)
    return _hint(self, "IndexAddBackward0") if self._tape is not None else self


Tensor.sort = _method(sort)
Tensor.argsort = _method(argsort)
Tensor.mm = _method(mm)
Tensor.equal = _method(equal)
Tensor.index_add = _method(index_add)
Tensor.index_add_ = _index_add_
