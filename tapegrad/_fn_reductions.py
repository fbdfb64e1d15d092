"""Reductions: sum, mean, prod, max/min, amax/amin, norm, logsumexp, softmax."""
from __future__ import annotations

import collections

import numpy as np

from ._dtypes import _F64
from ._fn_elementwise import _t
from ._fn_shapes import reshape
from .ops import BY_NAME
from .ops import BY_NAME as _O
from .ops.arrays import fast_sum
from .ops._extreme import first_extreme
from .ops._kernels import sum_middle
from .tape import STATE
from .tensor import (TORCH_NAMES, Tensor, _dim, _errstate, _np_dtype, _plain, _pyfloat, _to_dtype,
                     array_op, binary, quiet, unary)

_add_reduce = np.add.reduce


def _dims(dim, ndim):
    if dim is None:
        return None
    if ndim == 0:  # torch accepts dim 0 or -1 on a 0-d tensor: the whole (single) element
        for d in (dim if isinstance(dim, (list, tuple)) else (dim,)):
            _dim(d, 0)
        return None
    if isinstance(dim, (list, tuple)):
        ds = tuple(_dim(d, ndim) for d in dim)
        if len(set(ds)) != len(ds):
            raise RuntimeError(f"dim {ds} appears multiple times in the list of dims")
        return ds if ds else None
    return (_dim(dim, ndim),)


def _float_input(x, fname):
    if x.dtype.np.kind != "f":
        return _to_dtype(x, np.dtype(np.float64)) if x.dtype.np.kind in "iub" else x
    return x


def _reduce(op, npfn):
    plain_sum = op.name == "sum"

    def fn(input, dim=None, keepdim=False, *, dtype=None):
        if plain_sum and dtype is None and input.__class__ is Tensor:
            a = input._d
            if a.__class__ is np.ndarray and a.dtype is _F64:  # the common cases, short
                if dim is None:
                    v = quiet(_add_reduce, a, None)
                    return array_op(op, [input], _pyfloat(v) if not keepdim else
                                    np.full((1,) * a.ndim, v), (None, keepdim))
                if dim.__class__ is int and a.ndim:  # one dim (kmeans' sum over d)
                    dims = (_dim(dim, a.ndim),)
                    return array_op(op, [input], quiet(npfn, a, dims, keepdim), (dims, keepdim))
        x = _t(input)
        _dims(dim, x.ndim)  # checked before anything is recorded
        if dtype is not None:
            x = _to_dtype(x, _np_dtype(dtype))
        if op.name == "mean":
            if x.dtype.np.kind != "f":
                raise RuntimeError(f"mean(): could not infer output dtype. Input dtype must be "
                                   f"either a floating point or complex dtype. Got: "
                                   f"{TORCH_NAMES[x.dtype.name]}")
        dims = _dims(dim, x.ndim)
        a = np.asarray(x._d)
        if a.size == 0 and op.name == "mean":  # nan, quietly, as torch (np.mean warns)
            with _errstate():
                v = np.sum(a, axis=dims, keepdims=keepdim) / 0.0
        else:  # (quiet: NumPy's warnings off at a tenth of an errstate's cost)
            v = quiet(npfn, a, dims, keepdim)
        if op.name == "sum" and a.dtype.kind in "bui":
            v = np.asarray(v).astype(np.int64)
        else:  # (a fresh array already of that dtype is kept, not copied)
            v = np.asarray(v).astype(a.dtype, copy=False)
        return array_op(op, [x], v, (dims, keepdim))
    fn.__name__ = op.name
    fn.__doc__ = f"``{op.name}`` over ``dim`` (all dims when None), ``keepdim`` as torch."
    return fn


def _sum(a, axis, keepdims):
    # a sum over the middle of (k, d, n) in one compiled pass (gmm's and kmeans' sums over
    # the coordinates), else fast_sum: NumPy's bits either way
    if axis is not None:
        v = sum_middle(a, axis, keepdims)
        if v is not None:
            return v
        if a.__class__ is np.ndarray and axis.__class__ is tuple and len(axis) == 1 \
                and a.ndim > 1 and axis[0] % a.ndim != a.ndim - 1:
            return _add_reduce(a, axis, None, None, keepdims)  # np.sum's call, direct
    return fast_sum(a, axis, keepdims)


sum = _reduce(_O["sum"], _sum)
mean = _reduce(_O["mean"], lambda a, axis, keepdims: _O["mean"].np(a, (axis, keepdims)))


