"""Public tensor functions (torch names) and the Tensor operators and methods that use them.

Each function checks its arguments, computes the forward and records through the
recorder in ``tensor.py``; nothing reaches the tape before the checks pass. Which names are
public (``tapegrad.<name>``, ``Tensor.<name>``, ``__all__``) comes from each op's
``register(...)`` call (see "the public surface" below); an elementwise op needs no code here.
"""
from __future__ import annotations

import builtins
import collections
import math
import numbers
import sys

import numpy as np

from . import _generated_eager as _eager
from .ops import ARRAY, BINARY, BY_NAME, OPS, ROW, UNARY
from .ops._extreme import first_extreme
from .ops.arrays import fast_sum
from .tape import STATE, all_or_nothing, bump
from .tensor import (TORCH_NAMES, Tensor, _cat, _dim, _errstate, _hint, _norm_value, _np_dtype,
                     _plain, _pyfloat, _to_dtype, _to_tensor, array_op, binary, check_device,
                     quiet, result_dtype, tensor, unary, unary_fallback)

_O = BY_NAME
_NUMBER = (float, int, bool)
_F64 = np.dtype(np.float64)
_add_reduce = np.add.reduce


def _t(x, name="input"):
    """Argument as a tensor; TypeError naming the argument otherwise."""
    if isinstance(x, Tensor):
        return x
    raise TypeError(f"{name} must be a Tensor, not {type(x).__name__}")


def _tn(x, name="input"):
    """Tensor or Python number (for binary ops)."""
    if isinstance(x, Tensor) or x.__class__ in _NUMBER or isinstance(x, numbers.Real):
        return x if not isinstance(x, np.generic) else x.item()
    if isinstance(x, (np.ndarray, list, tuple)):
        return _to_tensor(x)
    raise TypeError(f"{name} must be a Tensor or a number, not {type(x).__name__}")


# --- elementwise ----------------------------------------------------------------------------


def _binary_fn(op):
    def fn(input, other):
        input, other = _tn(input), _tn(other, "other")
        if not isinstance(input, Tensor) and not isinstance(other, Tensor):
            raise TypeError(f"{op.name}(): at least one argument must be a Tensor")
        return binary(op, input, other)
    fn.__name__ = op.torch or op.name
    fn.__doc__ = f"Elementwise ``{op.torch or op.name}`` with broadcasting (differentiable)."
    return fn


_pow2 = _binary_fn(_O["pow"])


def pow(input, exponent):
    """``input ** exponent`` (tensor or number on either side)."""
    return _pow2(input, exponent)


def clone(input):
    """A copy that stays on the tape (gradient flows back to ``input``)."""
    return unary(_O["clone"], _t(input))


def softplus(input, beta=1.0, threshold=20.0):
    """``log(1 + exp(beta * x)) / beta``, linear above ``threshold``."""
    for name, v in (("beta", beta), ("threshold", threshold)):
        if not isinstance(v, numbers.Real):
            raise TypeError(f"softplus(): argument '{name}' must be a number, not "
                            f"{type(v).__name__}")
    x = _t(input)
    if x.dtype.np.kind != "f":  # torch does not promote here
        raise NotImplementedError(f"\"softplus_cpu\" not implemented for "
                                  f"'{TORCH_NAMES[x.dtype.name]}' (convert it first: x.double())")
    return unary(_O["softplus"], x, float(beta), float(threshold))


def clamp(input, min=None, max=None):
    """Clamp to ``[min, max]``; the gradient passes at the bounds (torch's rule)."""
    x = _t(input)
    if min is None and max is None:
        raise RuntimeError("torch.clamp: At least one of 'min' or 'max' must not be None")
    if isinstance(min, Tensor) or isinstance(max, Tensor):
        lo = None if min is None else _tn(min, "min")  # both checked before recording
        hi = None if max is None else _tn(max, "max")
        for b in (lo, hi):
            if b is not None:
                try:
                    np.broadcast_shapes(x.shape, np.shape(b._d if isinstance(b, Tensor)
                                                          else b))
                except ValueError:
                    raise RuntimeError(f"clamp: bound of shape {list(np.shape(b._d))} does "
                                       f"not broadcast to {list(x.shape)}") from None
        out = x
        if lo is not None:
            out = binary(_O["clamp_min_t"], out, lo)
        if hi is not None:
            out = binary(_O["clamp_max_t"], out, hi)
        return out
    for name, v in (("min", min), ("max", max)):
        if v is not None and not isinstance(v, numbers.Real):
            raise TypeError(f"clamp(): {name} must be a number or a Tensor, not "
                            f"{type(v).__name__}")
    lo = -math.inf if min is None else float(min)
    hi = math.inf if max is None else float(max)
    if x.dtype.np.kind != "f":
        v = np.clip(np.asarray(x._d), min, max)
        tr = STATE.trace
        return _plain(v) if tr is None else tr.untraceable(
            _plain(v), "clamp() of a traced integer tensor", x)
    return unary(_O["clamp"], x, lo, hi)



def clamp_min(input, min):
    return clamp(input, min=min)


def clamp_max(input, max):
    return clamp(input, max=max)


def where(condition, input, other):
    """Pick ``input`` where ``condition`` holds, else ``other`` (broadcasting)."""
    cond = np.asarray(condition._d if isinstance(condition, Tensor) else condition)
    if cond.dtype != np.bool_:
        raise RuntimeError(f"where expected condition to be a boolean tensor, but got a "
                           f"tensor with dtype {cond.dtype}")
    x, y = _tn(input), _tn(other, "other")
    x = x if isinstance(x, Tensor) else tensor(x)
    y = y if isinstance(y, Tensor) else tensor(y)
    rd = result_dtype(x, y)
    xv, yv = np.asarray(x._d), np.asarray(y._d)
    try:
        shape = np.broadcast_shapes(cond.shape, xv.shape, yv.shape)
    except ValueError:
        raise RuntimeError(f"where(): shapes {list(cond.shape)}, {list(xv.shape)} and "
                           f"{list(yv.shape)} are not broadcastable") from None
    v = np.where(cond, xv.astype(rd, copy=False), yv.astype(rd, copy=False))
    c = np.broadcast_to(cond, shape)
    tr = STATE.trace
    ref = tr.ref(condition) if tr is not None and isinstance(condition, Tensor) else None
    if ref is not None and not (x._rg or y._rg):
        # a traced condition choosing between constants: recorded all the same
        return tr.plain_op(lambda cp, a, b: array_op(_O["where"], [tr.taped(a), b], v,
                                                      (c, ref)), (condition, x, y), _plain(v))
    return array_op(_O["where"], [x, y], v, (c,) if ref is None else (c, ref))


