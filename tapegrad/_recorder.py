"""The eager recorder: elementwise, array and cast ops computed and put on the tape."""
from __future__ import annotations

import numbers

import numpy as np

from ._dtypes import _F64, _cat, _pybool, _pyfloat, _pyint, promote_types
from ._tensor_class import Tensor, _hint, _norm_value, _plain
from .ops import ARRAY, BY_NAME, UNARY_C, const_ops
from .ops.elementwise import POWC_SPECIAL
from .ops._kernels import ADD, MUL, SUB, rows_op
from .tape import STATE, current_tape


def _record(code, x, y, c0, c1, value, aux=None):
    """Append one entry (inputs ``x``, ``y`` or None) and return its output tensor."""
    tape = STATE.tape()
    if tape is None or len(tape.vals) >= tape.limit:
        tape = current_tape()
    sid = tape.sid
    a = x._slot if x._sid == sid else tape.enter(x)
    if y is None:
        b = -1
    else:
        b = y._slot if y._sid == sid else tape.enter(y)
    if value.__class__ is _pyfloat:
        vals = tape.vals
        k = len(vals)
        vals.append(value)
        tape.code += (code, k - a, 0 if b < 0 else k - b, c0, c1)
        if aux is not None:
            tape.aux[k] = aux
    else:
        k = tape.append(code, a, b, c0, c1, value, aux)
    t = Tensor()
    t._d = value
    t._rg = True
    t._tape = tape
    t._sid = sid
    t._slot = k
    if value.__class__ is not _pyfloat:
        t._ver = [0]
    return t


def _record_nary(op, inputs, value, aux_rest):
    tape = current_tape()
    sid = tape.sid
    slots = [t._slot if t._sid == sid else tape.enter(t) for t in inputs]
    k = tape.append(op.code | ARRAY, -1, -1, 0.0, 0.0, value, (slots,) + aux_rest)
    tape.nary.append(k)
    t = Tensor()
    t._d, t._rg, t._tape, t._sid, t._slot = value, True, tape, sid, k
    if value.__class__ is not _pyfloat:
        t._ver = [0]
    return t


def _errstate():
    return np.errstate(all="ignore")


try:  # NumPy 2: errstate sets a context variable; setting it directly costs a tenth
    from numpy._core._ufunc_config import _extobj_contextvar, _make_extobj
    _QUIET = _make_extobj(all="ignore")

    def quiet(f, *args):
        """``f(*args)`` with NumPy's floating-point warnings off (torch warns of none)."""
        token = _extobj_contextvar.set(_QUIET)
        try:
            return f(*args)
        finally:
            _extobj_contextvar.reset(token)
except (ImportError, AttributeError, TypeError):  # NumPy 1.x
    def quiet(f, *args):
        """``f(*args)`` with NumPy's floating-point warnings off (torch warns of none)."""
        with np.errstate(all="ignore"):
            return f(*args)


# ops that keep an integer tensor integer (the rest compute in the default float dtype)
_INT_PRESERVING = frozenset(("neg", "abs", "sign", "square", "clone", "addc", "mulc", "rsubc",
                             "clamp", "relu"))


def _bool_error(exc, msg):
    def f(d):
        raise exc(msg)
    return f


# torch's results on a bool tensor where they are not "compute in the default float dtype"
_BOOL_RULES = {
    "neg": _bool_error(RuntimeError, "Negation, the `-` operator, on a bool tensor is not "
                       "supported. If you are trying to invert a mask, use the `~` or "
                       "`logical_not()` operator instead."),
    "relu": _bool_error(RuntimeError, "Boolean inputs not supported for relu"),
    "abs": _bool_error(NotImplementedError, "\"abs_cpu\" not implemented for 'Bool'"),
    "sign": lambda d: d.copy(),
    "square": lambda d: d.astype(np.int64),
}