def prod(input, dim=None, keepdim=False, *, dtype=None):
    """Product of all elements, or along one ``dim``."""
    x = _t(input)
    if isinstance(dim, (tuple, list)):
        raise TypeError("prod(): dim must be a single int")
    dims = _dims(dim, x.ndim)
    if dtype is not None:
        x = _to_dtype(x, _np_dtype(dtype))
    a = np.asarray(x._d)
    with _errstate():  # torch gives inf and nan quietly
        v = np.prod(a, axis=dims, keepdims=keepdim)
    v = np.asarray(v).astype(np.int64 if a.dtype.kind in "bui" else a.dtype)
    return array_op(_O["prod"], [x], v, (dims, keepdim))


_minmax = collections.namedtuple("return_types", ["values", "indices"])


def _extreme(op, npfn, argfn, pair_op, name):
    def fn(input, dim=None, keepdim=False, *, other=None):
        x = _t(input)
        if other is not None:  # max(x, other=y) is max(x, y), as torch
            if dim is not None:
                raise TypeError(f"{name}() received an invalid combination of arguments: pass "
                                "either dim (a reduction) or other (elementwise), not both")
            dim = _t(other, "other")
        if isinstance(dim, Tensor):
            return binary(pair_op, x, dim)
        if dim is None:
            a = np.asarray(x._d)
            if a.size == 0:
                raise RuntimeError(f"{name}(): Expected reduction dim to be specified for "
                                   "input.numel() == 0. Specify the reduction dim with the "
                                   "'dim' argument.")
            with _errstate():
                v = npfn(a)
            return array_op(op, [x], np.asarray(v, dtype=a.dtype), (None, False, "even"))
        d = _dim(dim, x.ndim)
        a = np.asarray(x._d)
        if a.ndim == 0:
            return _minmax(unary(_O["clone"], x), _plain(np.asarray(0, dtype=np.int64)))
        if a.shape[d] == 0:
            raise IndexError(f"{name}(): Expected reduction dim {d} to have non-zero size.")
        got = first_extreme(a, d, name == "max")  # float64: one compiled pass
        if got is not None:
            v, idx = got
            if keepdim:
                v = np.expand_dims(v, d)
        else:
            idx = argfn(a, axis=d)
            # NaN wins, like torch: argmax/argmin of a slice with NaN picks the first NaN
            nan_any = np.isnan(a).any(axis=d) if a.dtype.kind == "f" else None
            if nan_any is not None and nan_any.any():
                idx = np.where(nan_any, np.argmax(np.isnan(a), axis=d), idx)
            v = np.take_along_axis(a, np.expand_dims(idx, d), axis=d)
            if not keepdim:
                v = np.squeeze(v, axis=d)
        ind = np.expand_dims(idx, d) if keepdim else idx
        values = array_op(op, [x], v, ((d,), keepdim, idx))  # idx: reduced shape
        ind = _plain(np.asarray(ind, dtype=np.int64))
        tr = STATE.trace
        if tr is not None:
            tr.untraceable(ind, f"the indices of {name}(dim) of a traced tensor", x)
        return _minmax(values, ind)
    fn.__name__ = name
    fn.__doc__ = (f"``{name}(x)``: the {name}imum (ties share the gradient evenly); "
                  f"``{name}(x, dim)``: (values, indices), gradient to the first index; "
                  f"``{name}(x, other)``: elementwise.")
    return fn


max = _extreme(_O["amax"], np.max, np.argmax, _O["maximum"], "max")
min = _extreme(_O["amin"], np.min, np.argmin, _O["minimum"], "min")


def _amax_amin(op, npfn):
    def fn(input, dim=(), keepdim=False):
        """Maximum (minimum) over ``dim`` (all dims when empty); ties share the gradient."""
        x = _t(input)
        dims = None if dim == () or dim is None else _dims(dim, x.ndim)
        a = np.asarray(x._d)
        if a.size == 0:  # as torch: only a reduction over a dim of size 0 has no value
            if dims is None:
                raise RuntimeError(f"{op.name}(): Expected reduction dim to be specified for "
                                   "input.numel() == 0. Specify the reduction dim with the "
                                   "'dim' argument.")
            for d in dims:
                if a.shape[d] == 0:
                    raise IndexError(f"{op.name}(): Expected reduction dim {d} to have "
                                     f"non-zero size.")
        v = npfn(a, axis=dims, keepdims=keepdim)
        return array_op(op, [x], np.asarray(v, dtype=a.dtype), (dims, keepdim, None))
    fn.__name__ = op.name
    return fn


amax = _amax_amin(_O["amax"], np.max)
amin = _amax_amin(_O["amin"], np.min)