# --- reductions -----------------------------------------------------------------------------


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
        if plain_sum and dim is None and dtype is None and input.__class__ is Tensor:
            a = input._d
            if a.__class__ is np.ndarray and a.dtype is _F64:  # the common case, short
                v = quiet(_add_reduce, a, None)
                return array_op(op, [input], _pyfloat(v) if not keepdim else
                                np.full((1,) * a.ndim, v), (None, keepdim))
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
        with _errstate():
            if a.size == 0 and op.name == "mean":  # nan, quietly, as torch (np.mean warns)
                v = np.sum(a, axis=dims, keepdims=keepdim) / 0.0
            else:
                v = npfn(a, axis=dims, keepdims=keepdim)
        if op.name == "sum" and a.dtype.kind in "bui":
            v = np.asarray(v).astype(np.int64)
        else:  # (a fresh array already of that dtype is kept, not copied)
            v = np.asarray(v).astype(a.dtype, copy=False)
        return array_op(op, [x], v, (dims, keepdim))
    fn.__name__ = op.name
    fn.__doc__ = f"``{op.name}`` over ``dim`` (all dims when None), ``keepdim`` as torch."
    return fn


sum = _reduce(_O["sum"], fast_sum)
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

# --- linear algebra ---------------------------------------------------------------------------


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
        v = quiet(np.matmul, a, b)  # torch gives inf and nan quietly
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


# --- shapes -------------------------------------------------------------------------------------


def _shape_arg(shape):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    for s in shape:
        if not isinstance(s, (int, np.integer)) or isinstance(s, bool):
            raise TypeError(f"shape must be a sequence of ints, got {shape!r}")
    return tuple(int(s) for s in shape)


def reshape(input, *shape):
    """Same elements, new shape (one dim may be -1)."""
    x = _t(input)
    shape = _shape_arg(shape)
    a = np.asarray(x._d)
    try:
        v = a.reshape(shape)
    except ValueError:
        raise RuntimeError(f"shape '{list(shape)}' is invalid for input of size {a.size}") \
            from None
    return _aliased(array_op(_O["reshape"], [x], v, (v.shape, a.shape)), x,
                    lambda b: b.reshape(shape), lambda t: reshape(t, a.shape))


def flatten(input, start_dim=0, end_dim=-1):
    x = _t(input)
    if x.ndim == 0:
        return reshape(x, 1)
    s = _dim(start_dim, x.ndim)
    e = _dim(end_dim, x.ndim)
    shape = x.shape[:s] + (-1,) + x.shape[e + 1:]
    return reshape(x, shape)


def squeeze(input, dim=None):
    x = _t(input)
    shape = x.shape
    if dim is None:
        new = tuple(s for s in shape if s != 1)
    else:
        d = _dim(dim, x.ndim)
        new = shape[:d] + shape[d + 1:] if x.ndim and shape[d] == 1 else shape
    return _hint(reshape(x, new), "SqueezeBackward0" if dim is None else "SqueezeBackward1")


def unsqueeze(input, dim):
    x = _t(input)
    d = _dim(dim, x.ndim + 1)
    return _hint(reshape(x, x.shape[:d] + (1,) + x.shape[d:]), "UnsqueezeBackward0")


def transpose(input, dim0, dim1):
    """Swap two dims."""
    x = _t(input)
    nd = x.ndim
    d0, d1 = _dim(dim0, nd), _dim(dim1, nd)
    a = np.asarray(x._d)
    v = np.swapaxes(a, d0, d1) if nd else a
    return _aliased(array_op(_O["transpose"], [x], v, (d0, d1) if nd else (0, 0)), x,
                    lambda b: np.swapaxes(b, d0, d1) if nd else b,
                    lambda t: transpose(t, d0, d1) if nd else t)


swapaxes = swapdims = transpose


def permute(input, *dims):
    x = _t(input)
    dims = _shape_arg(dims)
    if len(dims) != x.ndim:
        raise RuntimeError(f"permute(sparse_coo): number of dimensions in the tensor input "
                           f"does not match the length of the desired ordering of dimensions "
                           f"i.e. input.dim() = {x.ndim} is not equal to len(dims) = "
                           f"{len(dims)}")
    ds = tuple(_dim(d, x.ndim) for d in dims)
    if sorted(ds) != list(range(x.ndim)):
        raise RuntimeError(f"permute(): duplicate dims are not allowed: {dims}")
    return _aliased(array_op(_O["permute"], [x], np.transpose(np.asarray(x._d), ds), ds), x,
                    lambda b: np.transpose(b, ds),
                    lambda t: permute(t, tuple(int(i) for i in np.argsort(ds))))


def t(input):
    x = _t(input)
    if x.ndim > 2:
        raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, but self is {x.ndim}D")
    return _hint(transpose(x, 0, 1), "TBackward0") if x.ndim == 2 else x


def _seq(tensors, fname):
    if isinstance(tensors, Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{fname}(): argument 'tensors' must be a tuple or list of Tensors, "
                        f"not {type(tensors).__name__}")
    if not tensors:
        raise RuntimeError(f"{fname}(): expected a non-empty list of Tensors")
    for i, x in enumerate(tensors):
        if not isinstance(x, Tensor):
            raise TypeError(f"{fname}(): expected Tensor as element {i} in argument 0, but got "
                            f"{type(x).__name__}")
    return list(tensors)


