"""Backends that derivative rules are written against: generated Numba source and NumPy.

A rule is ``vjp(F, g, ...)``: it calls ``F.<op>`` for registered ops, ``F.where``,
``F.cond`` (a choice on constants whose branches are zero-argument functions, so NumPy
builds only the branch taken) and ``F.zeros_like``, and uses Python operators. ``SymF`` turns
it into source text for the generated interpreter; ``NpF`` runs it on NumPy values;
``NodeF`` builds it as an expression graph, which the code generator turns into Numba code
that records the rule onto a tape (the compiled ``create_graph=True`` sweep).
"""
from __future__ import annotations

import math

import numpy as np

from ._registry import ARRAY_OP, BINARY, COMPARE, OPS, REPLAY, UNARY, UNARY_C


# --- the one calling convention of a scalar rule ---------------------------------------------

def rule_inputs(op):
    """Names of the inputs whose gradients ``op``'s scalar rule returns, in order (the
    elementwise kinds and ``import_``; replay-only ops take up to three, a, b, c)."""
    kind = op.kind
    if kind is BINARY:
        return ("a", "b")
    if kind is REPLAY or kind is COMPARE:
        return ("a", "b", "c")[:op.arity]
    return ("a",)


def call_rule(op, F, g, out, a, b=None, c0=None, c1=None, c=None):
    """The gradients ``op``'s scalar rule returns (one per ``rule_inputs(op)``, None where
    it gives none) on backend ``F`` at adjoint ``g``, output ``out``, inputs ``a``, ``b``,
    ``c`` and constants ``c0``, ``c1``: the argument order of each kind's rule, stated once
    (array ops have one form, ``op.vjp(F, g, inputs, out, aux)``)."""
    kind = op.kind
    if kind is BINARY:
        return op.vjp(F, g, a, b, out)
    if kind is UNARY_C:
        return op.vjp(F, g, a, out, c0, c1)
    if kind is REPLAY or kind is COMPARE:
        return op.vjp(F, g, a, b, c, out)
    return op.vjp(F, g, a, out)  # unary, import_


def rule_of(op, F, arg):
    """{input name: gradient} of ``op``'s scalar rule with every argument ``arg(name)``
    (``g``, ``out``, ``a``, ``b``, ``c``, ``c0``, ``c1``): how a code generator runs a rule
    on symbols (``SymF``, ``NodeF``). Gradients that are None are left out."""
    grads = call_rule(op, F, arg("g"), arg("out"), arg("a"), arg("b"), arg("c0"), arg("c1"),
                      arg("c"))
    return {n: gr for n, gr in zip(rule_inputs(op), grads) if gr is not None}


def _src(x):
    if isinstance(x, Sym):
        return x.s
    if isinstance(x, bool):
        return "True" if x else "False"
    x = float(x)
    if math.isnan(x):
        return "math.nan"
    if math.isinf(x):
        return "math.inf" if x > 0 else "(-math.inf)"
    return repr(x)


class Sym:
    """A scalar expression under construction (source text)."""

    __slots__ = ("s",)

    def __init__(self, s):
        self.s = s

    def __repr__(self):
        return f"Sym({self.s})"

    def _bin(op):
        def f(self, other):
            return Sym(f"({self.s} {op} {_src(other)})")

        def r(self, other):
            return Sym(f"({_src(other)} {op} {self.s})")
        return f, r

    __add__, __radd__ = _bin("+")
    __sub__, __rsub__ = _bin("-")
    __mul__, __rmul__ = _bin("*")
    __truediv__, __rtruediv__ = _bin("/")
    _, __rpow__ = _bin("**")
    __gt__, _ = _bin(">")
    __ge__, _ = _bin(">=")
    __lt__, _ = _bin("<")
    __le__, _ = _bin("<=")
    __eq__, _ = _bin("==")
    __ne__, _ = _bin("!=")
    __and__, __rand__ = _bin("and")
    __or__, __ror__ = _bin("or")
    del _bin, _

    def __pow__(self, other):
        # x ** 1.0 is x for every double: the compiled rules read x (square's and pow(x,
        # 2)'s rule, 2 * x ** 1 as torch's, kept a graph in eager mode for its third
        # derivative, made every compiled sweep call pow: Rosenbrock's hvp 9.8 -> 17 us)
        if other.__class__ in (int, float) and other == 1:
            return self
        return Sym(f"({self.s} ** {_src(other)})")

    def __neg__(self):
        return Sym(f"(-{self.s})")

    def __invert__(self):
        return Sym(f"(not {self.s})")

    __hash__ = None