def unary(op, x, c0=0.0, c1=0.0):
    """Apply elementwise ``op`` to tensor ``x`` (constants ``c0``, ``c1`` for unary_c ops)."""
    d = x._d
    if d.__class__ is _pyfloat:
        v = op.py(d, c0, c1) if op.kind == UNARY_C else op.py(d)
        if x._rg and STATE.grad_enabled:
            return _record(op.code, x, None, c0, c1, v)
        if STATE.trace is not None:  # a traced comparison's result, say: recorded
            return STATE.trace.plain_op(lambda a: unary(op, a, c0, c1), (x,), _plain(v))
        return _plain(v)
    if d.__class__ is np.ndarray and d.dtype is _F64 and op.kind != UNARY_C:
        # a float64 array (lstm's gates on vectors of 14): none of the conversions below
        v = quiet(op.np, d)
        if v.__class__ is np.ndarray and v.dtype is _F64 and v.ndim and STATE.trace is None:
            if x._rg and STATE.grad_enabled:
                return _record(op.code | ARRAY, x, None, c0, c1, v)
            return _plain(v)
    else:
        if d.dtype.kind == "b" and op.name in _BOOL_RULES:
            return _plain(_BOOL_RULES[op.name](d))
        if d.dtype.kind != "f" and not (
                op.name in _INT_PRESERVING and d.dtype.kind in "iu"
                or op.name == "clone" and d.dtype.kind == "b"):
            d = d.astype(np.float64)  # e.g. exp of an integer tensor is floating, as in torch
        # quiet: NumPy's warnings off through its context variable, a tenth of an errstate
        v = quiet(op.np, d, c0, c1) if op.kind == UNARY_C else quiet(op.np, d)
    v = _norm_value(v)
    if v.__class__ is not _pyfloat and v.dtype != d.dtype and d.dtype.kind == "f":
        v = v.astype(d.dtype)
    if x._rg and STATE.grad_enabled:
        return _record(op.code | ARRAY, x, None, c0, c1, v)
    if STATE.trace is not None:
        return STATE.trace.plain_op(lambda a: unary(op, a, c0, c1), (x,), _plain(v))
    return _plain(v)


def array_op(op, inputs, value, aux):
    """Wrap ``value``, the forward of array op ``op`` on ``inputs``, recording when needed."""
    value = _norm_value(value)
    if STATE.grad_enabled:
        for t in inputs:
            if t._rg:
                if op.nary:
                    return _record_nary(op, inputs, value, aux)
                return _record(op.code | ARRAY, inputs[0],
                               inputs[1] if len(inputs) > 1 else None, 0.0, 0.0, value, aux)
    if STATE.trace is not None:  # e.g. the count of a traced mask: recorded
        return STATE.trace.plain_op(lambda *ins: array_op(op, list(ins), value, aux), inputs,
                                    _plain(value))
    return _plain(value)


# binary ops with a float-constant variant (each op's ``const`` in the registry): name ->
# (x op c, c op x) as (op, sign of c)
_CONST_OPS = const_ops()
_NUMBER = (_pyfloat, _pyint, _pybool)
_CAST = BY_NAME["cast"]
_ADDC = BY_NAME["addc"]
_POW, _POWC, _POWC_SPECIAL = BY_NAME["pow"], BY_NAME["powc"], BY_NAME["powc_special"]


def _const_op(cop, c):
    """The constant form ``cop`` of a binary op recorded for constant ``c``: ``x ** c`` is
    ``powc_special`` for the exponents torch computes otherwise (``ops.elementwise``)."""
    return _POWC_SPECIAL if cop is _POWC and c in POWC_SPECIAL else cop


def _addc_name(r, op, c):
    """``x + c`` and ``x - c`` record one op (``addc``), named by the sign of its constant
    ``c``; hint torch's name where that sign says otherwise (``x + (-2.0)``, ``x - 0.0``)."""
    if (c < 0) != (op.name == "sub"):
        _hint(r, "SubBackward0" if op.name == "sub" else "AddBackward0")
    return r