def stack(tensors, dim=0):
    """Join same-shape tensors along a new ``dim``."""
    ts = _seq(tensors, "stack")
    shape0 = ts[0].shape
    for i, x in enumerate(ts):
        if x.shape != shape0:
            raise RuntimeError(f"stack expects each tensor to be equal size, but got "
                               f"{list(shape0)} at entry 0 and {list(x.shape)} at entry {i}")
    d = _dim(dim, len(shape0) + 1)
    rd = result_dtype(*ts)
    v = np.stack([np.asarray(x._d, dtype=rd) for x in ts], axis=d)
    return array_op(_O["stack"], ts, v, (d,))


def cat(tensors, dim=0):
    """Join tensors along an existing ``dim``."""
    ts = _seq(tensors, "cat")
    nd = ts[0].ndim
    if nd == 0:
        raise RuntimeError("zero-dimensional tensor (at position 0) cannot be concatenated")
    d = _dim(dim, nd)
    for i, x in enumerate(ts):
        if x.ndim != nd:
            raise RuntimeError(f"Tensors must have same number of dimensions: got {nd} and "
                               f"{x.ndim}")
        s0, s1 = list(ts[0].shape), list(x.shape)
        s0[d] = s1[d] = 0
        if s0 != s1:
            raise RuntimeError(f"Sizes of tensors must match except in dimension {d}. Expected "
                               f"size {ts[0].shape} but got size {x.shape} for tensor number "
                               f"{i} in the list.")
    rd = result_dtype(*ts)
    v = np.concatenate([np.asarray(x._d, dtype=rd) for x in ts], axis=d)
    return array_op(_O["cat"], ts, v, (d,))



def broadcast_to(input, size):
    x = _t(input)
    shape = _shape_arg((size,))
    a = np.asarray(x._d)
    try:
        v = np.broadcast_to(a, shape)
    except ValueError:
        raise RuntimeError(f"The expanded size of the tensor must match the existing size: "
                           f"cannot expand {list(a.shape)} to {list(shape)}") from None
    return array_op(_O["expand"], [x], v, (v.shape, a.shape))


# --- indexing ------------------------------------------------------------------------------


def _index(idx):
    """A NumPy index from a torch-style one (tensors become arrays)."""
    if isinstance(idx, tuple):
        return tuple(_index_item(i) for i in idx)
    return _index_item(idx)


def _index_item(i):
    if isinstance(i, Tensor):
        a = np.asarray(i._d)
        if a.dtype.kind == "f":
            raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
        return a
    if isinstance(i, list):
        a = np.asarray(i)
        if a.dtype.kind == "f":
            raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
        return a
    if isinstance(i, float):
        raise IndexError("only integers, slices (`:`), ellipsis (`...`), None and long or byte "
                         "Variables are valid indices (got float)")
    return i


def getitem(x, idx):
    d = x._d
    if idx.__class__ is slice and d.__class__ is np.ndarray and d.ndim:
        v = d[idx]  # one slice: a view, the common case written out
        if not (x._rg and STATE.grad_enabled):
            t = _plain(v)
            t._ver = x._ver
            if STATE.trace is not None:  # a slice of a traced comparison: recorded
                return STATE.trace.plain_op(lambda a: getitem(a, idx), (x,), t)
            return t
        return _record_view(x, v, idx, d.shape)
    if d.__class__ is _pyfloat:
        d = np.asarray(d)
    if d.ndim == 0 and idx not in ((), Ellipsis, None):
        raise IndexError("invalid index of a 0-dim tensor. Use `tensor.item()` in Python or "
                         "`tensor.item<T>()` in C++ to convert a 0-dim tensor to a number")
    nidx = _index(idx)
    try:
        v = d[nidx]
    except IndexError as e:
        raise IndexError(str(e).replace("axis", "dimension")) from None
    tr = STATE.trace
    if tr is not None:  # a traced mask or index chooses elements: guarded
        tr.on_index(idx)
    if not (x._rg and STATE.grad_enabled):
        t = _plain(_norm_value(v))
        if isinstance(v, np.ndarray) and np.shares_memory(v, d):
            t._ver = x._ver  # a view: in-place writes through it bump the base's version
        if tr is not None:
            return tr.plain_op(lambda a: getitem(a, idx), (x,), t)
        return t
    basic = _basic_index(nidx)
    if not basic:
        return array_op(_O["getitem"], [x], v, (nidx, d.shape, basic))
    return _record_view(x, v, nidx, d.shape)


def _record_view(x, v, index, shape):
    """Record ``v = x[index]`` for a basic index. A basic index gives a view: no copy. The
    tape keeps the view, and checks the base's version at backward, as torch's views share
    their base's version counter."""
    res = array_op(_O["getitem"], [x], v, (index, shape, True))
    if isinstance(v, np.ndarray) and res._tape is not None:
        try:
            box = x._ver
        except AttributeError:
            box = x._ver = [0]
        res._tape.viewed.append((res._slot, box, box[0]))
    res._view = (x, index)
    res._alias = (x, lambda a, v: a.__setitem__(index, v), None)  # recorded: ``_view``
    return res


def _aliased(res, x, fn, inverse):
    """``res`` is a view of ``x`` (``fn`` makes it from ``x``'s array): an unrecorded
    in-place change of ``res`` writes through to ``x``, as torch's views share memory;
    ``inverse`` maps a tensor of ``res``'s shape to ``x``'s (the recorded write-back)."""
    def write(a, v):
        view = fn(a)
        if not np.shares_memory(view, a):  # never silently into a copy
            raise RuntimeError("in-place change of a view whose base's layout changed: "
                               "make it on a contiguous tensor (x.clone())")
        np.copyto(view, v, casting="unsafe")

    if res._tape is not None and res is not x and isinstance(res._d, np.ndarray) \
            and isinstance(x._d, np.ndarray) and np.shares_memory(res._d, x._d):
        res._alias = (x, write, inverse)
    return res


def _basic_index(index):
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, np.integer, slice))
               for i in items)


