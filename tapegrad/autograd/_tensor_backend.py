"""The tensor backend for derivative rules: ``F.<op>`` records ``op`` on the tape, so a rule
run with it (``create_graph=True``) yields gradients that can be differentiated again."""
from __future__ import annotations

import numpy as np

from .. import _generated_eager as _eager
from ..functions import where as _where
from ..ops import ARRAY, ARRAY_OP, BINARY, BY_NAME, OPS, UNARY, UNARY_C
from ..ops._kernels import _MIN_SIZE as _ROWS_MIN, MUL2 as _MUL2, _compact, \
    rows_op as _rows_op
from ..ops.arrays import sum_axes, sum_to
from ..tape import STATE
from ..tensor import Tensor, _norm_value, _plain, _pyfloat, _record, array_op, binary, quiet, unary

_WHERE = BY_NAME["where"]
_SUM_TO = BY_NAME["sum_to"]
_EXPAND = BY_NAME["expand"]
_MUL = BY_NAME["mul"].code | ARRAY
_isfinite = np.isfinite
# ops whose forward only moves values (a view or a copy): no arithmetic, no floating-point
# warning to silence, so their rule calls skip quiet() and the generic list building
_SHAPE_OPS = frozenset(("reshape", "expand", "getitem", "transpose", "permute"))
_F64 = np.dtype(np.float64)
_add_reduce = np.add.reduce


class _TensorF:
    def __repr__(self):
        return "<rule backend tensors>"


def _number_or_array(x):
    return x if isinstance(x, Tensor) else _plain(np.asarray(x, dtype=np.float64)
                                                  if not isinstance(x, float) else x)


def _unary(op):
    fast = getattr(_eager, op.name, None) if op.kind == UNARY else None

    def f(x, *consts):
        if x.__class__ is Tensor:
            return fast(x) if fast is not None else unary(op, x, *consts)
        if not isinstance(x, Tensor):  # a constant: compute it directly
            return op.np(np.asarray(x), *consts) if op.kind == UNARY_C else op.np(np.asarray(x))
        return unary(op, x, *consts)
    f.__name__ = op.name
    return f


def _binary(op):
    def f(x, y):
        if not isinstance(x, Tensor) and not isinstance(y, Tensor):
            return op.np(x, y)
        return binary(op, _operand(x), _operand(y))
    f.__name__ = op.name
    return f


def _operand(x):
    if isinstance(x, (Tensor, float, int)):
        return x
    return _plain(np.asarray(x))


def _array(op):
    code = op.code | ARRAY
    one = not op.nary

    def f(*args):
        if one and len(args) == 2 and args[0].__class__ is Tensor and STATE.trace is None:
            # one tensor input (getitem's rule, index_scatter): array_op's entry, direct
            x, aux = args
            v = quiet(op.np, x._d, aux)
            if v.__class__ is not np.ndarray or v.ndim == 0:
                v = _norm_value(v)
            if x._rg and STATE.grad_enabled:
                return _record(code, x, None, 0.0, 0.0, v, aux)
            return _plain(v)
        *values, aux = args
        tensors = [v if isinstance(v, Tensor) else _number_or_array(v) for v in values]
        v = quiet(op.np, *[t._d for t in tensors], aux)  # (errstate's cost, a tenth)
        return array_op(op, tensors, v, aux)
    f.__name__ = op.name
    return f


def _shape_op(op):
    """A shape op's rule call (``F.expand(g, aux)``), the hot ones of a create_graph sweep
    (a reduction's gradient broadcast back, a reshape): on a tensor outside a trace it is
    recorded directly, the same entry ``_array`` records without its generic steps."""
    generic, npf, code = _array(op), op.np, op.code | ARRAY
    if op.name == "expand":
        npf = _expand_np

    def f(x, aux):
        if x.__class__ is not Tensor or STATE.trace is not None:
            return generic(x, aux)
        v = npf(x._d, aux)
        if v.__class__ is not np.ndarray or v.ndim == 0:
            v = _norm_value(v)  # a 0-d float64 result is a Python float, as array_op makes it
        if x._rg and STATE.grad_enabled:
            return _record(code, x, None, 0.0, 0.0, v, aux)
        return _plain(v)
    f.__name__ = op.name
    return f