_NUM_FAST = (_pyfloat, _pyint)  # a bool operand takes the slow path (bool - x raises)


def result_dtype(*operands):
    """torch.result_type: dimensioned tensors win over 0-d ones and Python numbers of the
    same category; a 0-d tensor of a higher category gives its dtype, a Python number of a
    higher category the default dtype of its category (float64: tapegrad's default)."""
    dims = zeros = None
    num_cat = -1
    for o in operands:
        if o.__class__ is Tensor:
            d = o._d
            if d.__class__ is _pyfloat:
                zeros = _F64 if zeros is None else promote_types(zeros, _F64)
            elif d.ndim:
                dims = d.dtype if dims is None else promote_types(dims, d.dtype)
            else:
                zeros = d.dtype if zeros is None else promote_types(zeros, d.dtype)
        elif isinstance(o, _pybool):
            num_cat = max(num_cat, 0)
        elif isinstance(o, numbers.Integral):
            num_cat = max(num_cat, 1)
        elif isinstance(o, numbers.Complex) and not isinstance(o, numbers.Real):
            num_cat = 3
        else:
            num_cat = max(num_cat, 2)
    r = dims
    if zeros is not None and (r is None or _cat(zeros) > _cat(r)):
        r = zeros
    if num_cat >= 0 and (r is None or num_cat > _cat(r)):
        if num_cat == 3 and r is not None and r.kind == "f":
            r = np.result_type(r, np.complex64)  # float32 with 1j: complex64, as torch
        else:
            r = (np.dtype(np.bool_), np.dtype(np.int64), _F64, np.dtype(np.complex128))[num_cat]
    return r


def _to_tensor(y, like=None):
    if y.__class__ is Tensor or isinstance(y, Tensor):
        return y
    if isinstance(y, (np.ndarray, list, tuple)) or isinstance(y, np.generic):
        from ._factories import tensor  # the factories sit above the recorder
        return tensor(y)
    raise TypeError(f"unsupported operand type: {type(y).__name__}; expected a Tensor, a "
                    "Python number or a NumPy array")


def _plain_s(v):
    t = Tensor()
    t._d = v
    t._rg = False
    t._tape = None
    t._sid = -1
    t._slot = -1
    return t


def _rec_s(code, x, y, c0, v):
    """``_record`` for the hot path: scalar entry, float value, no aux."""
    tape = STATE.tape()
    if tape is None or len(tape.vals) >= tape.limit:
        tape = current_tape()
    sid = tape.sid
    a = x._slot if x._sid == sid else tape.enter(x)
    b = -1 if y is None else (y._slot if y._sid == sid else tape.enter(y))
    vals = tape.vals
    k = len(vals)
    vals.append(v)
    tape.code += (code, k - a, 0 if b < 0 else k - b, c0, 0.0)
    t = Tensor()
    t._d = v
    t._rg = True
    t._tape = tape
    t._sid = sid
    t._slot = k
    return t


_FLOAT_ONLY = frozenset(("div", "pow", "atan2"))