def setitem(x, idx, value):
    d = x._d
    scalar = d.__class__ is _pyfloat
    if scalar:
        d = np.asarray(d)
    nidx = _index(idx)
    tr = STATE.trace
    if tr is not None:
        tr.on_index(idx, "x[i] = v")
    v = value if isinstance(value, Tensor) else _tn(value, "value")
    vt = v if isinstance(v, Tensor) else None
    vv = np.asarray(v._d if vt is not None else v)
    try:
        tshape = np.shape(d[nidx])  # no view of d kept: _owned_write counts its holders
        np.broadcast_to(vv, tshape)
    except IndexError as e:
        raise IndexError(str(e).replace("axis", "dimension")) from None
    except ValueError:
        raise RuntimeError(f"shape mismatch: value tensor of shape {list(vv.shape)} cannot be "
                           f"broadcast to indexing result of shape {list(tshape)}") \
            from None
    grad = STATE.grad_enabled and (x._rg or (vt is not None and vt._rg))
    if grad:
        if x._rg and x._tape is None:
            raise RuntimeError("a leaf Variable that requires grad is being used in an "
                               "in-place operation (index assignment). Assign into a clone "
                               "(y = x.clone(); y[...] = v) or wrap it in tapegrad.no_grad().")
        if _leaf_base(x) is not None:  # checked before anything is recorded
            raise RuntimeError("a view of a leaf Variable that requires grad is being used in "
                               "an in-place operation (index assignment). Assign into a clone, "
                               "or wrap it in tapegrad.no_grad().")
        vt = vt if vt is not None else _plain(_norm_value(vv.astype(d.dtype)))
        if vt.dtype.np != d.dtype:
            vt = _to_dtype(vt, d.dtype)
        own = _owned_write(x, d)
        out = d if own else np.array(d, copy=True)
        out[nidx] = vv.astype(d.dtype, copy=False)
        res = array_op(_O["setitem"], [x, vt], out, (nidx, None))
        if own:  # the older entry's value is dead (see _owned_write): a zero-stride stand-in
            # keeps its shape and frees its hold on the array; the tape counted it once
            res._tape.arrays[x._slot] = np.broadcast_to(np.zeros((), d.dtype), d.shape)
            res._tape.nbytes -= out.nbytes
        _rebind(x, res)
        _write_back(x)
        return
    if tr is not None:
        tr.written(x, v, "an index assignment (x[i] = v) of a traced value")
    if scalar:
        out = np.array(d, copy=True)
        out[nidx] = vv
        x._d = _pyfloat(out)
        x._sid = -1
        if x._tape is not None:
            x._tape.dirty[x._slot] = len(x._tape)
            _keep_on_tape(x)
            _write_through(x)
        return
    _inplace_write(x, lambda arr: arr.__setitem__(nidx, vv))


def _owned_write(x, d):
    """Whether an index assignment into ``x`` may write its array in place: ``d`` is the
    copy that the previous recorded assignment made, still on the tape the next entry goes
    to, and nothing but ``x`` and that entry holds it (no view, no other tensor, no import
    into another tape), and no entry recorded since reads it. Nothing reads that entry's
    value after this write then (the setitem rule needs only shapes). So a loop of row writes
    keeps the written rows and one array,
    not one copy of the destination per write."""
    tape = x._tape
    if (tape is None or x._sid != tape.sid or d.__class__ is not np.ndarray
            or d.base is not None or not d.flags.writeable or STATE.tape() is not tape
            or len(tape.vals) >= tape.limit or tape.arrays.get(x._slot) is not d
            or OPS[int(tape.code[x._slot * ROW]) & ~ARRAY] is not _O["setitem"]):
        return False
    # holders: x._d, the tape's entry, the caller's d, our d and getrefcount's argument
    if sys.getrefcount(d) > 5:
        return False
    # an entry recorded since that reads the value (x * x) needs it as it is: copy
    k0, code = x._slot, tape.code
    for k in range(k0 + 1, len(tape.vals)):
        uses = OPS[int(code[k * ROW]) & ~ARRAY].uses
        if uses and (("a" in uses and code[k * ROW + 1] == k - k0)
                     or ("b" in uses and code[k * ROW + 2] == k - k0)):
            return False
    return not any(k > k0 and k0 in tape.aux[k][0] for k in tape.nary)


def _rebind(x, res):
    """Make tensor ``x`` the result of an in-place op recorded out of place."""
    if x._tape is not None:  # entries before this op that saved x's old value now see a
        x._tape.dirty[x._slot] = res._slot if res._tape is x._tape else len(x._tape)
    x._d = res._d
    x._rg = res._rg
    x._tape = res._tape
    x._sid = res._sid
    x._slot = res._slot
    if res._d.__class__ is not _pyfloat:
        x._ver = [0]  # a new array: what a tape saved of the old one is unchanged


def _inplace_write(x, write):
    """Modify ``x``'s array in place (no recording): copy-on-write when a tape holds it."""
    d = x._d
    if x._tape is not None or not d.flags.writeable:
        d = np.array(d, copy=True)
        write(d)
        if x._tape is not None:
            x._tape.dirty[x._slot] = len(x._tape)
        x._d = d
        x._ver = [0]  # a new array: what a tape saved of the old one is unchanged
    else:
        write(d)
        bump(x._ver)
    x._sid = -1
    if x._tape is not None:
        _keep_on_tape(x)
        _write_through(x)


def _leaf_base(t):
    """The leaf that requires grad which view ``t`` (through views) is of, else None."""
    while True:
        alias = getattr(t, "_alias", None)
        if alias is None:
            return None
        t = alias[0]
        if t._rg and t._tape is None:
            return t


def _write_back(t):
    """``t``, a view, was changed in place (recorded): its base takes the new value,
    recorded too, and so on up the views (a reshape, transpose or permute view, or one of
    a view, kept the base's old value before: a wrong number)."""
    view = getattr(t, "_view", None)
    if view is not None:
        setitem(view[0], view[1], t)  # writes back from view[0] in turn
        return
    alias = getattr(t, "_alias", None)
    if alias is not None and alias[2] is not None:
        base = alias[0]
        new = alias[2](t)
        if new.dtype is not base.dtype:
            new = _to_dtype(new, base.dtype.np)
        _rebind(base, new)
        _write_back(base)


def _write_through(x):
    """``x``, a view of another tensor, was changed in place without recording (its array
    copied, as the tape holds it): write its new value into its base, as torch's views share
    memory (without this the base kept its old value: a wrong number)."""
    alias = getattr(x, "_alias", None)
    if alias is not None:
        base, write = alias[:2]
        _inplace_write(base, lambda arr: write(arr, x._d))