def _expand_np(d, aux):
    """expand's forward: the registry's (``arrays._expand``: a C-contiguous array's
    zero-stride view built directly), read-only for an array as ``np.broadcast_to``'s view
    is, and a float (a full reduction's gradient) viewed without an array first."""
    shape = aux[0]
    if d.__class__ is _pyfloat:  # a full reduction's gradient, as expand's own forward
        return np.ndarray(shape, _F64, np.array((d,)), 0, (0,) * len(shape))
    v = _EXPAND.np(d, aux)
    if d.__class__ is np.ndarray and v is not d and v.flags.writeable:
        v.flags.writeable = False  # (a 0-d array's view)
    return v


def _where_rule(c, x, y):
    if c is True or c is False or isinstance(c, np.bool_):
        return x if c else y
    if isinstance(c, Tensor) and c.ndim == 0:  # one sample: pick, as where's gradient does
        return x if c._d.item() else y
    if not isinstance(x, Tensor) and not isinstance(y, Tensor):
        return np.where(c._d if isinstance(c, Tensor) else c, x, y)
    if (c.__class__ is np.ndarray and c.dtype == np.bool_ and x.__class__ is Tensor
            and y.__class__ is float and x._d.__class__ is np.ndarray and x._d.dtype == _F64
            and STATE.trace is None):
        # where(mask, g, 0.0), max/min(dim)'s rule: where()'s entry without its checks and
        # conversions (most of its time here)
        v = np.where(c, x._d, y)
        if not (x._rg and STATE.grad_enabled):  # a constant gradient (a seed's): no entry
            return _plain(v)
        return array_op(_WHERE, [x, _plain(_pyfloat(y))], v,
                        (c if c.shape == v.shape else np.broadcast_to(c, v.shape),))
    return _where(c, _operand(x), _operand(y))


def _square_grad(g, x):
    """``x * x``'s gradient for an array ``x`` under a constant float64 ``g`` (a seed's
    gradient reaching the square: kmeans' first backward, any Hessian diagonal's) as one
    entry, ``mul(2g, x)``; None where that does not apply. Its value is the sweep's
    ``g*x + g*x`` (rows_op's MUL2 pass, or the two NumPy calls): the same bits. Its own
    gradient, ``h * 2g``, rounds the same product ``2hg`` as ``(h + h) * g`` (doubling is
    exact), so the next backward makes no ``h + h`` pass and runs no add rule. A ``g``
    not finite everywhere, or whose double overflows, takes the two entries (``inf * 0``
    would give NaN where ``g * 0 + g * 0`` gives 0)."""
    if g.__class__ is not Tensor or g._rg or STATE.trace is not None:
        return None
    d, xd = g._d, x._d
    if d.__class__ is not np.ndarray or xd.__class__ is not np.ndarray \
            or d.dtype is not _F64 or xd.dtype is not _F64 or d.shape != xd.shape \
            or not d.ndim:  # (a 0-d array's products are NumPy scalars: the two entries)
        return None
    if d.size >= _ROWS_MIN and 0 in d.strides:  # a large expanded g: its one copy doubled
        c = _compact(d)  # (one copy along each zero-stride axis, no generator)
        h, t = quiet(_double, c)
        h = np.ndarray(d.shape, _F64, h, 0, tuple([0 if st == 0 else hs for st, hs in
                                                   zip(d.strides, h.strides)]))
        h.flags.writeable = False  # (as expand's view)
        v = _rows_op(_MUL2, d, xd)
        if v is None:
            v = quiet(_twice_product, d, xd)
    else:
        h, t, v = quiet(_double_and_square, d, xd)
    if not t - t == 0.0:  # an inf or NaN in 2g (or a sum of it that overflows): the two
        return None
    return _record(_MUL, _plain(h), x, 0.0, 0.0, v)


def _double(c):
    h = c + c
    return h, float(_add_reduce(h, None))