def binary(op, x, y):
    """Apply elementwise binary ``op`` (x, y: tensors or Python numbers; one a tensor)."""
    xc, yc = x.__class__, y.__class__
    if xc is Tensor and yc is Tensor:
        xd, yd = x._d, y._d
        if xd.__class__ is _pyfloat and yd.__class__ is _pyfloat:
            v = op.py(xd, yd)
            if STATE.grad_enabled and (x._rg or y._rg):
                return _record(op.code, x, y, 0.0, 0.0, v)
            return _plain(v)
    elif xc is Tensor and yc in _NUM_FAST:
        xd = x._d
        if xd.__class__ is _pyfloat:
            # (x ** c: torch's pow(x, c), powc's forward, as the operator's)
            v = op.py(xd, _pyfloat(y)) if op is not _POW else _POWC.py(xd, _pyfloat(y), 0.0)
            if x._rg and STATE.grad_enabled:
                forms = _CONST_OPS.get(op.name)
                if forms is not None:
                    cop, sgn = forms[0]
                    if cop is _ADDC:
                        return _addc_name(_record(cop.code, x, None, sgn * y, 0.0, v), op,
                                          sgn * y)
                    return _record(_const_op(cop, y).code, x, None, sgn * y, 0.0, v)
                return _record(op.code, x, _plain(_pyfloat(y)), 0.0, 0.0, v)
            return _plain(v)
    elif yc is Tensor and xc in _NUM_FAST:
        yd = y._d
        if yd.__class__ is _pyfloat:
            v = op.py(_pyfloat(x), yd)
            if y._rg and STATE.grad_enabled:
                forms = _CONST_OPS.get(op.name)
                if forms is not None:
                    cop, sgn = forms[1]
                    if cop is _ADDC:
                        return _addc_name(_record(cop.code, y, None, sgn * x, 0.0, v), op,
                                          sgn * x)
                    return _record(cop.code, y, None, sgn * x, 0.0, v)
                return _record(op.code, _plain(_pyfloat(x)), y, 0.0, 0.0, v)
            return _plain(v)
    return _binary_general(op, x, y)


_ND = np.ndarray
# ops with a compiled pass for an operand broadcast along the innermost axis (rows_op)
_ROWS = {BY_NAME["add"]: ADD, BY_NAME["sub"]: SUB, BY_NAME["mul"]: MUL}


def _binary_general(op, x, y):
    xv = x._d if x.__class__ is Tensor else x
    yv = y._d if y.__class__ is Tensor else y
    xc, yc = xv.__class__, yv.__class__
    # fast path: float arrays of one dtype, or a float64 array beside a Python number
    if xc is _ND and xv.dtype.kind == "f" and (
            (yc is _ND and yv.dtype is xv.dtype)
            or (yc in _NUM_FAST and (xv.dtype is _F64 or y.__class__ is not Tensor))) \
            or yc is _ND and yv.dtype.kind == "f" and xc in _NUM_FAST and (
                yv.dtype is _F64 or x.__class__ is not Tensor):
        v = None
        if xc is _ND and yc is _ND and (xv.size >= 4096 or yv.size >= 4096) and op in _ROWS:
            v = rows_op(_ROWS[op], xv, yv)  # (kmeans' P[None] - C[:, :, None]: NumPy's bits)
        if v is None:
            try:
                v = quiet(op.np, xv, yv)  # torch gives inf and nan quietly
            except ValueError:
                return _binary_slow(op, x, y)
        if v.ndim == 0:
            return _binary_slow(op, x, y)
        if x.__class__ is Tensor and y.__class__ is Tensor and (x._rg or y._rg) \
                and STATE.grad_enabled:  # two tensors: _record_binary's last case, direct
            return _record(op.code | ARRAY, x, y, 0.0, 0.0, v)
        return _record_binary(op, x, y, v)
    return _binary_slow(op, x, y)


def _record_binary(op, x, y, v):
    """Wrap array result ``v`` of binary ``op`` (x, y: tensors or Python numbers), recording
    it when grad is on; a Python-number operand becomes the op's constant form."""
    xr = x.__class__ is Tensor and x._rg
    yr = y.__class__ is Tensor and y._rg
    if not ((xr or yr) and STATE.grad_enabled):
        if STATE.trace is not None:
            return STATE.trace.plain_op(lambda a, b: _record_binary(op, a, b, v),
                                        (x, y), _plain(v))
        return _plain(v)
    forms = _CONST_OPS.get(op.name)
    # a 0-d float64 result of a 0-d float64 operand (``True / x``) is a scalar entry: its
    # rule on Python floats as an array entry's raised ZeroDivisionError where torch's inf
    scalar = v.__class__ is _pyfloat
    if not yr and forms is not None and y.__class__ in _NUMBER:
        cop, sgn = forms[0]
        cop = _const_op(cop, y)
        code = cop.code if scalar and x._d.__class__ is _pyfloat else cop.code | ARRAY
        r = _record(code, x, None, sgn * _pyfloat(y), 0.0, v)
        return _addc_name(r, op, sgn * _pyfloat(y)) if cop is _ADDC else r
    if not xr and forms is not None and x.__class__ in _NUMBER:
        cop, sgn = forms[1]
        code = cop.code if scalar and y._d.__class__ is _pyfloat else cop.code | ARRAY
        r = _record(code, y, None, sgn * _pyfloat(x), 0.0, v)
        return _addc_name(r, op, sgn * _pyfloat(x)) if cop is _ADDC else r
    return _record(op.code | ARRAY, _as_operand(x), _as_operand(y), 0.0, 0.0, v)