def _keep_on_tape(x):
    """After an unrecorded in-place change (under no_grad) of non-leaf ``x``: enter its new
    value on its tape as an identity of the old entry, so later ops read the new value and
    the gradient flows through the in-place op unchanged, as in torch (``x`` keeps its
    history; without this it would be entered again as a leaf of its own)."""
    if STATE.trace is not None:
        return
    tape, old = x._tape, x._slot
    v = x._d
    k = tape.append(_CLONE if v.__class__ is _pyfloat else _CLONE | ARRAY, old, -1, 0.0, 0.0,
                    v)
    x._slot, x._sid = k, tape.sid
    if getattr(x, "_retains", False):
        import weakref
        tape.retained.pop(old, None)
        tape.retained[k] = weakref.ref(x)
    from .autograd.graph import entry_name
    _hint(x, entry_name(tape, old))  # it prints as the op that made it, as torch's


def _inplace(op_fn):
    def method(self, other):
        other = _tn(other, "other")
        grad = STATE.grad_enabled and (self._rg or (isinstance(other, Tensor) and other._rg))
        if grad and self._rg and self._tape is None:
            raise RuntimeError("a leaf Variable that requires grad is being used in an "
                               "in-place operation. Use an out-of-place op (x = x + y), or "
                               "update it inside tapegrad.no_grad().")
        view = _leaf_base(self) if grad else None
        if view is not None:
            raise RuntimeError("a view of a leaf Variable that requires grad is being used in "
                               "an in-place operation. Use an out-of-place op, or update it "
                               "inside tapegrad.no_grad().")
        oshape = other.shape if isinstance(other, Tensor) else np.shape(other)
        try:
            bshape = np.broadcast_shapes(self.shape, oshape)
        except ValueError:
            bshape = None
        if bshape != self.shape:  # checked before anything is recorded
            raise RuntimeError(f"output with shape {list(self.shape)} doesn't match the "
                               f"broadcast shape {list(bshape or oshape)}")
        res = op_fn(self, other)
        if grad:
            if res.dtype is not self.dtype:
                res = _to_dtype(res, self.dtype.np)
            _rebind(self, res)
            _write_back(self)  # write through to the base, as torch's views do
            return self
        v = res._d
        tr = STATE.trace
        if tr is not None:  # self takes res's value: and its reference, when traced
            tr.rebind(self, res)
        if self._d.__class__ is _pyfloat:
            self._d = v if v.__class__ is _pyfloat else float(v)
            self._sid = -1
            box = getattr(self, "_ver", None)
            if box is not None:
                bump(box)
            if self._tape is not None:
                self._tape.dirty[self._slot] = len(self._tape)
                _keep_on_tape(self)
                _write_through(self)
            return self
        rt = np.asarray(v).dtype
        if _cat(rt) > _cat(self._d.dtype):  # torch's canCast: no float into int, int into bool
            raise RuntimeError(f"result type {TORCH_NAMES[rt.name]} can't be cast to the "
                               f"desired output type {TORCH_NAMES[self.dtype.name]}")
        _inplace_write(self, lambda arr: np.copyto(arr, v, casting="unsafe"))
        return self
    return method


# --- Tensor operators and methods ----------------------------------------------------------------

_ADD, _SUB, _MUL, _DIV, _POW = _O["add"], _O["sub"], _O["mul"], _O["div"], _O["pow"]
_NEG, _ABS = _O["neg"], _O["abs"]
_CLONE = _O["clone"].code


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
Tensor.add_ = Tensor.__iadd__
Tensor.sub_ = Tensor.__isub__
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


def _arg(npfn, name):
    def f(self, dim=None, keepdim=False):
        r = _plain(np.asarray(npfn(np.asarray(self._d), axis=dim, keepdims=keepdim),
                              dtype=np.int64))
        tr = STATE.trace
        return r if tr is None else tr.untraceable(r, f"{name}() of a traced tensor", self)
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
Tensor.argmax = _arg(np.argmax, "argmax")
Tensor.argmin = _arg(np.argmin, "argmin")


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
Tensor.view = _reshape_method
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
Tensor.contiguous = lambda self: self
Tensor.abs_ = _inplace(lambda s, o: s.abs())
Tensor.clamp_ = lambda self, min=None, max=None: _inplace(
    lambda s, o: clamp(s, min, max))(self, 0.0)
Tensor.sqrt_ = _inplace(lambda s, o: s.sqrt())
Tensor.exp_ = _inplace(lambda s, o: s.exp())
Tensor.neg_ = _inplace(lambda s, o: s.neg())
del _name, _fn

# --- functions GradBench's pytorch tool uses: built from the differentiable ops above, so
# create_graph, is_grads_batched and replay come with them -------------------------------


def empty(*size, dtype=None, requires_grad=False):
    """A tensor of shape ``size`` (torch leaves it uninitialized; tapegrad fills zeros).

    >>> tapegrad.empty(2, 3).shape
    (2, 3)
    """
    from .tensor import zeros
    return zeros(*size, dtype=dtype, requires_grad=requires_grad)


@all_or_nothing
def repeat_interleave(input, repeats=None, dim=None, *, output_size=None):
    """Repeat each element (each slice along ``dim``; of the flattened input when ``dim`` is
    None) ``repeats`` times; ``repeats`` is an int or one count per element. With one
    integer tensor argument, the indices repeated by their counts (torch's form).

    >>> tapegrad.repeat_interleave(tapegrad.tensor([1., 2.]), 2).tolist()
    [1.0, 1.0, 2.0, 2.0]
    """
    input = _t(input)
    if repeats is None:  # repeat_interleave(counts): arange(len(counts)) repeated
        counts = np.asarray(input._d)
        if counts.dtype.kind not in "iu" or counts.ndim != 1:
            raise RuntimeError("repeat_interleave: repeats must be a 1-d integer tensor")
        return tensor(np.repeat(np.arange(len(counts)), counts))
    if dim is None:
        input, dim = reshape(input, -1), 0
    dim = _dim(dim, input.ndim) if input.ndim else 0
    if input.ndim == 0:
        input = reshape(input, 1)
    n = input.shape[dim]
    r = np.asarray(repeats._d if isinstance(repeats, Tensor) else repeats)
    if r.dtype.kind not in "iu":
        raise RuntimeError(f"repeat_interleave: repeats must be integers, got {r.dtype}")
    if r.ndim > 1 or (r.ndim == 1 and len(r) not in (1, n)):
        raise RuntimeError(f"repeat_interleave: repeats must have the same size as input "
                           f"along dim ({n}), got {list(r.shape)}")
    if (r < 0).any():
        raise RuntimeError("repeat_interleave: repeats can not be negative")
    idx = np.repeat(np.arange(n), r.reshape(-1) if r.ndim else int(r))
    if output_size is not None and len(idx) != output_size:
        raise RuntimeError(f"repeat_interleave: output_size {output_size} does not match the "
                           f"{len(idx)} elements the repeats give")
    return getitem(input, (slice(None),) * dim + (idx,))