def _twice_product(d, x):
    v = np.multiply(d, x)
    return np.add(v, v, out=v)


def _double_and_square(d, x):
    h = d + d
    v = np.multiply(d, x)
    return h, float(_add_reduce(h, None)), np.add(v, v, out=v)


def _fit(gr, like):
    """A gradient for a value shaped like ``like``: broadcasting summed away, same dtype."""
    if gr.__class__ is Tensor:
        d = gr._d
        if d.__class__ is _pyfloat and like.__class__ is _pyfloat:
            return gr  # the scalar path
        if d.__class__ is np.ndarray and like.__class__ is np.ndarray and \
                d.shape == like.shape and d.dtype == like.dtype:
            return gr  # already fits (most rules' gradients)
    if isinstance(gr, Tensor):
        if like.__class__ is _pyfloat:
            return gr if gr.shape == () else gr.sum()
        if gr.shape != like.shape:
            d = gr._d
            v = _sum_to_np(d, like.shape) if d.__class__ is np.ndarray else None
            if v is None:
                v = sum_to(np.asarray(d), like.shape)
            gr = array_op(_SUM_TO, [gr], v, (like.shape, gr.shape))
        d = gr._d
        if (d.dtype if d.__class__ is np.ndarray else gr.dtype.np) != like.dtype:
            gr = gr.to(like.dtype)  # (an array's dtype read directly: no dtype object)
        return gr
    if like.__class__ is _pyfloat:
        return _plain(float(np.sum(gr)))
    return _plain(np.array(np.broadcast_to(sum_to(np.asarray(gr, dtype=like.dtype), like.shape)
                                           if np.shape(gr) else gr, like.shape),
                           dtype=like.dtype))


def _sum_to_np(d, shape):
    """``sum_to(d, shape)`` by the same ``add.reduce`` call ``np.sum`` makes (same bits),
    without np.sum's wrapper and reshape steps; None where fast_sum's short-last-axis sum
    (its own order) may apply, or where ``shape`` has more dims than ``d``."""
    gs = d.shape
    if len(shape) > len(gs) or d.dtype is not _F64:
        return None
    axes = sum_axes(gs, shape)
    if not axes or gs[-1] <= 8 and len(gs) - 1 in axes:
        return None
    r = _add_reduce(d, axes, None, None, True)
    lead = len(gs) - len(shape)
    return r.reshape(shape) if lead else r


def _fit_batched(gr, like, B):
    """``_fit`` for a batch of adjoints: shaped (B,) + like's shape, broadcasting summed
    away behind the batch axis (with recorded ops, so it differentiates again)."""
    from ..interpreters.cpu import sum_axes, sum_to_batched
    target = (B,) + tuple(np.shape(like))
    dtype = np.dtype(np.float64) if like.__class__ is _pyfloat else np.asarray(like).dtype
    if not isinstance(gr, Tensor):
        g = sum_to_batched(np.asarray(gr, dtype=dtype), target)
        return _plain(np.array(np.broadcast_to(g, target), dtype=dtype))
    if gr.ndim == 0:  # a constant: the same for every seed
        gr = gr.expand(target)
    elif gr.shape != target:
        axes = sum_axes(gr.shape, target, 1)
        if axes:
            gr = gr.sum(dim=axes, keepdim=True)
        gr = gr.reshape(target)
    if gr.dtype.np != dtype:
        gr = gr.to(dtype)
    return gr


def build():
    F = _TensorF()
    for op in OPS:
        if op.kind in (UNARY, UNARY_C):
            setattr(F, op.name, _unary(op))
        elif op.kind == BINARY:
            setattr(F, op.name, _binary(op))
        elif op.kind == ARRAY_OP:
            setattr(F, op.name, _shape_op(op) if op.name in _SHAPE_OPS else _array(op))
    F.where = _where_rule
    F.cond = lambda c, x, y: x() if c else y()
    F.zeros_like = lambda x: 0.0
    F.raw = lambda x: x._d if isinstance(x, Tensor) else x
    F.fit = _fit
    F.square_grad = _square_grad
    F.fit_batched = _fit_batched
    return F


TensorF = build()