def binary_fallback(op, x, y):
    """Binary ``op`` on anything but two 0-d float64 values (NotImplemented for foreign
    types, so Python can try the reflected operator)."""
    if (x.__class__ is Tensor or x.__class__ in _NUMBER) and \
            (y.__class__ is Tensor or y.__class__ in _NUMBER):
        return _binary_general(op, x, y)
    try:
        x = x if isinstance(x, Tensor) or x.__class__ in _NUMBER else _operand(x)
        y = y if isinstance(y, Tensor) or y.__class__ in _NUMBER else _operand(y)
    except TypeError:
        if isinstance(x, complex) or isinstance(y, complex):
            _complex_error(op, x, y)
        return NotImplemented
    return binary(op, x, y)


def _complex_error(op, x, y):
    z = x if isinstance(x, complex) else y
    raise TypeError(f"{op.torch or op.name}() with the complex number {z!r}: complex tensors "
                    "are not supported by tapegrad yet; use real numbers (float64 or float32)")


def _kind(x):
    """NumPy dtype kind of a binary op's operand (a tensor or a Python number)."""
    if x.__class__ is Tensor:
        d = x._d
        return "f" if d.__class__ is _pyfloat else d.dtype.kind
    return "b" if x.__class__ is _pybool else "i" if isinstance(x, numbers.Integral) else "f"


def _operand(x):
    if isinstance(x, numbers.Real):
        return x.item() if isinstance(x, np.generic) else _pyfloat(x)
    if isinstance(x, (np.ndarray, list, tuple)):
        return _to_tensor(x)
    raise TypeError(f"unsupported operand type: {type(x).__name__}")


def unary_fallback(op, x):
    if not isinstance(x, Tensor):
        raise TypeError(f"{op.torch or op.name}(): argument 'input' must be a Tensor, not "
                        f"{type(x).__name__}")
    return unary(op, x)


def _as_operand(x):
    return _plain_s(_pyfloat(x)) if x.__class__ in _NUMBER else x


