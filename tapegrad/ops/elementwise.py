"""Elementwise ops: one scalar opcode each, swept compiled; arrays reuse the same rule."""
from __future__ import annotations

import math
import operator

import numpy as np

from ._registry import BINARY, SPECIAL, UNARY, UNARY_C, register

inf, nan = math.inf, math.nan

# --- Python-float forwards with torch's IEEE results instead of Python exceptions --------


def _guard(fn, on_error):
    def f(*args):
        try:
            return fn(*args)
        except (ValueError, OverflowError, ZeroDivisionError):
            return on_error(*args)
    f.__name__ = fn.__name__
    return f


def _log_err(a):
    return -inf if a == 0 else nan


def _div_err(a, b):
    if a != a or a == 0:
        return nan
    return math.copysign(inf, a) * math.copysign(1.0, b)


def _is_odd_int(b):
    return b == b and math.isfinite(b) and b == int(b) and int(b) % 2 == 1


def _pow_err(a, b):
    if a == 0:  # 0 ** negative
        return math.copysign(inf, a) if _is_odd_int(b) else inf
    if a != a or b != b:
        return nan
    if a < 0 and b != int(b):
        return nan
    # overflow
    if abs(a) > 1:
        mag = inf if b > 0 else 0.0
    else:
        mag = 0.0 if b > 0 else inf
    return -mag if (a < 0 and _is_odd_int(b)) else mag


def _py_pow(a, b):
    try:
        return math.pow(a, b)
    except (ValueError, OverflowError, ZeroDivisionError):
        return _pow_err(a, b)


def _np_pow(a, b):
    """``np.power``; a number exponent as torch's pow(x, c) (powc's forward: ``x ** 2`` as
    ``np.square``, the same values twice as fast)."""
    if b.__class__ is not np.ndarray:
        if b == 2:
            return np.square(a)
        return _np_powc(a, b)
    return np.power(a, b)


def _py_sigmoid(a):
    if a >= 0:
        return 1.0 / (1.0 + math.exp(-a))
    e = math.exp(a)
    return e / (1.0 + e)


def _np_sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


def _py_relu(a):  # torch's max(a, 0): a itself at 0 (-0.0 stays -0.0) and at NaN
    return 0.0 if a < 0 else a


def _np_relu(a):
    return np.where(a < 0, np.zeros_like(a), a)


def _py_sign(a):
    return float((a > 0) - (a < 0))  # sign(nan) is 0, as in torch


def _py_softplus(a, beta, threshold):
    if a * beta > threshold:
        return a
    return math.log1p(math.exp(a * beta)) / beta


def _np_softplus(a, beta, threshold):
    z = a * beta
    return np.where(z > threshold, a, np.log1p(np.exp(np.minimum(z, threshold))) / beta)


def _py_clamp(a, lo, hi):
    if a < lo:
        a = lo
    if a > hi:
        a = hi
    return a


def _np_clamp(a, lo, hi):
    # torch's min(max(a, lo), hi): a itself where it equals a bound (-0.0 clamped at 0.0
    # stays -0.0, as _py_clamp and the compiled rows), a NaN kept; np.maximum gave 0.0
    return np.clip(a, lo, hi)


def _py_maximum(a, b):
    return a if (a > b or a != a) else b


def _py_minimum(a, b):
    return a if (a < b or a != a) else b


_np_erf = None


def _np_erf_fn(a):
    global _np_erf
    if _np_erf is None:  # compiled on first use only
        from .._jit import vectorize_cached
        _np_erf = vectorize_cached(["float32(float32)", "float64(float64)"],
                                   lambda x: math.erf(x))
    return _np_erf(a)


def _safe(fn, err):
    return _guard(fn, err)


# --- bookkeeping entries ---------------------------------------------------------------------
# leaf: a tensor that requires grad, entered into this tape; const: a value that does not;
# import_: a value living on another tape (aux holds (tape, slot)); its rule is the identity.
register("leaf", SPECIAL, saves=False, doc="a leaf that requires grad",
         via="`tensor(..., requires_grad=True)`")
register("const", SPECIAL, saves=False, doc="a value that does not require grad",
         via="a tensor that does not require grad")
register("import_", SPECIAL, nb="{a}", vjp=lambda F, g, a, out: (g,), saves=False,
         doc="a value from another tape", via="a value from another tape")