def _cross(input, other, dim):
    input, other = _t(input), _t(other, "other")
    if input.ndim != other.ndim:
        raise RuntimeError(f"linalg.cross: inputs must have the same number of dimensions "
                           f"(got {input.ndim} and {other.ndim}); unsqueeze the smaller one")
    try:
        shape = np.broadcast_shapes(input.shape, other.shape)
    except ValueError:
        raise RuntimeError(f"linalg.cross: inputs of shapes {list(input.shape)} and "
                           f"{list(other.shape)} do not broadcast") from None
    if dim is None:  # torch.cross without dim: the first dimension of size 3
        dims = [i for i, n in enumerate(shape) if n == 3]
        if not dims:
            raise RuntimeError("no dimension of size 3 in input")
        dim = dims[0]
    dim = _dim(dim, len(shape))
    if shape[dim] != 3:
        raise RuntimeError(f"linalg.cross: inputs dimension {dim} must have length 3. Got "
                           f"{input.shape[dim - len(shape) + input.ndim] if input.ndim else 0}"
                           f" and {other.shape[dim - len(shape) + other.ndim] if other.ndim else 0}")  # noqa: E501
    input, other = broadcast_to(input, shape), broadcast_to(other, shape)
    lead = (slice(None),) * dim
    i, j = lead + (np.array([1, 2, 0]),), lead + (np.array([2, 0, 1]),)
    return getitem(input, i) * getitem(other, j) - getitem(input, j) * getitem(other, i)


@all_or_nothing
def cross(input, other, dim=None):
    """Cross product of 3-vectors along ``dim`` (default: the first dimension of size 3,
    as torch.cross).

    >>> tapegrad.cross(tapegrad.tensor([1., 0, 0]), tapegrad.tensor([0., 1, 0])).tolist()
    [0.0, 0.0, 1.0]
    """
    return _cross(input, other, dim)


def linalg_cross(input, other, *, dim=-1):
    """``tapegrad.linalg.cross``: cross product of 3-vectors along ``dim`` (default -1)."""
    return _cross(input, other, dim)


def _einsum_parse(equation, operands):
    eq = equation.replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(operands):
        raise RuntimeError(f"einsum(): {len(terms)} operand(s) in the equation "
                           f"{equation!r} but {len(operands)} tensor(s) given")
    used = set(c for c in eq if c.isalpha())
    spare = iter(c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                 if c not in used)
    nell = builtins.max([op.ndim - len(t.replace("...", "")) for t, op in zip(terms, operands)
                         if "..." in t] + [0])
    ell = "".join(next(spare) for _ in range(nell))
    labels = []
    for t, op in zip(terms, operands):
        if "..." in t:
            k = op.ndim - len(t.replace("...", ""))
            t = t.replace("...", ell[nell - k:] if k else "")
        if not builtins.all(c.isalpha() for c in t):
            raise RuntimeError(f"einsum(): invalid subscript in {equation!r}: subscripts must "
                               "be letters (and one '...')")
        if len(t) != op.ndim:
            raise RuntimeError(f"einsum(): the number of subscripts in the equation "
                               f"({len(t)}) does not match the number of dimensions "
                               f"({op.ndim}) for operand {len(labels)}")
        labels.append(t)
    if arrow:
        out = out.replace("...", ell)
        if len(set(out)) != len(out) or not builtins.all(c.isalpha() for c in out):
            raise RuntimeError(f"einsum(): invalid output subscripts in {equation!r}")
        missing = set(out) - set("".join(labels))
        if missing:
            raise RuntimeError(f"einsum(): output subscript {sorted(missing)[0]} does not "
                               "appear in the equation for any input operand")
    else:  # implicit output: the ellipsis, then every label used once, sorted
        counts = collections.Counter("".join(labels))
        out = ell + "".join(sorted(c for c in counts if counts[c] == 1 and c not in ell))
    return labels, out