def norm(input, p="fro", dim=None, keepdim=False, dtype=None):
    """Vector p-norm over ``dim`` (all elements when None); ``'fro'`` is the 2-norm."""
    x = _t(input)
    if x.dtype.np.kind != "f":  # torch does not promote here
        raise RuntimeError(f"linalg.vector_norm: Expected a floating point or complex tensor "
                           f"as input. Got {TORCH_NAMES[x.dtype.name]} (convert it first: "
                           f"x.double() or x.float())")
    if p == "fro" or p is None:
        p = 2.0
    if isinstance(p, str):
        raise RuntimeError(f"norm(): p={p!r} is not supported; use a number, inf or 'fro'")
    p = float(p)
    dims = _dims(dim, x.ndim)
    a = np.asarray(x._d)
    aux = (dims, keepdim, p)
    with _errstate():
        v = BY_NAME["norm"].np(a, aux)
    return array_op(_O["norm"], [x], np.asarray(v, dtype=a.dtype), aux)


def logsumexp(input, dim, keepdim=False):
    """``log(sum(exp(x), dim))``, computed stably."""
    x = _float_input(_t(input), "logsumexp")
    if x.ndim == 0:  # torch treats a 0-d input as one element
        _dims(dim, 0)
        return reshape(logsumexp(reshape(x, (1,)), 0), ())
    dims = _dims(dim, x.ndim)
    a = np.asarray(x._d)
    aux = (dims if dims is not None else tuple(range(a.ndim)), keepdim)
    with _errstate():
        v = BY_NAME["logsumexp"].np(a, aux)
    return array_op(_O["logsumexp"], [x], np.asarray(v, dtype=a.dtype), aux)


def _softmax_fn(op):
    def fn(input, dim=None, dtype=None):
        x = _t(input)
        if dim is None:
            raise TypeError(f"{op.name}() missing required argument 'dim'")
        d = _dim(dim, x.ndim)
        if dtype is not None:
            x = _to_dtype(x, _np_dtype(dtype))
        if x.dtype.np.kind != "f":  # torch does not promote here
            raise NotImplementedError(
                f"\"{op.name}_lastdim_kernel_impl\" not implemented for "
                f"'{TORCH_NAMES[x.dtype.name]}' (pass dtype=tapegrad.float64, or convert it "
                "first: x.double())")
        if x.ndim == 0:  # torch treats a 0-d input as one element
            return reshape(fn(reshape(x, (1,)), 0), ())
        a = np.asarray(x._d)
        with _errstate():
            v = op.np(a, (d,))
        return array_op(op, [x], np.asarray(v, dtype=a.dtype), (d,))
    fn.__name__ = op.name
    fn.__doc__ = f"``{op.name}`` along ``dim``."
    return fn


softmax = _softmax_fn(_O["softmax"])
log_softmax = _softmax_fn(_O["log_softmax"])


def _arg_extreme(npfn, name):
    """``argmax``/``argmin``: the index (int64) of the first largest/smallest element, over
    everything or along ``dim``; NaN counts as the extreme (the first NaN), as torch's."""
    def fn(input, dim=None, keepdim=False):
        x = _t(input)
        if dim is not None and (not isinstance(dim, (int, np.integer))
                                or isinstance(dim, bool)):
            raise TypeError(f"{name}(): argument 'dim' must be int, not {type(dim).__name__}")
        if not isinstance(keepdim, (bool, np.bool_)):
            raise TypeError(f"{name}(): argument 'keepdim' must be bool, not "
                            f"{type(keepdim).__name__}")
        kind = x.dtype.np.kind
        if kind in "bc":
            raise RuntimeError(f"{name}(): does not support {'bool' if kind == 'b' else 'complex'}"
                               f" input (convert it first: input.to(tapegrad.int64), or "
                               f"input.real)")
        a = np.asarray(x._d)
        if dim is None:
            if a.size == 0:
                raise IndexError(f"{name}(): Expected reduction dim to be specified for "
                                 f"input.numel() == 0.")
            r = np.asarray(npfn(a.reshape(-1)), dtype=np.int64)
            if keepdim:
                r = r.reshape((1,) * a.ndim)
        else:
            d = _dim(dim, a.ndim)
            if a.ndim == 0:  # torch takes dim 0 or -1 of a 0-d tensor: its one element
                r = np.asarray(0, dtype=np.int64)
            elif a.shape[d] == 0:
                raise IndexError(f"{name}(): Expected reduction dim {d} to have non-zero "
                                 f"size.")
            else:
                r = np.asarray(npfn(a, axis=d, keepdims=bool(keepdim)), dtype=np.int64)
        r = _plain(r)
        tr = STATE.trace
        return r if tr is None else tr.untraceable(r, f"{name}() of a traced tensor", x)
    fn.__name__ = name
    fn.__doc__ = (f"Indices of the {'largest' if name == 'argmax' else 'smallest'} elements "
                  f"(the first, NaN first), over all elements or along ``dim``.")
    return fn


argmax = _arg_extreme(np.argmax, "argmax")
argmin = _arg_extreme(np.argmin, "argmin")