# --- unary -------------------------------------------------------------------------------------
U = UNARY
register("neg", U, py=operator.neg, np=np.negative, nb="(-{a})", torch="neg",
         vjp=lambda F, g, a, out: (-g,), saves=False,
         api=("neg",), aliases=("negative",), method=True)
register("exp", U, py=_safe(math.exp, lambda a: inf), np=np.exp, nb="math.exp({a})",
         torch="exp", vjp=lambda F, g, a, out: (g * out,), api=("exp",), method=True)
register("log", U, py=_safe(math.log, _log_err), np=np.log, nb="math.log({a})", torch="log",
         vjp=lambda F, g, a, out: (g / a,), api=("log",), method=True)
register("log1p", U, py=_safe(math.log1p, lambda a: -inf if a == -1 else nan), np=np.log1p,
         nb="math.log1p({a})", torch="log1p", vjp=lambda F, g, a, out: (g / (a + 1.0),),
         api=("log1p",), method=True)
register("expm1", U, py=_safe(math.expm1, lambda a: inf), np=np.expm1, nb="math.expm1({a})",
         torch="expm1", vjp=lambda F, g, a, out: (g * (out + 1.0),), api=("expm1",), method=True)
register("sqrt", U, py=_safe(math.sqrt, lambda a: nan), np=np.sqrt, nb="math.sqrt({a})",
         torch="sqrt", vjp=lambda F, g, a, out: (g / (2.0 * out),), api=("sqrt",), method=True)
register("rsqrt", U, py=_safe(lambda a: 1.0 / math.sqrt(a),
                              lambda a: math.copysign(inf, a) if a == 0 else nan),
         np=lambda a: 1.0 / np.sqrt(a), nb="(1.0 / math.sqrt({a}))", torch="rsqrt",
         vjp=lambda F, g, a, out: (-0.5 * g * out * out * out,), api=("rsqrt",), method=True)
register("sin", U, py=_safe(math.sin, lambda a: nan), np=np.sin, nb="math.sin({a})",
         torch="sin", vjp=lambda F, g, a, out: (g * F.cos(a),), api=("sin",), method=True)
register("cos", U, py=_safe(math.cos, lambda a: nan), np=np.cos, nb="math.cos({a})",
         torch="cos", vjp=lambda F, g, a, out: (-g * F.sin(a),), api=("cos",), method=True)
register("tan", U, py=_safe(math.tan, lambda a: nan), np=np.tan, nb="math.tan({a})",
         torch="tan", vjp=lambda F, g, a, out: (g * (1.0 + out * out),), api=("tan",), method=True)
register("asin", U, py=_safe(math.asin, lambda a: nan), np=np.arcsin, nb="math.asin({a})",
         torch="asin", vjp=lambda F, g, a, out: (g / F.sqrt(1.0 - a * a),),
         api=("asin",), aliases=("arcsin",), method=True)
register("acos", U, py=_safe(math.acos, lambda a: nan), np=np.arccos, nb="math.acos({a})",
         torch="acos", vjp=lambda F, g, a, out: (-g / F.sqrt(1.0 - a * a),),
         api=("acos",), aliases=("arccos",), method=True)
register("atan", U, py=math.atan, np=np.arctan, nb="math.atan({a})", torch="atan",
         vjp=lambda F, g, a, out: (g / (1.0 + a * a),),
         api=("atan",), aliases=("arctan",), method=True)
register("sinh", U, py=_safe(math.sinh, lambda a: math.copysign(inf, a)), np=np.sinh,
         nb="math.sinh({a})", torch="sinh", vjp=lambda F, g, a, out: (g * F.cosh(a),),
         api=("sinh",), method=True)
register("cosh", U, py=_safe(math.cosh, lambda a: inf), np=np.cosh, nb="math.cosh({a})",
         torch="cosh", vjp=lambda F, g, a, out: (g * F.sinh(a),), api=("cosh",), method=True)
register("tanh", U, py=math.tanh, np=np.tanh, nb="math.tanh({a})", torch="tanh",
         vjp=lambda F, g, a, out: (g * (1.0 - out * out),), api=("tanh",), method=True)
register("sigmoid", U, py=_py_sigmoid, np=_np_sigmoid,
         nb="(1.0 / (1.0 + math.exp(-{a})) if {a} >= 0.0 else "
            "math.exp({a}) / (1.0 + math.exp({a})))", torch="sigmoid",
         vjp=lambda F, g, a, out: (g * (1.0 - out) * out,), api=("sigmoid",), method=True)