@all_or_nothing
def einsum(equation, *operands):
    """Einstein summation, as torch.einsum: products, batched products, traces, diagonals,
    outer products and sums over indices (``'ij,jk->ik'``, ``'bij,bjk->bik'``, ``'ii'``,
    ``'i,j->ij'``, ``'...ij->...i'``). Operands are contracted left to right through
    reshape, permute, matmul and sum, so every derivative order works.

    >>> a = tapegrad.tensor([[1., 2.], [3., 4.]])
    >>> tapegrad.einsum("ii", a).item()
    5.0
    """
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    operands = [_t(o, f"operand {i}") for i, o in enumerate(operands)]
    if not operands:
        raise RuntimeError("einsum(): must provide at least one operand")
    labels, out = _einsum_parse(equation, operands)
    sizes = {}
    for lab, op in zip(labels, operands):
        for c, n in zip(lab, op.shape):
            if sizes.setdefault(c, n) != n:
                raise RuntimeError(f"einsum(): subscript {c} has size {n} for an operand "
                                   f"which does not match the previously seen size "
                                   f"{sizes[c]}")
    terms = []
    for lab, op in zip(labels, operands):
        # a label repeated within one operand takes the diagonal
        while len(set(lab)) < len(lab):
            c = next(c for c in lab if lab.count(c) > 1)
            p, q = lab.index(c), lab.index(c, lab.index(c) + 1)
            rest = [i for i in range(len(lab)) if i not in (p, q)]
            op = permute(op, tuple(rest + [p, q]))
            ar = np.arange(sizes[c])
            op = getitem(op, (slice(None),) * len(rest) + (ar, ar))
            lab = "".join(lab[i] for i in rest) + c
        terms.append((lab, op))

    la, a = terms[0]
    for k in range(1, len(terms)):
        lb, b = terms[k]
        keep = set(out).union(*[set(t[0]) for t in terms[k + 1:]])  # needed after this pair
        # labels only in a or only in b and needed nowhere else are summed first
        others_a = set(lb) | keep
        drop = [i for i, c in enumerate(la) if c not in others_a]
        if drop:
            a, la = sum(a, tuple(drop)), "".join(c for c in la if c in others_a)
        others_b = set(la) | keep
        drop = [i for i, c in enumerate(lb) if c not in others_b]
        if drop:
            b, lb = sum(b, tuple(drop)), "".join(c for c in lb if c in others_b)
        batch = [c for c in la if c in lb and c in keep]
        contr = [c for c in la if c in lb and c not in keep]
        only_a = [c for c in la if c not in lb]
        only_b = [c for c in lb if c not in la]
        a = permute(a, tuple(la.index(c) for c in batch + only_a + contr))
        b = permute(b, tuple(lb.index(c) for c in batch + contr + only_b))

        def size(cs):
            return int(np.prod([sizes[c] for c in cs], dtype=np.int64))
        prod = matmul(reshape(a, (size(batch), size(only_a), size(contr))),
                      reshape(b, (size(batch), size(contr), size(only_b))))
        la = "".join(batch + only_a + only_b)
        a = reshape(prod, tuple(sizes[c] for c in la))
    drop = [i for i, c in enumerate(la) if c not in out]
    if drop:
        a, la = sum(a, tuple(drop)), "".join(c for c in la if c in out)
    if la != out:
        a = permute(a, tuple(la.index(c) for c in out))
    return a


def _lgamma_np(x):
    x = np.asarray(x, dtype=np.float64)
    pole = (x <= 0) & (x == np.floor(x))  # math.lgamma raises there; torch gives inf
    return np.where(pole, np.inf, np.vectorize(math.lgamma, otypes=[np.float64])(
        np.where(pole | ~np.isfinite(x), 1.0, x))) + np.where(np.isfinite(x), 0, np.abs(x))


# Bernoulli numbers B_2k for the asymptotic series of the polygamma functions
_BERNOULLI = (1 / 6, -1 / 30, 1 / 42, -1 / 30, 5 / 66, -691 / 2730, 7 / 6, -3617 / 510)


def _polygamma_np(n, x):
    """psi^(n)(x) for x > 0: shift x past 12 by the recurrence, then the asymptotic series
    (relative error under 1e-15 there)."""
    x = np.array(x, dtype=np.float64)
    acc = np.zeros_like(x)
    fact = math.factorial(n)
    while True:
        small = x < 12
        if not small.any():
            break
        # psi^(n)(x) = psi^(n)(x + 1) - (-1)^n n! / x^(n+1)
        acc = np.where(small, acc - (-1) ** n * fact / x ** (n + 1), acc)
        x = np.where(small, x + 1, x)
    if n == 0:
        s = np.log(x) - 1 / (2 * x)
        for k, b in enumerate(_BERNOULLI, 1):
            s = s - b / (2 * k * x ** (2 * k))
    else:
        s = math.factorial(n - 1) / x ** n + fact / (2 * x ** (n + 1))
        for k, b in enumerate(_BERNOULLI, 1):
            s = s + b * math.factorial(2 * k + n - 1) / (math.factorial(2 * k)
                                                          * x ** (2 * k + n))
        s = (-1) ** (n + 1) * s
    return acc + s


