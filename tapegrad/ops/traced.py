"""Ops that only traced programs contain: comparisons and logic, and the replay helpers
``detach``, ``select``, ``pick`` and ``guard``.

Tracing records comparisons (``x > 0``) so that a program recomputes them at new inputs; a
comparison's value is the truth value 1.0 or 0.0 and it has no gradient. The replay helpers
let array ops lower to scalar rows with eager mode's gradient conventions (``select`` is a
branch-free ``where``; ``pick`` adds nothing to a value (it is ``-0.0``, IEEE addition's
identity) but passes ``g * w`` to its input, which gives tied maxima their even split;
``round_f32`` is a cast to float32, which replay, computing in float64, must round;
``fms`` is ``a * b - c`` rounded once, as torch's cross kernel rounds its components).
"""
from __future__ import annotations

import numpy as np

from .._fma import fms_np, fms_py
from ._registry import COMPARE, REPLAY, register


def _cmp(name, sym, npop):
    register(name, COMPARE, arity=2, saves=False, np=npop,
             py=lambda a, b: 1.0 if npop(a, b) else 0.0,
             nb=f"(1.0 if {{a}} {sym} {{b}} else 0.0)", doc=f"a {sym} b as 1.0/0.0",
             via=f"`x {sym} y`")


_cmp("lt", "<", np.less)
_cmp("le", "<=", np.less_equal)
_cmp("gt", ">", np.greater)
_cmp("ge", ">=", np.greater_equal)
_cmp("eq", "==", np.equal)
_cmp("ne", "!=", np.not_equal)
# a == b, or both NaN: a max's ties in one test (the NaNs when the max is NaN), where
# select(m != m, a != a, a == m) took three passes over the elements
register("eq_nan", COMPARE, arity=2, saves=False,
         np=lambda a, b: np.equal(a, b) | (np.isnan(a) & np.isnan(b)),
         py=lambda a, b: 1.0 if (a == b or (a != a and b != b)) else 0.0,
         nb="(1.0 if ({a} == {b} or ({a} != {a} and {b} != {b})) else 0.0)",
         doc="a == b, or both NaN, as 1.0/0.0", via="a max's ties (traced programs)")
register("logical_and", COMPARE, arity=2, saves=False, np=np.logical_and,
         py=lambda a, b: 1.0 if (a != 0.0 and b != 0.0) else 0.0,
         nb="(1.0 if ({a} != 0.0 and {b} != 0.0) else 0.0)", doc="a and b",
         via="`torch.logical_and`, `&`")
register("logical_or", COMPARE, arity=2, saves=False, np=np.logical_or,
         py=lambda a, b: 1.0 if (a != 0.0 or b != 0.0) else 0.0,
         nb="(1.0 if ({a} != 0.0 or {b} != 0.0) else 0.0)", doc="a or b",
         via="`torch.logical_or`, `|`")
register("logical_xor", COMPARE, arity=2, saves=False, np=np.logical_xor,
         py=lambda a, b: 1.0 if ((a != 0.0) != (b != 0.0)) else 0.0,
         nb="(1.0 if (({a} != 0.0) != ({b} != 0.0)) else 0.0)", doc="a xor b",
         via="`torch.logical_xor`, `^`")
register("logical_not", COMPARE, arity=1, saves=False, np=np.logical_not,
         py=lambda a: 1.0 if a == 0.0 else 0.0, nb="(1.0 if {a} == 0.0 else 0.0)", doc="not a",
         via="`torch.logical_not`, `~`")

register("detach", REPLAY, arity=1, saves=False, py=lambda a: a, np=lambda a: a, nb="{a}",
         doc="a value used without its gradient", via="`Tensor.detach` (traced programs)")
register("select", REPLAY, arity=3, saves=False, nb="({b} if {a} != 0.0 else {c})",
         vjp=lambda F, g, a, b, c, out: (None, F.where(a != 0.0, g, F.zeros_like(g)),
                                         F.where(a != 0.0, F.zeros_like(g), g)),
         doc="b where a is true, else c (where, branch-free)",
         via="`torch.where` (traced programs)")
register("pick", REPLAY, arity=2, nb="(-0.0)", vjp=lambda F, g, a, b, c, out: (g * b, None),
         doc="-0.0, passing g * b to a (a share of a reduction's gradient)",
         via="a share of a reduction's gradient (traced programs)")
# max()/min() and max(dim)'s share: torch gives their gradient to the picked elements only
# (an index, a masked fill), so an inf or NaN gradient stays there, where pick's g * 0.0 is
# NaN at every other element; and the weight, a constant, is no term of its derivative
register("pick_where", REPLAY, arity=2, nb="(-0.0)",
         vjp=lambda F, g, a, b, c, out: (F.where(b != 0.0, g, F.zeros_like(g)), None),
         doc="-0.0, passing g to a where b is true and nothing elsewhere (a picked "
             "element's gradient)",
         via="max()/min() and max(dim)/min(dim) (traced programs)")
register("guard", REPLAY, arity=1, saves=False,
         doc="a branch taken while tracing: replay checks that a is still c0 (1.0/0.0)",
         via="a Python branch on a traced value")
register("round_f32", REPLAY, arity=1, saves=False, py=lambda a: float(np.float32(a)),
         np=lambda a: np.asarray(a, np.float32).astype(np.float64),
         nb="np.float64(np.float32({a}))",
         vjp=lambda F, g, a, b, c, out: (F.round_f32(g),),
         doc="a rounded to float32 (a traced cast to float32); its gradient is rounded too, "
             "as eager mode's (and torch's) cast rule")
# torch's cross rounds each component once less than its formula: fma(a_p, b_q, -(a_q *
# b_p)), the product a_q * b_p rounded (a mul row), the rest fused (cross's lowering)
register("fms", REPLAY, arity=3, py=fms_py, np=fms_np, nb="fma({a}, {b}, -{c})",
         vjp=lambda F, g, a, b, c, out: (g * b, g * a, -g),
         doc="a * b - c rounded once (fused multiply-subtract)",
         via="`torch.cross`, `torch.linalg.cross` (traced programs)")

# array instructions of traced programs (interpreters/program_arrays.py): the first row of
# an elementwise op over a range of slots, and the rows that hold the rest of its values
register("array_ew", REPLAY, arity=3, saves=False,
         doc="an elementwise op over a range of slots (the first of its rows)",
         via="array ops in traced programs")
register("array_tail", REPLAY, arity=0, saves=False,
         doc="the values of an array instruction after its first",
         via="array ops in traced programs")
register("array_red", REPLAY, arity=2, saves=False,
         doc="a sum, or a sum of products, of each of a range of runs of slots into one "
             "slot (the first of its rows; each term by add's and mul's rules)",
         via="sums and matmuls in traced programs")