register("relu", U, py=_py_relu, np=_np_relu, nb="(0.0 if {a} < 0.0 else {a})",
         torch="relu", vjp=lambda F, g, a, out: (F.where(a <= 0.0, F.zeros_like(g), g),),
         api=("relu",), method=True, torch_saves=("out",))
register("erf", U, py=math.erf, np=_np_erf_fn, nb="math.erf({a})", torch="erf",
         vjp=lambda F, g, a, out: (g * (2.0 / math.sqrt(math.pi)) * F.exp(-(a * a)),),
         api=("erf",), method=True)
register("abs", U, py=abs, np=np.abs, nb="abs({a})", torch="abs",
         vjp=lambda F, g, a, out: (g * F.sign(a),),
         api=("abs",), aliases=("absolute",), method=True)
register("sign", U, py=_py_sign, np=lambda a: np.where(a != a, np.zeros_like(a), np.sign(a)),
         nb="((1.0 if {a} > 0.0 else 0.0) - (1.0 if {a} < 0.0 else 0.0))",
         torch="sign", vjp=lambda F, g, a, out: (F.zeros_like(g),), saves=False,
         api=("sign",), method=True)
register("square", U, py=lambda a: a * a, np=np.square, nb="({a} * {a})", torch="square",
         vjp=lambda F, g, a, out: (g * 2.0 * a ** 1.0,),  # pow(x, 2)'s: see powc
         api=("square",), method=True)
register("reciprocal", U, py=_safe(lambda a: 1.0 / a, lambda a: math.copysign(inf, a)),
         np=np.reciprocal, nb="(1.0 / {a})", torch="reciprocal",
         vjp=lambda F, g, a, out: (-g * (out * out),), api=("reciprocal",), method=True)

# --- unary with float constants (c0, c1) ------------------------------------------------------
C = UNARY_C
register("addc", C, py=lambda a, c0, c1: a + c0, np=lambda a, c0, c1: a + c0, nb="({a} + {c0})",
         vjp=lambda F, g, a, out, c0, c1: (g,), saves=False,
         via="`x + c`, `c + x`, `x - c` (`c` a number)")
register("mulc", C, py=lambda a, c0, c1: a * c0, np=lambda a, c0, c1: a * c0, nb="({a} * {c0})",
         vjp=lambda F, g, a, out, c0, c1: (g * c0,), via="`x * c`, `c * x`")
register("rsubc", C, py=lambda a, c0, c1: c0 - a, np=lambda a, c0, c1: c0 - a,
         nb="({c0} - {a})", vjp=lambda F, g, a, out, c0, c1: (-g,), saves=False, via="`c - x`")
register("divc", C, py=_safe(lambda a, c0, c1: a / c0, lambda a, c0, c1: _div_err(a, c0)),
         np=lambda a, c0, c1: a / c0, nb="({a} / {c0})",
         vjp=lambda F, g, a, out, c0, c1: (g / c0,), via="`x / c`")
register("rdivc", C, py=_safe(lambda a, c0, c1: c0 / a, lambda a, c0, c1: _div_err(c0, a)),
         np=lambda a, c0, c1: c0 / a, nb="({c0} / {a})",
         vjp=lambda F, g, a, out, c0, c1: (-g * ((c0 / a) / a),), via="`c / x`",  # div's
         torch_saves=())  # torch's c / x is reciprocal(x) * c: x itself is not saved
# torch's pow(x, c) for the exponents it computes otherwise: x * x (pow(x, 2.0) is off by an
# ulp on about 0.1% of inputs, and costs 7 ns a row in the compiled sweeps where x * x costs
# 1.5), x * x * x, 1 / (x * x), and sqrt / rsqrt, whose -0.0 gives -0.0 / -inf where pow
# gives 0.0 / inf (and nan at -inf); and its derivative's sqrt and rsqrt (of pow(x, 1.5) and
# pow(x, 0.5)). The rare ones (``POWC_SPECIAL``) are an op of their own, ``powc_special``,
# picked where a row is recorded (``powc_op``): powc's compiled branches keep only the
# square and pow, as the interpreters' hot loops need (their arms in powc's branch slowed
# every row of the compiled sweeps, Rosenbrock's Hessian-vector product 9.7 -> 17 us)

#: the exponents recorded as ``powc_special`` (its forward's or its rule's own arms)
POWC_SPECIAL = frozenset((3.0, 0.5, -0.5, -2.0, 1.5))


