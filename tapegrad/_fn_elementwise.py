"""Elementwise functions whose arguments need parsing (pow, clamp, where...) and arg checks."""
from __future__ import annotations

import math
import numbers

import numpy as np

from ._recorder import _NUMBER
from .ops import BY_NAME as _O
from .tape import STATE
from .tensor import (TORCH_NAMES, Tensor, _plain, _to_tensor, array_op, binary, result_dtype,
                     tensor, unary)

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
        if lo is not None and hi is not None and isinstance(lo, Tensor) and lo.requires_grad \
                and (STATE.trace is not None or np.any(
                    (np.asarray(x._d) < np.asarray(lo._d)) & (lo == hi)._d)):
            # torch's min gets its gradient only where min < max: an input below min ==
            # max gives it to nobody (the composed clamps gave it to min; crossed or NaN
            # bounds they give none either). Only where that happens (recorded always in
            # a trace, which replays at other values)
            lo = where(lo < hi, lo, lo.detach())
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