def _binary_slow(op, x, y):
    if isinstance(x, complex) or isinstance(y, complex):
        _complex_error(op, x, y)
    if x.__class__ not in _NUMBER:
        x = _to_tensor(x)
    if y.__class__ not in _NUMBER:
        y = _to_tensor(y)
    rd = result_dtype(x, y)
    if op.name == "sub" and "b" in (_kind(x), _kind(y)):
        if _kind(x) == _kind(y):
            raise RuntimeError("Subtraction, the `-` operator, with two bool tensors is not "
                               "supported. Use the `^` or `logical_xor()` operator instead.")
        raise RuntimeError("Subtraction, the `-` operator, with a bool tensor is not "
                           "supported. If you are trying to invert a mask, use the `~` or "
                           "`logical_not()` operator instead.")
    if op.name == "pow" and rd.kind == "b":
        if x.__class__ is not Tensor or y.__class__ is Tensor:
            raise NotImplementedError("\"pow\" not implemented for 'Bool'")
        # bool tensor ** bool: x ** True is x, x ** False is True (torch keeps bool)
        v = np.asarray(x._d) if y else np.ones(np.shape(x._d), dtype=np.bool_)
        return _record_binary(op, x, y, np.array(v, dtype=np.bool_))
    if op.name in _FLOAT_ONLY and rd.kind != "f" and not (op.name == "pow" and rd.kind in "iu"):
        rd = _F64
    if op.name == "pow" and rd.kind in "iu":
        yv = y._d if y.__class__ is Tensor else y
        if np.any(np.asarray(yv) < 0):
            raise RuntimeError("Integers to negative integer powers are not allowed.")
    if rd.kind == "c":
        raise TypeError("complex tensors are not supported by tapegrad yet")
    xv = x._d if x.__class__ is Tensor else x
    yv = y._d if y.__class__ is Tensor else y
    if rd.kind in "iu":  # a Python int wraps into the integer dtype (uint8 + -1), as torch's
        xv = _wrap_int(xv, rd) if xv.__class__ is _pyint else xv
        yv = _wrap_int(yv, rd) if yv.__class__ is _pyint else yv
    if xv.__class__ is not _pyfloat and isinstance(xv, np.ndarray) and xv.dtype != rd:
        xv = xv.astype(rd)
    if yv.__class__ is not _pyfloat and isinstance(yv, np.ndarray) and yv.dtype != rd:
        yv = yv.astype(rd)
    if rd != _F64 and (xv.__class__ is _pyfloat or yv.__class__ is _pyfloat):
        # a float64 scalar beside a float32 array keeps float32, like torch's 0-d rule
        xv = np.asarray(xv, dtype=rd) if xv.__class__ is _pyfloat and x.__class__ is Tensor \
            else xv
        yv = np.asarray(yv, dtype=rd) if yv.__class__ is _pyfloat and y.__class__ is Tensor \
            else yv
    try:
        with np.errstate(all="ignore"):
            v = op.np(xv, yv)
    except ValueError as e:
        raise RuntimeError(
            f"The size of tensor a ({list(np.shape(xv))}) must match the size of tensor b "
            f"({list(np.shape(yv))}) for op '{op.name}': the shapes are not broadcastable "
            f"({e})") from None
    v = _norm_value(v)
    if v.__class__ is not _pyfloat and v.dtype != rd:
        v = v.astype(rd)
        v = _norm_value(v)
    if STATE.grad_enabled:
        # the op ran on its operands converted to its dtype, as torch's does: its rule must
        # read an input's value converted too (log of a float32 input of a float64 pow, a
        # float32 beside a float64 in maximum's tie test). A constant stays itself (a trace
        # follows it by identity; NumPy promotes it beside the gradient in the rule).
        if x.__class__ is Tensor and x._rg and x._d.__class__ is not _pyfloat \
                and x._d.dtype != rd:
            x = array_op(_CAST, [x], xv, (rd, x._d.dtype))
        if y.__class__ is Tensor and y._rg and y._d.__class__ is not _pyfloat \
                and y._d.dtype != rd:
            y = array_op(_CAST, [y], yv, (rd, y._d.dtype))
    return _record_binary(op, x, y, v)


def _wrap_int(v, rd):
    """Python int ``v`` as integer dtype ``rd``, wrapping as a C cast does (torch's rule)."""
    if not -(1 << 63) <= v < (1 << 64):
        raise OverflowError(f"int too big to convert: {v} does not fit in 64 bits")
    return np.array(v % (1 << 64), dtype=np.uint64).astype(rd)


def _to_dtype(x, nd):
    if x.dtype.np == nd:
        return x
    d = x._d
    if x._rg and nd.kind != "f":
        tr = STATE.trace
        if tr is not None:  # tracing: bool is x != 0, recorded; an int cast cannot be
            if nd.kind == "b":
                return x != 0
            return tr.untraceable(_plain(np.asarray(d).astype(nd)),
                                  f"a cast of a traced value to {nd}", x)
        return _plain(np.asarray(d).astype(nd))
    v = np.asarray(d).astype(nd)
    return array_op(BY_NAME["cast"], [x], v, (nd, np.asarray(d).dtype))