def powc_op(c0):
    """The op name of ``x ** c0`` (a number ``c0``): ``powc_special`` for the exponents
    ``POWC_SPECIAL``, ``powc`` for the others."""
    return "powc_special" if c0 in POWC_SPECIAL else "powc"


def _py_powc(a, c0):
    if c0 == 2.0:
        return a * a
    if c0 == 3.0:
        return a * a * a
    if c0 == 0.5:
        return math.sqrt(a) if a >= 0.0 else nan
    if c0 == -0.5:
        return (1.0 / math.sqrt(a) if a > 0.0 else math.copysign(inf, a) if a == 0.0
                else nan)
    if c0 == -2.0:
        d = a * a
        return 1.0 / d if d != 0.0 else inf
    return _py_pow(a, c0)


def _np_powc(a, c0):
    if c0 == 3.0:
        return a * a * a
    if c0 == 0.5:
        return np.sqrt(a)
    if c0 == -0.5:
        return 1.0 / np.sqrt(a)
    if c0 == -2.0:
        return 1.0 / (a * a)
    return np.square(a) if c0 == 2.0 else np.power(a, c0)


def _powc_vjp(F, g, a, out, c0, c1):
    # torch's c * pow(x, c - 1); x ** 1 and x ** 0 are recorded, so the derivatives of x ** 2
    # go on as torch's do: 2 * x ** 1, then 2 * x ** 0 (still a graph), then zeros
    return (F.cond(c0 == 0.0, lambda: F.zeros_like(g), lambda: F.cond(
        c0 == 2.0, lambda: g * (2.0 * a ** 1.0), lambda: g * c0 * a ** (c0 - 1.0))),)


def _powc_special_vjp(F, g, a, out, c0, c1):
    # powc's, with its forward's special cases for pow(x, c - 1) (sqrt, rsqrt: the sign of
    # -0.0's result); never 0 or 2
    return (F.cond(c0 == 1.5, lambda: g * 1.5 * F.sqrt(a), lambda: F.cond(
        c0 == 0.5, lambda: g * 0.5 * F.rsqrt(a), lambda: g * c0 * a ** (c0 - 1.0))),)


# (the forwards on Python floats and NumPy arrays take any exponent, torch's: the eager
# paths compute the value before they pick the op)
register("powc", C, py=lambda a, c0, c1: _py_powc(a, c0),
         np=lambda a, c0, c1: _np_powc(a, c0),
         nb="({a} * {a} if {c0} == 2.0 else {a} ** {c0})", torch="pow", vjp=_powc_vjp,
         via="`x ** c` (`c` a number but those of `powc_special`)")
register("powc_special", C, py=lambda a, c0, c1: _py_powc(a, c0),
         np=lambda a, c0, c1: _np_powc(a, c0),
         nb="({a} * {a} * {a} if {c0} == 3.0 else (math.sqrt({a}) if {c0} == 0.5 else "
            "(1.0 / math.sqrt({a}) if {c0} == -0.5 else (1.0 / ({a} * {a}) if {c0} == -2.0 "
            "else {a} ** {c0}))))", torch="pow", vjp=_powc_special_vjp,
         via="`x ** c` for `c` 3, 0.5, -0.5, -2 and 1.5 (torch computes these otherwise)")
register("rpowc", C, py=lambda a, c0, c1: _py_pow(c0, a), np=lambda a, c0, c1: np.power(c0, a),
         nb="({c0} ** {a})",
         vjp=lambda F, g, a, out, c0, c1: (
             F.where((a >= 0.0) & (c0 == 0.0), F.zeros_like(g), g * out * F.log(c0)),),
         via="`c ** x`")
register("clamp", C, py=_py_clamp, np=_np_clamp,
         nb="min(max({a}, {c0}), {c1}) if {a} == {a} else {a}", torch="clamp",
         vjp=lambda F, g, a, out, c0, c1: (
             F.where((a >= c0) & (a <= c1), g, F.zeros_like(g)),),
         api=("clamp", "clip"), method=True)
register("softplus", C, py=_py_softplus, np=_np_softplus,
         nb="({a} if {a} * {c0} > {c1} else math.log1p(math.exp({a} * {c0})) / {c0})",
         torch="softplus",
         vjp=lambda F, g, a, out, c0, c1: (
             F.where(a * c0 > c1, g, g * F.sigmoid(a * c0)),), api=("softplus",), method=True)

# --- binary ---------------------------------------------------------------------------------
B = BINARY