def _gamma_function(n):
    """lgamma (n = -1) or polygamma n as a custom Function whose backward is the next one,
    so every derivative order is available."""
    from .autograd.function import Function
    cache = _GAMMA_FNS

    if n in cache:
        return cache[n]

    class _Gamma(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            d = np.asarray(x._d, dtype=np.float64)
            return tensor(_lgamma_np(d) if n < 0 else _polygamma_np(n, d))

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * _gamma_function(n + 1).apply(x)
    cache[n] = _Gamma
    return _Gamma


_GAMMA_FNS = {}


def special_multigammaln(input, p):
    """``tapegrad.special.multigammaln``: log of the multivariate gamma function of
    dimension ``p``, elementwise (defined for elements above (p - 1) / 2; below, like
    torch, the sum of log|Gamma| terms).

    >>> round(tapegrad.special.multigammaln(tapegrad.tensor(2.5), 3).item(), 6)
    1.880995
    """
    input = _float_input(_t(input), "multigammaln")
    if not isinstance(p, numbers.Integral) or p < 1:
        raise RuntimeError(f"multigammaln: p has to be greater than or equal to 1, got {p}")
    lg = _gamma_function(-1)
    terms = [lg.apply(input - j / 2) for j in range(p)]
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total + p * (p - 1) / 4 * math.log(math.pi)


Tensor.repeat_interleave = _method(repeat_interleave)
Tensor.cross = lambda self, other, dim=None: cross(self, other, dim)


#: public but outside ``__all__`` (as in torch's top-level namespace, these are not ops)
_EXTRAS = ("argsort", "equal", "index_add", "mm", "sort", "cross", "einsum", "empty",
           "repeat_interleave")
__all__ = list(_LISTED)


def public():
    """{name: function} for the ``tapegrad`` namespace: ``__all__``, the ops' aliases and the
    extras."""
    return {**_PUBLIC, **{n: globals()[n] for n in _EXTRAS}}


# --- sorting, matrix products, comparisons, index_add (built from recorded ops) ----------------

_sort_result = collections.namedtuple("sort", ["values", "indices"])


def _sort_indices(a, d, descending):
    """Stable sort indices along ``d``; NaN sorts as the largest value, as in torch."""
    if not descending:
        return np.argsort(a, axis=d, kind="stable")
    n = a.shape[d]
    rev = np.flip(a, axis=d)  # ties keep their order: sort the reversed array, then flip
    return (n - 1) - np.flip(np.argsort(rev, axis=d, kind="stable"), axis=d)


def _guard_order(x, idx, d, descending, what):
    """While tracing, ``idx`` (the order of traced ``x`` along ``d``) is baked into the
    program: guard that it is still the stable sorted order at replay (each neighbour pair
    in order, ties only in index order), so another order raises GuardError instead of
    replaying a wrong permutation. Where that cannot be checked (NaN), guard the values."""
    tr = STATE.trace
    if tr is None or not tr.traced(x) or x.shape[d] < 2:
        return
    n = x.shape[d]
    v = getitem(x, _along(idx, d))
    lo = getitem(v, (slice(None),) * d + (slice(0, n - 1),))
    hi = getitem(v, (slice(None),) * d + (slice(1, n),))
    ilo = np.take(idx, np.arange(n - 1), axis=d)
    ihi = np.take(idx, np.arange(1, n), axis=d)
    tie_ok = _plain(ilo < ihi)
    ok = ((hi < lo) if descending else (lo < hi)) | ((lo == hi) & tie_ok)
    if builtins.bool(np.all(np.asarray(ok._d))):
        builtins.bool(ok.all())  # bool() of a traced truth value records the guard
    else:
        tr.on_escape(x, what)


def _along(idx, d):
    """An advanced index picking ``idx`` (same shape as the input) along dim ``d``."""
    grids = list(np.indices(idx.shape, sparse=True))
    grids[d] = idx
    return tuple(grids)


def sort(input, dim=-1, descending=False, stable=False):
    """(values, indices) sorted along ``dim``; the values are differentiable (their gradient
    goes back to where each value came from). Ties keep their order (a stable sort), where
    torch's unstable sort may order tied indices otherwise."""
    x = _t(input)
    if x.ndim == 0:
        return _sort_result(_hint(clone(x), "SortBackward0") if x._rg else clone(x),
                            _plain(np.asarray(0, dtype=np.int64)))
    d = _dim(dim, x.ndim)
    a = np.asarray(x._d)
    idx = _sort_indices(a, d, descending)
    _guard_order(x, idx, d, descending, "sort()")
    values = _hint(getitem(x, _along(idx, d)), "SortBackward0")
    return _sort_result(values, _plain(idx.astype(np.int64)))


def argsort(input, dim=-1, descending=False, stable=False):
    """Indices that sort ``input`` along ``dim`` (int64; ties in order)."""
    x = _t(input)
    if x.ndim == 0:
        return _plain(np.asarray(0, dtype=np.int64))
    d = _dim(dim, x.ndim)
    idx = _sort_indices(np.asarray(x._d), d, descending)
    _guard_order(x, idx, d, descending, "argsort()")
    return _plain(idx.astype(np.int64))


def mm(input, mat2):
    """Matrix product of two 2-D tensors (``matmul`` restricted to matrices, as torch)."""
    x, y = _t(input), _t(mat2, "mat2")
    if x.ndim != 2:
        raise RuntimeError(f"self must be a matrix (mm needs 2-D tensors), got {x.ndim}-D")
    if y.ndim != 2:
        raise RuntimeError(f"mat2 must be a matrix (mm needs 2-D tensors), got {y.ndim}-D")
    if x.shape[1] != y.shape[0]:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({x.shape[0]}x"
                           f"{x.shape[1]} and {y.shape[0]}x{y.shape[1]})")
    return matmul(x, y)


def equal(input, other):
    """True when both tensors have the same shape and elements (NaN is unequal)."""
    x, y = _t(input), _t(other, "other")
    if x.shape != y.shape:
        return False
    tr = STATE.trace
    if tr is not None and (tr.traced(x) or tr.traced(y) or tr.ref(x) is not None
                           or tr.ref(y) is not None):
        return builtins.bool((x == y).all())  # a guard: replay checks the answer holds
    return builtins.bool(np.array_equal(np.asarray(x._d), np.asarray(y._d)))


def _index_added(self, dim, index, source, alpha):
    """``self`` with ``alpha * source`` added at ``index`` along ``dim`` (repeats add up),
    recorded as ``self + index_scatter(...)`` so every order of derivative follows."""
    x = _t(self, "self")
    d = _dim(dim, builtins.max(x.ndim, 1))
    if not isinstance(index, Tensor) or np.asarray(index._d).dtype.kind not in "iu" \
            or index.ndim > 1:
        raise IndexError("index_add_(): index must be a 1-D tensor of integers (int64), got "
                         f"{index if not isinstance(index, Tensor) else index.dtype}")
    src = _tn(source, "source")
    if not isinstance(src, Tensor):
        raise TypeError(f"index_add_(): source must be a Tensor, got {type(source).__name__}")
    idx = np.asarray(index._d).reshape(-1).astype(np.int64)
    shape = x.shape
    want = shape[:d] + (len(idx),) + shape[d + 1:] if x.ndim else (len(idx),)
    if tuple(src.shape if src.ndim else (1,) * builtins.max(x.ndim, 1)) != tuple(want) \
            and not (x.ndim == 0 and src.numel() == len(idx) == 1):
        raise RuntimeError(f"index_add_(): source has shape {list(src.shape)}; it must be "
                           f"the shape of self with dim {d} of size len(index) = {list(want)}")
    n = shape[d] if x.ndim else 1
    if idx.size and (idx.min() < 0 or idx.max() >= n):  # torch takes no negative index
        raise IndexError(f"index_add_(): index out of range for dimension {d} of size {n}")
    if x.ndim == 0:  # index is [0] or [], source a single value
        return src.reshape(()) * alpha if len(idx) else zeros_like_t(x)
    nidx = (slice(None),) * d + (idx,)
    scaled = src if alpha == 1 else src * alpha
    if scaled.dtype is not x.dtype:
        scaled = _to_dtype(scaled, x.dtype.np)
    z = np.zeros(shape, dtype=x.dtype.np)
    np.add.at(z, nidx, np.asarray(scaled._d))
    return array_op(_O["index_scatter"], [scaled], z, (nidx, tuple(shape), False))


def zeros_like_t(x):
    return _plain(np.zeros(x.shape, x.dtype.np)) if x.ndim else _plain(0.0)


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