class _Namespace:
    def __init__(self, name):
        self._name = name

    def __repr__(self):
        return f"<rule backend {self._name}>"


def _sym_call(op):
    names = {UNARY: ("a",), UNARY_C: ("a", "c0", "c1"), BINARY: ("a", "b")}.get(
        op.kind, ("a", "b", "c"))  # replay-only ops name their inputs a, b, c

    def call(*args):
        return Sym(op.nb.format(**{n: _src(v) for n, v in zip(names, args)}))
    call.__name__ = op.name
    return call


def _np_where(c, x, y):
    if c is True or c is False:  # a condition on constants only
        return x if c else y
    return np.where(c, x, y)


def _np_cond(c, x, y):
    if c is True or c is False or isinstance(c, np.bool_):
        return x() if c else y()
    return np.where(c, x(), y())


def build_backends():
    """(SymF, NpF) with one function per registered elementwise op."""
    SymF, NpF = _Namespace("sym"), _Namespace("numpy")
    for op in OPS:
        if op.kind in (UNARY, UNARY_C, BINARY):
            setattr(SymF, op.name, _sym_call(op))
            setattr(NpF, op.name, op.np)
        elif op.kind == ARRAY_OP:
            setattr(NpF, op.name, op.np)
        elif op.kind == REPLAY and op.nb is not None and op.vjp is not None:
            setattr(SymF, op.name, _sym_call(op))  # rules that re-apply them (round_f32)
    SymF.where = lambda c, x, y: Sym(f"({_src(x)} if {_src(c)} else {_src(y)})")
    # cond: a choice on constants, with branches built only when taken (lazy)
    SymF.cond = lambda c, x, y: SymF.where(c, x(), y())
    SymF.zeros_like = lambda x: Sym("0.0")
    SymF.raw = NpF.raw = lambda x: x  # the plain value, for masks (tensors give their data)
    NpF.where = _np_where
    NpF.cond = _np_cond
    NpF.zeros_like = lambda x: 0.0  # broadcasts; the sweep widens it to the input's shape
    return SymF, NpF


# --- expression graphs (the compiled re-recording sweep) ------------------------------------

#: Python operators as the binary ops they record
OPERATOR_OPS = {"+": "add", "-": "sub", "*": "mul", "/": "div", "**": "pow"}


class Node:
    """One node of a rule's expression graph. ``op`` is ``"in"`` (an argument of the rule:
    ``args`` is its name), ``"num"`` (a Python number), a registered op's name (``args``:
    its operands and float constants), a comparison (``<``, ``==``...), ``and``/``or``/
    ``not`` (truth values, never recorded) or ``where`` (condition, then, else)."""

    __slots__ = ("op", "args")

    def __init__(self, op, *args):
        self.op, self.args = op, args

    def __repr__(self):
        return f"Node({self.op}, {self.args})"

    def _bin(sym):
        name = OPERATOR_OPS.get(sym, sym)

        def f(self, other):
            return Node(name, self, _node(other))

        def r(self, other):
            return Node(name, _node(other), self)
        return f, r

    __add__, __radd__ = _bin("+")
    __sub__, __rsub__ = _bin("-")
    __mul__, __rmul__ = _bin("*")
    __truediv__, __rtruediv__ = _bin("/")
    __pow__, __rpow__ = _bin("**")
    __gt__, _ = _bin(">")
    __ge__, _ = _bin(">=")
    __lt__, _ = _bin("<")
    __le__, _ = _bin("<=")
    __eq__, _ = _bin("==")
    __ne__, _ = _bin("!=")
    __and__, __rand__ = _bin("and")
    __or__, __ror__ = _bin("or")
    del _bin, _

    def __neg__(self):
        return Node("neg", self)

    def __invert__(self):
        return Node("not", self)

    __hash__ = object.__hash__  # nodes are shared by identity within one rule


def _node(x):
    return x if isinstance(x, Node) else Node("num", x)


def build_node_backend():
    """``NodeF``: rules run on it return ``Node`` graphs."""
    NodeF = _Namespace("nodes")
    for op in OPS:
        if op.kind in (UNARY, UNARY_C, BINARY):
            setattr(NodeF, op.name,
                    lambda *args, _n=op.name: Node(_n, *[_node(a) for a in args]))
    NodeF.where = lambda c, x, y: Node("where", _node(c), _node(x), _node(y))
    NodeF.cond = lambda c, x, y: Node("where", _node(c), _node(x()), _node(y()))
    NodeF.zeros_like = lambda x: Node("num", 0.0)
    NodeF.raw = lambda x: x
    return NodeF