def _pow_vjp(F, g, a, b, out):
    ga = F.where(b == 0.0, F.zeros_like(g), g * b * a ** (b - 1.0))
    gb = F.where((a == 0.0) & (b >= 0.0), F.zeros_like(g), g * out * F.log(a))
    return ga, gb


def _atan2_vjp(F, g, a, b, out):
    # torch's: 1 / (a^2 + b^2) zeroed at the origin, the gradient 0 there; its next order
    # is nan at the origin, and 0 where the origin's nan is masked away (a setitem)
    d = a * a + b * b
    r = F.where(d == 0.0, F.zeros_like(d), 1.0 / d)
    return (g * b * r, -g * a * r)


def _max_vjp(F, g, a, b, out):
    return (F.where(a == b, g / 2.0, F.where(a < b, F.zeros_like(g), g)),
            F.where(a == b, g / 2.0, F.where(b < a, F.zeros_like(g), g)))


def _min_vjp(F, g, a, b, out):
    return (F.where(a == b, g / 2.0, F.where(a > b, F.zeros_like(g), g)),
            F.where(a == b, g / 2.0, F.where(b > a, F.zeros_like(g), g)))


register("add", B, py=operator.add, np=np.add, nb="({a} + {b})", torch="add",
         vjp=lambda F, g, a, b, out: (g, g), saves=False, const=(("addc", 1.0), ("addc", 1.0)),
         api=("add",), method=True)
register("sub", B, py=operator.sub, np=np.subtract, nb="({a} - {b})", torch="sub",
         vjp=lambda F, g, a, b, out: (g, -g), saves=False,
         const=(("addc", -1.0), ("rsubc", 1.0)), api=("sub",), aliases=("subtract",), method=True)
register("mul", B, py=operator.mul, np=np.multiply, nb="({a} * {b})", torch="mul",
         vjp=lambda F, g, a, b, out: (g * b, g * a), const=(("mulc", 1.0), ("mulc", 1.0)),
         api=("mul",), aliases=("multiply",), method=True)
register("div", B, py=_safe(operator.truediv, _div_err), np=np.true_divide, nb="({a} / {b})",
         torch="div", vjp=lambda F, g, a, b, out: (g / b, -g * ((a / b) / b)),  # torch's
         const=(("divc", 1.0), ("rdivc", 1.0)),
         api=("div",), aliases=("divide", "true_divide"), method=True)
register("pow", B, py=lambda a, b: a * a if b == 2.0 else _py_pow(a, b), np=_np_pow,
         nb="({a} ** {b})", torch="pow", vjp=_pow_vjp,
         const=(("powc", 1.0), ("rpowc", 1.0)), api=("pow",), method=True)
register("atan2", B, py=math.atan2, np=np.arctan2, nb="math.atan2({a}, {b})", torch="atan2",
         vjp=_atan2_vjp, api=("atan2",), aliases=("arctan2",), method=True)
register("maximum", B, py=_py_maximum, np=np.maximum,
         nb="({a} if ({a} > {b} or {a} != {a}) else {b})", torch="maximum", vjp=_max_vjp,
         api=("maximum",), method=True)
register("minimum", B, py=_py_minimum, np=np.minimum,
         nb="({a} if ({a} < {b} or {a} != {a}) else {b})", torch="minimum", vjp=_min_vjp,
         api=("minimum",), method=True)
# a NaN bound gives NaN, as torch's (the bound's max/min propagates it)
register("clamp_min_t", B, py=lambda a, b: b if (a < b or b != b) else a,
         np=lambda a, b: np.where((a < b) | (b != b), b, a),
         nb="({b} if ({a} < {b} or {b} != {b}) else {a})",
         vjp=lambda F, g, a, b, out: (F.where(a >= b, g, F.zeros_like(g)),
                                      F.where(a < b, g, F.zeros_like(g))),
         api=("clamp_min",), method=True, via="`torch.clamp(x, min=t)`, `t` a tensor")
register("clamp_max_t", B, py=lambda a, b: b if (a > b or b != b) else a,
         np=lambda a, b: np.where((a > b) | (b != b), b, a),
         nb="({b} if ({a} > {b} or {b} != {b}) else {a})",
         vjp=lambda F, g, a, b, out: (F.where(a <= b, g, F.zeros_like(g)),
                                      F.where(a > b, g, F.zeros_like(g))),
         api=("clamp_max",), method=True, via="`torch.clamp(x, max=t)`, `t` a tensor")
